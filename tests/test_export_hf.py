"""Checkpoints of TP = 2, PP = 2 runs (4 CPU processes, 2 iterations, a tiny model on
scripts/examples/prepare_data.py's data) hold the common state Megatron-LM saves.

Two runs, shared by every test here:
  * "gpt2": GPT-2 style (learned positions, LayerNorm, GeLU, biases, tied embeddings), 2BW,
    GPT2BPETokenizer by Megatron-LM's default (--vocab-file/--merge-file, no --tokenizer-type);
  * "llama": Llama style (rope base 500000, RMSNorm eps 1e-6, SwiGLU, no biases, GQA with 8
    query heads in 2 groups, untied output layer), the distributed optimizer, a HuggingFace
    tokenizer folder.

Common state: the values are derived from Megatron-LM's code at core_v0.16.1, not from ours:
  * megatron/training/tokenizer/tokenizer.py ``build_tokenizer``: ``args.padded_vocab_size =
    _vocab_size_with_padding(tokenizer.vocab_size, args)``, the vocabulary rounded up to a
    multiple of make_vocab_size_divisible_by x TP (HuggingFace: ``len(AutoTokenizer)``);
  * megatron/training/checkpointing.py ``load_checkpoint`` / ``check_checkpoint_args`` /
    ``load_args_from_checkpoint``: the args fields they read (ARGS_READ below);
  * ``_build_sharded_state_dict_metadata``: the distributed optimizer saves
    'dp_reshardable' (no --dist-ckpt-optim-fully-reshardable), for which megatron-core's
    ``DistributedOptimizer.sharded_state_dict`` turns every entry of its ``state_dict()``
    (``optimizer`` = {"param_groups": ...} without "params") into a ShardedObject per DP group:
    the common "optimizer" keeps only ``param_state_sharding_type``, the param groups live in
    ``optimizer.distributed.dp_group_idx_<i>.optimizer`` objects (Megatron-LM's own checkpoints
    have them there too), one group with weight decay and one without (biases, norms).
"""

from __future__ import annotations

import io
import math
import re

import pytest

from tests import dist as launch
from tests.test_examples import example_data  # noqa: F401  (the module's shared data)

SIZES = ["--cpu", "--num-layers", "4", "--hidden-size", "64", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-2",
         "--lr-decay-style", "constant", "--split", "949,50,1", "--eval-iters", "0",
         "--save-interval", "2", "--log-interval", "1", "--tensor-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "2", "--distributed-timeout-minutes", "1",
         "--num-workers", "0"]
TP = 2
LR = 1e-2
ITERATIONS = 2
# load_checkpoint, check_checkpoint_args and load_args_from_checkpoint (core_v0.16.1): the
# fields of the saved args they read
ARGS_READ = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples",
             "tensor_model_parallel_size", "pipeline_model_parallel_size", "world_size",
             "data_parallel_size", "no_save_rng", "no_save_optim", "num_layers", "hidden_size",
             "num_attention_heads", "add_position_embedding", "max_position_embeddings",
             "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type",
             "global_batch_size", "ffn_hidden_size", "kv_channels", "num_query_groups",
             "group_query_attention", "normalization", "swiglu", "add_bias_linear",
             "add_qkv_bias", "position_embedding_type", "rotary_base", "rotary_percent",
             "untie_embeddings_and_output_weights", "seq_length", "tokenizer_model")
MEGATRON_COMMON_KEYS = {"args", "checkpoint_version", "iteration", "optimizer",
                        "opt_param_scheduler", "num_floating_point_operations_so_far",
                        "content_metadata"}


def _flags(kind: str, data) -> list[str]:
    if kind == "gpt2":
        return ["--num-attention-heads", "4", "--pipeline-schedule", "2bw",
                "--data-path", str(data / "gpt3" / "my-gpt3_text_document"),
                "--vocab-file", str(data / "gpt2-vocab.json"),
                "--merge-file", str(data / "gpt2-merges.txt")]
    return ["--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2",
            "--kv-channels", "8", "--ffn-hidden-size", "96", "--position-embedding-type",
            "rope", "--rotary-base", "500000", "--normalization", "RMSNorm", "--norm-epsilon",
            "1e-6", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
            "--use-distributed-optimizer", "--pipeline-schedule", "flush",
            "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(data / "llama3-tokenizer"),
            "--data-path", str(data / "llama3" / "my-llama3_text_document")]


@pytest.fixture(scope="module")
def checkpoints(example_data, tmp_path_factory):  # noqa: F811
    """{kind: checkpoint root} of the two runs."""
    roots = {}
    for kind in ("gpt2", "llama"):
        root = tmp_path_factory.mktemp(kind) / "checkpoints"
        done = launch.torchrun(["pretrain_gpt_2bw.py", *SIZES, *_flags(kind, example_data),
                                "--save", str(root)], 4, timeout=240)
        assert done.returncode == 0, done.tail(60)
        roots[kind] = root
    return roots


def _common(root):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(root / "iter_0000002"))


def _saved_objects(path, prefix: str) -> dict:
    """The ShardedObjects under ``prefix`` of a torch_dist checkpoint (torch's own reader)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    reader = FileSystemReader(str(path))
    keys = [k for k, v in reader.read_metadata().state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(v, BytesStorageMetadata)]
    objects = {k: io.BytesIO() for k in keys}
    load(objects, storage_reader=reader, no_dist=True)
    return {k: v[0] for k, v in objects.items()}


def _megatron_tokenizer_vocab(kind: str, data) -> int:
    """``tokenizer.vocab_size`` as Megatron-LM's tokenizer classes count it: GPT-2's
    vocab.json entries; len(AutoTokenizer) for a HuggingFace folder."""
    import json

    if kind == "gpt2":
        return len(json.loads((data / "gpt2-vocab.json").read_text()))
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(data / "llama3-tokenizer")))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_common_state_is_what_megatron_lm_saves(checkpoints, example_data, kind):  # noqa: F811
    common = _common(checkpoints[kind])
    assert MEGATRON_COMMON_KEYS <= set(common), sorted(common)
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == ITERATIONS
    args = common["args"]
    missing = [name for name in ARGS_READ if not hasattr(args, name)]
    assert not missing, missing
    multiple = 128 * TP  # --make-vocab-size-divisible-by's default x TP
    padded = math.ceil(_megatron_tokenizer_vocab(kind, example_data) / multiple) * multiple
    assert args.padded_vocab_size == padded
    assert args.tokenizer_type == {"gpt2": "GPT2BPETokenizer",  # pretrain_gpt.py's default
                                   "llama": "HuggingFaceTokenizer"}[kind]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.world_size, args.data_parallel_size) == (2, 2, 4, 1)
    assert (args.consumed_train_samples, args.skipped_train_samples,
            args.consumed_valid_samples) == (8, 0, 0)


def test_distributed_optimizer_param_groups_are_where_megatron_lm_keeps_them(checkpoints):
    root = checkpoints["llama"]
    common = _common(root)
    assert common["optimizer"] == {"param_state_sharding_type": "dp_reshardable"}
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "dp_reshardable"
    objects = _saved_objects(root / "iter_0000002", "optimizer.distributed.")
    groups_objects = {k: v for k, v in objects.items()
                      if re.fullmatch(r"optimizer\.distributed\.dp_group_idx_\d+\.optimizer/.*", k)}
    assert len(groups_objects) == 4, sorted(objects)  # one per (TP, PP) rank's DP group
    for saved in groups_objects.values():
        groups = saved["param_groups"]
        assert sorted(g["wd_mult"] for g in groups) == [0.0, 1.0], groups
        for group in groups:
            assert "params" not in group
            assert group["lr"] == group["max_lr"] == LR and group["min_lr"] == 0.0
            assert group["weight_decay"] == 0.01 * group["wd_mult"]  # --weight-decay's default
            assert group["step"] == ITERATIONS  # torch Adam without apex/TE: the step count
