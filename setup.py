"""megatron-2bw: PipeDream-2BW and pipeline baselines for megatron-core."""

from setuptools import find_packages, setup

setup(
    name="megatron-2bw",
    version="0.1.0",
    description=(
        "PipeDream-2BW (double-buffered weight updates), PipeDream-Flush, GPipe and a "
        "layout planner for megatron-core"
    ),
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_2bw", "megatron_2bw.*"]),
    # Megatron-LM's parser at core_v0.16.1, read at run time by megatron_lm_flags.py
    package_data={"megatron_2bw": ["megatron_lm_flags_core_v0.16.1.json"]},
    py_modules=["pretrain_gpt_2bw", "pretrain_bert_2bw"],
    install_requires=[
        # torch is pinned loosely on purpose: clusters bring their own CUDA build; the
        # Makefile installs the CPU build (torch==2.13.0) first on machines without a GPU.
        # 2.7: torch._C._autograd._unsafe_set_version_counter with tuples (weights.py);
        # megatron_2bw/runtime/versions.py checks both pins at start-up.
        "torch>=2.7",
        "megatron-core==0.16.1",
        "sentencepiece>=0.2",
        "numpy>=1.26",
        "psutil>=5.9",  # megatron-core's async checkpoint writer imports it
        "tensorboard>=2.14",  # --tensorboard-dir (torch.utils.tensorboard writes the events)
        "regex>=2022.1",  # GPT-2's pre-tokenizer pattern (\\p{L}, \\p{N}) for GPT2BPETokenizer
    ],
    extras_require={
        # NVIDIA apex is built from source (https://github.com/NVIDIA/apex) and is optional.
        "gpu": ["transformer-engine[pytorch]"],
        # --tokenizer-type HuggingFaceTokenizer (megatron-core's AutoTokenizer wrapper) and
        # tools/export_hf.py (model.safetensors, the tokenizer files).
        "hf": ["transformers>=4.40", "safetensors>=0.4"],
        # The tests load a HuggingFace tokenizer folder and exported models, so dev includes
        # hf's packages; scripts/examples/prepare_data.py trains GPT-2 BPE and WordPiece files
        # with tokenizers.
        "dev": ["pytest>=8", "pytest-xdist>=3.5", "matplotlib>=3.8", "transformers>=4.40",
                "safetensors>=0.4", "tokenizers>=0.19"],
    },
)
