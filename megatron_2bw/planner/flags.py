"""What the user runs: the chosen layout as `pretrain_{gpt,bert}_2bw.py` flags, a torchrun
script, a Slurm sbatch script, and `plan.json` with the ranked alternatives (plus
`rejected.csv` with every infeasible layout and why).

    write_plan(plan, "plan/")   # plan.json, rejected.csv, flags.txt, launch.sh, plan.sbatch

Data flags are left to the user: the scripts read `$DATA_PATH` and `$TOKENIZER_MODEL` (or a
whole `$DATA_ARGS`, e.g. DATA_ARGS=--mock-data), and pass their own arguments on.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import shlex
from pathlib import Path
from typing import Sequence

from .cluster import GiB, Cluster
from .cost import Layout
from .model import ModelSpec
from .search import Candidate, Plan

__all__ = ["launch_flags", "entry_script", "flag_line", "torchrun_script", "sbatch_script",
           "write_plan", "plan_to_json", "parse_for_validation"]

_DATA_ARGS = '${DATA_ARGS:---data-path "$DATA_PATH" --tokenizer-model "$TOKENIZER_MODEL"}'
# the training length (Megatron-LM requires --train-iters or --train-samples; the plan does
# not choose one): TRAIN_ARGS="--train-samples N" replaces it
_TRAIN_ARGS = '${TRAIN_ARGS:---train-iters 200}'


def entry_script(model: ModelSpec) -> str:
    return f"pretrain_{model.kind}_2bw.py"


# the peak learning rate (Megatron-LM requires --lr; the plan does not choose it): that of
# scripts/models.sh; a later --lr on the script's command line replaces it
_PEAK_LR = {"gpt": "1.5e-4", "bert": "1e-4"}


def launch_flags(layout: Layout, model: ModelSpec, precision: str, *, cpu: bool = False,
                 distributed_optimizer: bool = False, clip_grad: bool = True,
                 deferred_step: bool = True) -> list[str]:
    """The layout and model as our entry scripts' flags (Megatron-LM's names), data and
    training length excluded."""
    flags = [
        "--tensor-model-parallel-size", str(layout.t),
        "--pipeline-model-parallel-size", str(layout.d),
        "--pipeline-schedule", layout.schedule,
        "--num-layers", str(model.num_layers),
        "--hidden-size", str(model.hidden_size),
        "--num-attention-heads", str(model.num_attention_heads),
        "--seq-length", str(model.seq_length),
        "--max-position-embeddings", str(model.seq_length),
        "--micro-batch-size", str(layout.b),
        "--global-batch-size", str(layout.global_batch),
        "--lr", _PEAK_LR[model.kind],
    ]
    if model.ffn_hidden_size and model.ffn_hidden_size != 4 * model.hidden_size:
        flags += ["--ffn-hidden-size", str(model.ffn_hidden_size)]
    if model.make_vocab_size_divisible_by != 128:
        flags += ["--make-vocab-size-divisible-by", str(model.make_vocab_size_divisible_by)]
    if model.untie_embeddings and model.kind == "gpt":
        flags.append("--untie-embeddings-and-output-weights")
    if not model.dropout:
        flags += ["--hidden-dropout", "0", "--attention-dropout", "0"]
    if precision in ("bf16", "fp16"):
        flags.append(f"--{precision}")
    if layout.recompute:
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
    if distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    if not clip_grad:
        flags += ["--clip-grad", "0"]
    if not deferred_step and layout.schedule == "2bw":
        flags.append("--no-deferred-step")
    if cpu:
        flags.append("--cpu")
    return flags


def _flags_for(candidate: Candidate, plan: Plan) -> list[str]:
    r = plan.request
    return launch_flags(candidate.layout, r.model, r.precision, cpu=r.cluster.device == "cpu",
                        distributed_optimizer=r.distributed_optimizer, clip_grad=r.clip_grad,
                        deferred_step=r.deferred_step)


def flag_line(candidate: Candidate, plan: Plan) -> str:
    return shlex.join(_flags_for(candidate, plan))


def _header(candidate: Candidate, plan: Plan) -> list[str]:
    r, c = plan.request, candidate
    return [f"# megatron-2bw plan for {r.model.kind.upper()} L={r.model.num_layers} "
            f"h={r.model.hidden_size} a={r.model.num_attention_heads} s={r.model.seq_length} "
            f"on {r.cluster.nodes} x {r.cluster.gpus_per_node} ({r.cluster.name}), B={r.global_batch_size}",
            f"# layout {c.layout.label()}: predicted {c.samples_per_s:.2f} samples/s, "
            f"{c.time.iteration:.3f} s/iteration, {c.memory.peak / GiB:.2f} GiB per device"]


def torchrun_script(candidate: Candidate, plan: Plan) -> str:
    """One torchrun per node; NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT from the
    environment (one node: the defaults)."""
    cluster, model = plan.request.cluster, plan.request.model
    flags = " \\\n    ".join(shlex.join(pair) for pair in _pairs(_flags_for(candidate, plan)))
    return "\n".join([
        "#!/bin/bash",
        *_header(candidate, plan),
        "# usage: DATA_PATH=... TOKENIZER_MODEL=... [TRAIN_ARGS='--train-iters N'] [NNODES=.. "
        "NODE_RANK=.. MASTER_ADDR=..] bash launch.sh [more flags]",
        "set -euo pipefail",
        f'NNODES="${{NNODES:-{cluster.nodes}}}"',
        'NODE_RANK="${NODE_RANK:-0}"',
        'MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"',
        'MASTER_PORT="${MASTER_PORT:-29500}"',
        "# shellcheck disable=SC2086",
        f"torchrun --nnodes \"$NNODES\" --node-rank \"$NODE_RANK\" "
        f"--nproc-per-node {cluster.gpus_per_node} \\",
        '    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \\',
        f"    {entry_script(model)} \\",
        f"    {flags} \\",
        f"    {_TRAIN_ARGS} {_DATA_ARGS} \"$@\"",
        ""])


def sbatch_script(candidate: Candidate, plan: Plan) -> str:
    """Slurm: one task per node, each a torchrun with the c10d rendezvous on the first node."""
    cluster, model = plan.request.cluster, plan.request.model
    flags = " \\\n    ".join(shlex.join(pair) for pair in _pairs(_flags_for(candidate, plan)))
    return "\n".join([
        "#!/bin/bash",
        *_header(candidate, plan),
        "# usage: DATA_PATH=... TOKENIZER_MODEL=... [TRAIN_ARGS='--train-iters N'] sbatch "
        "plan.sbatch [more flags]",
        "#SBATCH --job-name=megatron-2bw",
        f"#SBATCH --nodes={cluster.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={cluster.gpus_per_node}",
        "#SBATCH --exclusive",
        "set -euo pipefail",
        "# the first node hosts the rendezvous (sed reads the whole list: no SIGPIPE under "
        "pipefail)",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',
        "export MASTER_ADDR",
        "# shellcheck disable=SC2086",
        f"srun torchrun --nnodes \"$SLURM_NNODES\" --nproc-per-node {cluster.gpus_per_node} \\",
        '    --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:29500" \\',
        f"    {entry_script(model)} \\",
        f"    {flags} \\",
        f"    {_TRAIN_ARGS} {_DATA_ARGS} \"$@\"",
        ""])


def _pairs(flags: Sequence[str]) -> list[list[str]]:
    """['--a', '1', '--b'] -> [['--a', '1'], ['--b']] (one flag per script line)."""
    out: list[list[str]] = []
    for item in flags:
        if item.startswith("--") or not out:
            out.append([item])
        else:
            out[-1].append(item)
    return out


def parse_for_validation(flags: Sequence[str], model: ModelSpec, world_size: int):
    """Parse `flags` with the entry script's parser and run our `validate_args` for
    `world_size` ranks; raises `FlagError` naming the first bad flag."""
    from megatron_2bw.arguments import build_parser, validate_args

    parser = build_parser()
    if model.kind == "bert":
        import importlib.util

        path = Path(__file__).resolve().parents[2] / "pretrain_bert_2bw.py"
        spec = importlib.util.spec_from_file_location("_pretrain_bert_2bw", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        parser = module.parser()
    return validate_args(parser.parse_args(list(flags)), world_size)


# ---- plan.json and rejected.csv ----------------------------------------------------------


def _candidate_json(c: Candidate, plan: Plan, rank: int) -> dict:
    return {
        "rank": rank,
        "layout": dataclasses.asdict(c.layout),
        "samples_per_s": c.samples_per_s,
        "seconds_per_iteration": c.time.iteration,
        "bubble_fraction": c.time.bubble_fraction,
        "time_method": c.time.method,
        "peak_memory_bytes": c.memory.peak,
        "peak_memory_stage": c.memory.peak_stage.stage,
        "memory": [dataclasses.asdict(s) | {"total": s.total} for s in c.memory.stages],
        "memory_stages": "the first and the last stage (they bound the middle ones)",
        "time": {k: v for k, v in dataclasses.asdict(c.time).items()},
        "flags": _flags_for(c, plan),
    }


def plan_to_json(plan: Plan, top: int = 20) -> dict:
    r = plan.request
    return {
        "format": "megatron-2bw plan v1",
        "request": {
            "model": dataclasses.asdict(r.model),
            "cluster": _cluster_json(r.cluster),
            "global_batch_size": r.global_batch_size,
            "precision": r.precision,
            "schedules": list(r.schedules),
            "micro_batch_sizes": list(r.micro_batch_sizes),
            "recompute": list(r.recompute),
            "memory_fraction": r.memory_fraction,
            "optimizer": r.optimizer,
            "distributed_optimizer": r.distributed_optimizer,
        },
        "choice": _candidate_json(plan.best, plan, 1) if plan.best else None,
        "alternatives": [_candidate_json(c, plan, i + 1)
                         for i, c in enumerate(plan.ranked[:top])],
        "feasible": len(plan.ranked),
        "rejected": len(plan.rejected),
        "considered": plan.considered,
        "search_seconds": plan.seconds,
    }


def _cluster_json(cluster: Cluster) -> dict:
    out = dataclasses.asdict(cluster)
    out["num_gpus"] = cluster.num_gpus
    return out


REJECTED_FIELDS = ("t", "d", "w", "b", "m", "recompute", "schedule", "reason", "memory_gib")


def write_plan(plan: Plan, out_dir: str | Path, top: int = 20) -> dict[str, Path]:
    """plan.json, rejected.csv, and for the choice flags.txt, launch.sh, plan.sbatch."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"plan": out / "plan.json", "rejected": out / "rejected.csv"}
    paths["plan"].write_text(json.dumps(plan_to_json(plan, top), indent=1) + "\n")
    with open(paths["rejected"], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(REJECTED_FIELDS)
        for r in plan.rejected:
            writer.writerow([r.t, r.d, r.w, r.b, r.m, r.recompute, r.schedule, r.reason,
                             "" if r.memory_bytes is None else f"{r.memory_bytes / GiB:.3f}"])
    if plan.best is not None:
        paths["flags"] = out / "flags.txt"
        paths["torchrun"] = out / "launch.sh"
        paths["sbatch"] = out / "plan.sbatch"
        paths["flags"].write_text(flag_line(plan.best, plan) + "\n")
        paths["torchrun"].write_text(torchrun_script(plan.best, plan))
        paths["sbatch"].write_text(sbatch_script(plan.best, plan))
        paths["torchrun"].chmod(0o755)
    return paths
