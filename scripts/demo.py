"""The demo: a small GPT trained with PipeDream-2BW over 2 pipeline stages on 2 CPU processes,
on the embedded corpus (the Python standard library's sources, tokenized once and cached).

    python scripts/demo.py [extra pretrain_gpt_2bw.py flags, which override the defaults]
"""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEMO_FLAGS = [
    "--pipeline-schedule", "2bw",
    "--pipeline-model-parallel-size", "2",
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128",
    "--micro-batch-size", "4", "--global-batch-size", "16",
    "--train-iters", "150", "--lr", "3e-3", "--min-lr", "3e-4",
    "--lr-warmup-iters", "10", "--lr-decay-style", "cosine",
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--log-interval", "1", "--eval-interval", "50", "--eval-iters", "4",
    "--split", "949,50,1", "--seed", "1234",
]


def main() -> int:
    from megatron_2bw.data.default import prepare_default_data
    from megatron_2bw.runtime.ports import free_port

    data = prepare_default_data()
    command = [
        str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2",
        "--master-port", os.environ.get("MASTER_PORT") or str(free_port()),
        str(REPO / "pretrain_gpt_2bw.py"),
        "--data-path", data.data_prefix, "--tokenizer-model", data.tokenizer_model,
        *DEMO_FLAGS, *sys.argv[1:],
    ]
    print("running:", " ".join(command), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main())
