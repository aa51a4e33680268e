"""What the user runs: the chosen layout as `pretrain_{gpt,bert}_2bw.py` flags, a torchrun
script, a Slurm sbatch script, and `plan.json` with the ranked alternatives (plus
`rejected.csv` with every infeasible layout and why).

    training = training_flags(args)       # --train-iters, --lr, ... as given to plan.py
    write_plan(plan, "plan/", training=training)
    # plan.json, rejected.csv, flags.txt, launch.sh, plan.sbatch

Invariants of the written scripts: they run from any working directory (`$REPO`, `$PYTHON`
to move them); they carry every flag the plan needs (training length and learning rate when
given to the planner, else the run asks for them in one line); data flags are left to the
user (`$DATA_PATH` and `$TOKENIZER_MODEL`, or `$DATA_ARGS`); the Slurm script takes the
rendezvous host and port from the allocation, as Megatron-LM's Slurm examples do.
More: docs/planner.md, "The planner as a library".
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Sequence

from megatron_2bw.arguments import FlagError, int_at_least, number_in
from megatron_2bw.schedules import (LayerSplit, LayoutError, LayoutFlags, keeps_versions,
                                    layer_split)

from .cluster import GiB, Cluster
from .cost import Layout
from .model import ModelSpec
from .search import Candidate, Plan, Rejection

__all__ = ["launch_flags", "layout_flags", "entry_script", "flag_line", "torchrun_script",
           "sbatch_script",
           "write_plan", "plan_to_json", "parse_for_validation", "add_training_flags",
           "training_flags", "REPO"]

REPO = Path(__file__).resolve().parents[2]
"""The checkout whose entry scripts the written scripts launch (unless `$REPO` says)."""

_DATA_ARGS = '${DATA_ARGS:---data-path "$DATA_PATH" --tokenizer-model "$TOKENIZER_MODEL"}'

# ---- the training run's length and learning rate: plan.py's flags, passed through ---------

TRAINING_FLAGS = (
    ("--train-iters", int_at_least(1), "iterations to train (or --train-samples)"),
    ("--train-samples", int_at_least(1), "samples to train (or --train-iters)"),
    ("--lr", number_in(0, low_open=True), "peak learning rate (default: 1.5e-4 GPT, 1e-4 "
                                          "BERT, as scripts/models.sh)"),
    ("--min-lr", number_in(0), None),
    ("--lr-decay-style", None, "constant, linear, cosine, inverse-square-root or WSD"),
    ("--lr-decay-iters", int_at_least(1), None),
    ("--lr-decay-samples", int_at_least(1), None),
    ("--lr-warmup-iters", int_at_least(0), None),
    ("--lr-warmup-samples", int_at_least(0), None),
    ("--lr-warmup-fraction", number_in(0, 1), None),
    ("--weight-decay", number_in(0), None),
)
"""(flag, type, help) of the training flags plan.py passes to the scripts: the entry script's
names and ranges; combinations are checked by the entry's own validator."""

_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


def add_training_flags(parser: argparse.ArgumentParser) -> None:
    """The `TRAINING_FLAGS` group; each defaults to None (not given: not written)."""
    group = parser.add_argument_group(
        "training run (written into flags.txt and the scripts as given)")
    for flag, kind, help_text in TRAINING_FLAGS:
        choices = _DECAY_STYLES if flag == "--lr-decay-style" else None
        group.add_argument(flag, type=kind, choices=choices, default=None, help=help_text)


def training_flags(args: argparse.Namespace) -> list[str]:
    """The `TRAINING_FLAGS` given on plan.py's command line, as flags, checked by the entry
    script's validator on a one-rank stand-in model with the plan's global batch (a bad
    combination raises `FlagError` naming the flag, before anything is planned)."""
    flags: list[str] = []
    for flag, _, _ in TRAINING_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            flags += [flag, str(value)]
    if flags:
        lr = [] if "--lr" in flags else ["--lr", _PEAK_LR[getattr(args, "model", "gpt")]]
        _validate_on_stand_in(lr + flags, getattr(args, "global_batch_size", None) or 1)
    return flags


def refuse_what_training_refuses(model: ModelSpec, precision: str, optimizer: str,
                                 distributed_optimizer: bool, correction: str) -> None:
    """The run-wide choices (precision, optimizer, its sharding, 2BW's correction, experts)
    through the entry script's validator on a one-rank stand-in: a combination the training
    refuses raises `FlagError` in its words, so no plan is written that would not launch."""
    flags = ["--lr", "1e-4", "--optimizer", optimizer]
    flags += {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(precision, [])
    flags += ["--use-distributed-optimizer"] if distributed_optimizer else []
    if correction != "none":
        flags += ["--stale-weight-correction", correction, "--pipeline-schedule", "2bw"]
    if model.is_moe:  # as every MoE plan writes them (the layer pattern is the model's)
        flags += ["--num-experts", str(model.num_experts), "--moe-router-topk",
                  str(model.moe_router_topk), "--moe-token-dispatcher-type", "alltoall",
                  "--disable-bias-linear"]
    try:
        _validate_on_stand_in(flags, 1)
    except FlagError as error:
        message = str(error).split(": ", 1)[-1]
        raise FlagError(error.flag, f"{message} (the training refuses it)") from None


def _validate_on_stand_in(flags: list[str], global_batch: int) -> None:
    """Our `validate_args` for one rank on a tiny model with `flags` added."""
    from megatron_2bw.arguments import build_parser, validate_args

    stand_in = ["--num-layers", "1", "--hidden-size", "8", "--num-attention-heads", "1",
                "--seq-length", "8", "--max-position-embeddings", "8", "--cpu",
                "--micro-batch-size", "1", "--global-batch-size", str(global_batch),
                "--mock-data", "--vocab-size", "8"]
    if not {"--train-iters", "--train-samples"} & set(flags):  # the length is the run's
        stand_in += ["--train-iters", "1"]
    validate_args(build_parser().parse_args(stand_in + flags), world_size=1)


def entry_script(model: ModelSpec) -> str:
    return f"pretrain_{model.kind}_2bw.py"


# the peak learning rate when plan.py is given no --lr (Megatron-LM requires one): that of
# scripts/models.sh; a later --lr on the script's command line replaces it
_PEAK_LR = {"gpt": "1.5e-4", "bert": "1e-4"}


def launch_flags(layout: Layout, model: ModelSpec, precision: str, *, cpu: bool = False,
                 distributed_optimizer: bool = False, sequence_parallel: bool = False,
                 clip_grad: bool = True, optimizer: str = "adam", correction: str = "none",
                 deferred_step: bool = True, training: Sequence[str] = ()) -> list[str]:
    """The layout and model as our entry scripts' flags (Megatron-LM's names), then
    `training` (`training_flags`; the model kind's peak learning rate when it has no --lr);
    data excluded."""
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
    ]
    flags += _architecture_flags(layout, model)
    if precision in ("bf16", "fp16"):
        flags.append(f"--{precision}")
    if layout.recompute:
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
    if layout.selective:
        flags += ["--recompute-granularity", "selective"]
    if (sequence_parallel or model.is_moe) and layout.t > 1:
        flags.append("--sequence-parallel")  # megatron-core's MoE layer needs it at t > 1
    split = layout_flags(layout, model.num_layers)
    if layout.v > 1 and "--pipeline-model-parallel-layout" not in split:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(layout.v)]
    flags += split
    if distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    if optimizer != "adam":
        flags += ["--optimizer", optimizer]
    if correction != "none" and layout.schedule == "2bw":
        flags += ["--stale-weight-correction", correction]
    if not clip_grad:
        flags += ["--clip-grad", "0"]
    if not deferred_step and keeps_versions(layout.schedule):
        flags.append("--no-deferred-step")
    if cpu:
        flags.append("--cpu")
    lr = [] if "--lr" in training else ["--lr", _PEAK_LR[model.kind]]
    return flags + lr + list(training)



def _architecture_flags(layout: Layout, model: ModelSpec) -> list[str]:
    """The model's flags beyond its sizes, each only where it differs from Megatron-LM's
    default (FFN size, SwiGLU, grouped-query attention, vocabulary padding, untied output
    layer, biases, experts, dropout): `ModelSpec.from_args` reads them back to `model`."""
    flags: list[str] = []
    if model.ffn_hidden_size and (model.gated_linear_unit
                                  or model.ffn_hidden_size != 4 * model.hidden_size):
        flags += ["--ffn-hidden-size", str(model.ffn_hidden_size)]
    if model.gated_linear_unit:
        flags.append("--swiglu")
    if model.num_query_groups:
        flags += ["--group-query-attention", "--num-query-groups", str(model.num_query_groups)]
    if model.make_vocab_size_divisible_by != 128:
        flags += ["--make-vocab-size-divisible-by", str(model.make_vocab_size_divisible_by)]
    if model.untie_embeddings and model.kind == "gpt":
        flags.append("--untie-embeddings-and-output-weights")
    if not model.add_bias_linear:
        flags.append("--disable-bias-linear")
    flags += _moe_flags(layout, model)
    if not model.dropout:
        flags += ["--hidden-dropout", "0", "--attention-dropout", "0"]
    return flags


def layout_flags(layout: Layout, num_layers: int) -> list[str]:
    """Megatron-LM's flags for `layout.split` (none for the even split): in the loop
    --decoder-first/last-pipeline-num-layers where they say it (the ranks between hold the
    same layers, each rank's split evenly over its chunks, megatron-core 0.16.1's rules),
    else --pipeline-model-parallel-layout (the V's always)."""
    if layout.split is None:
        return []
    split = LayerSplit(layout.split, layout.d)
    placement = layout.placement
    if placement.shape == "loop":
        ranks = [sum(split.of_rank(placement, i)) for i in range(layout.d)]
        middle = set(ranks[1:-1])
        given = {}
        if layout.d == 2:
            given["last"] = ranks[1]
        elif len(middle) == 1:
            x = middle.pop()
            given = {k: n for k, n in (("first", ranks[0]), ("last", ranks[-1])) if n != x}
        try:
            found = layer_split(LayoutFlags(num_layers, layout.d, chunks=placement.chunks,
                                            **given))
        except LayoutError:
            found = None
        if given and found == split:
            return [x for k, n in given.items()
                    for x in (f"--decoder-{k}-pipeline-num-layers", str(n))]
    return ["--pipeline-model-parallel-layout", split.layout()]


def _moe_flags(layout: Layout, model: ModelSpec) -> list[str]:
    """Megatron-LM's MoE flags of the model and the layout's expert parallelism: the alltoall
    dispatcher the cost model prices (Megatron-LM's default is allgather), expert tensor
    parallelism 1 where t > 1 (its default is t)."""
    if not model.is_moe:
        return []
    flags = ["--num-experts", str(model.num_experts),
             "--moe-router-topk", str(model.moe_router_topk),
             "--moe-token-dispatcher-type", "alltoall"]
    if model.moe_ffn_hidden_size:
        flags += ["--moe-ffn-hidden-size", str(model.moe_ffn_hidden_size)]
    if model.moe_layer_freq != 1:
        freq = model.moe_layer_freq
        flags += ["--moe-layer-freq",
                  str(freq) if isinstance(freq, int) else "[" + ",".join(map(str, freq)) + "]"]
    if model.moe_shared_expert_intermediate_size:
        flags += ["--moe-shared-expert-intermediate-size",
                  str(model.moe_shared_expert_intermediate_size)]
    if layout.e > 1:
        flags += ["--expert-model-parallel-size", str(layout.e)]
    if layout.t > 1:
        flags += ["--expert-tensor-parallel-size", "1"]
    return flags


def _flags_for(candidate: Candidate, plan: Plan, training: Sequence[str] = ()) -> list[str]:
    r = plan.request
    return launch_flags(candidate.layout, r.model, r.precision, cpu=r.cluster.device == "cpu",
                        distributed_optimizer=r.distributed_optimizer, clip_grad=r.clip_grad,
                        optimizer=r.optimizer, correction=r.correction,
                        deferred_step=r.deferred_step, sequence_parallel=r.sequence_parallel,
                        training=training)


def flag_line(candidate: Candidate, plan: Plan, training: Sequence[str] = ()) -> str:
    return shlex.join(_flags_for(candidate, plan, training))


def _header(candidate: Candidate, plan: Plan) -> list[str]:
    r, c = plan.request, candidate
    return [f"# megatron-2bw plan for {r.model.kind.upper()} L={r.model.num_layers} "
            f"h={r.model.hidden_size} a={r.model.num_attention_heads} s={r.model.seq_length} "
            f"on {r.cluster.nodes} x {r.cluster.gpus_per_node} ({r.cluster.name}), "
            f"B={r.global_batch_size}",
            f"# layout {c.layout.label()}: predicted {c.samples_per_s:.2f} samples/s, "
            f"{c.time.iteration:.3f} s/iteration, {c.memory.peak / GiB:.2f} GiB per device"]


def _preamble(model: ModelSpec, training: Sequence[str]) -> list[str]:
    """Script lines setting REPO, PYTHON and ENTRY (absolute, from the planning machine unless
    the environment says otherwise); a missing entry script, missing data variables or (when
    the plan has none) a missing training length end the script with one `error:` line."""
    entry = entry_script(model)
    lines = [
        'if [[ -z ${REPO:-} ]]; then',
        f"    REPO={shlex.quote(str(REPO))}",
        'fi',
        'if [[ -z ${PYTHON:-} ]]; then',
        f"    PYTHON={shlex.quote(sys.executable)}",
        '    [[ -x $PYTHON ]] || PYTHON=python3',
        'fi',
        f'ENTRY="$REPO/{entry}"',
        'if [[ ! -f $ENTRY ]]; then',
        f'    echo "error: REPO: $REPO has no {entry}; set REPO to the megatron-2bw checkout" >&2',
        '    exit 2',
        'fi',
        'if [[ -z ${DATA_ARGS:-} && ( -z ${DATA_PATH:-} || -z ${TOKENIZER_MODEL:-} ) ]]; then',
        '    echo "error: DATA_PATH: set DATA_PATH and TOKENIZER_MODEL, or DATA_ARGS (e.g. '
        "DATA_ARGS='--mock-data --vocab-size N')\" >&2",
        '    exit 2',
        'fi']
    if not {"--train-iters", "--train-samples"} & set(training):
        lines += [
            'case " $* " in',
            '    *" --train-iters"* | *" --train-samples"*) ;;',
            '    *) echo "error: --train-iters: the plan has no training length; add '
            '--train-iters N or --train-samples N" >&2',
            '       exit 2 ;;',
            'esac']
    return lines


def _command_tail(candidate: Candidate, plan: Plan, training: Sequence[str]) -> list[str]:
    """The entry script, one flag per line, the data flags and the script's own arguments."""
    flags = " \\\n    ".join(shlex.join(pair)
                              for pair in _pairs(_flags_for(candidate, plan, training)))
    return ['    "$ENTRY" \\', f"    {flags} \\", f'    {_DATA_ARGS} "$@"', ""]


def torchrun_script(candidate: Candidate, plan: Plan, training: Sequence[str] = ()) -> str:
    """One `python -m torch.distributed.run` per node; NNODES, NODE_RANK, MASTER_ADDR,
    MASTER_PORT from the environment (one node: the defaults)."""
    cluster, model = plan.request.cluster, plan.request.model
    return "\n".join([
        "#!/bin/bash",
        *_header(candidate, plan),
        "# usage: DATA_PATH=... TOKENIZER_MODEL=... [NNODES=.. NODE_RANK=.. MASTER_ADDR=.. "
        "MASTER_PORT=..] bash launch.sh [more flags]",
        "#   DATA_ARGS='--mock-data --vocab-size N' replaces the data flags; REPO, PYTHON: the "
        "checkout and interpreter",
        "set -euo pipefail",
        *_preamble(model, training),
        f'NNODES="${{NNODES:-{cluster.nodes}}}"',
        'NODE_RANK="${NODE_RANK:-0}"',
        'MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"',
        'MASTER_PORT="${MASTER_PORT:-29500}"',
        "# shellcheck disable=SC2086",
        '"$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" '
        f"--nproc-per-node {cluster.gpus_per_node} \\",
        '    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \\',
        *_command_tail(candidate, plan, training)])


def sbatch_script(candidate: Candidate, plan: Plan, training: Sequence[str] = ()) -> str:
    """Slurm: one task per node, each a `python -m torch.distributed.run` with the c10d
    rendezvous on the allocation's first node (its NodeAddr: scripts/slurm.sh), at a port from
    the job id (MASTER_PORT, unless set), as Megatron-LM's Slurm examples set them; the step
    run by scripts/slurm.sh (pre-emption and time-limit signals, docs/slurm.md). A CPU plan
    requests no GPUs."""
    cluster, model = plan.request.cluster, plan.request.model
    gpus = [] if cluster.device == "cpu" else [f"#SBATCH --gpus-per-node={cluster.gpus_per_node}"]
    return "\n".join([
        "#!/bin/bash",
        *_header(candidate, plan),
        "# usage: DATA_PATH=... TOKENIZER_MODEL=... sbatch plan.sbatch [more flags]",
        "#   DATA_ARGS='--mock-data --vocab-size N' replaces the data flags; REPO, PYTHON: the "
        "checkout and interpreter (Slurm runs a copy of this file: the paths are absolute)",
        "#SBATCH --job-name=megatron-2bw",
        f"#SBATCH --nodes={cluster.nodes}",
        "#SBATCH --ntasks-per-node=1",
        *gpus,
        "#SBATCH --exclusive",
        "#SBATCH --open-mode=append",
        "set -euo pipefail",
        *_preamble(model, training),
        "# shellcheck source=scripts/slurm.sh",
        'source "$REPO/scripts/slurm.sh"',
        "slurm_start_line",
        'MASTER_ADDR="$(slurm_rendezvous_addr)"',
        'slurm_check_resolves "$MASTER_ADDR"',
        'MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"',
        "export MASTER_ADDR MASTER_PORT",
        "# shellcheck disable=SC2086",
        'slurm_run_step srun --nodes "$SLURM_NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1 \\',
        '    "$PYTHON" -m torch.distributed.run --nnodes "$SLURM_NNODES" '
        f"--nproc-per-node {cluster.gpus_per_node} \\",
        '    --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d '
        '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \\',
        '    --rdzv-conf "join_timeout=${RDZV_TIMEOUT:-600}" \\',
        *_command_tail(candidate, plan, training)])


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


def _candidate_json(c: Candidate, plan: Plan, rank: int, training: Sequence[str] = ()) -> dict:
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
        "flags": _flags_for(c, plan, training),
    }


def plan_to_json(plan: Plan, top: int = 20, training: Sequence[str] = ()) -> dict:
    """The plan as JSON: the request, the choice and the `top` alternatives, each with the
    flags that launch it (`training` included)."""
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
            "stale_weight_correction": r.correction,
            "iteration_factors": {s: r.factor_of(s) for s in r.schedules},
            "distributed_optimizer": r.distributed_optimizer,
            "selective_recompute": r.selective_recompute,
            "expert_parallel": (None if r.expert_parallel is None
                                else list(r.expert_parallel)),
            "sequence_parallel": r.sequence_parallel,
            "training_flags": list(training),
        },
        "choice": _candidate_json(plan.best, plan, 1, training) if plan.best else None,
        "alternatives": [_candidate_json(c, plan, i + 1, training)
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


REJECTED_FIELDS = (*Rejection.FIELDS, "reason", "memory_gib")


def write_plan(plan: Plan, out_dir: str | Path, top: int = 20,
               training: Sequence[str] = ()) -> dict[str, Path]:
    """plan.json, rejected.csv, and for the choice flags.txt, launch.sh, plan.sbatch, with
    `training` (`training_flags`) in every flag line."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"plan": out / "plan.json", "rejected": out / "rejected.csv"}
    paths["plan"].write_text(json.dumps(plan_to_json(plan, top, training), indent=1) + "\n")
    with open(paths["rejected"], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(REJECTED_FIELDS)
        for r in plan.rejected:
            writer.writerow([*r.values(), r.reason,
                             "" if r.memory_bytes is None else f"{r.memory_bytes / GiB:.3f}"])
    if plan.best is not None:
        paths["flags"] = out / "flags.txt"
        paths["torchrun"] = out / "launch.sh"
        paths["sbatch"] = out / "plan.sbatch"
        paths["flags"].write_text(flag_line(plan.best, plan, training) + "\n")
        paths["torchrun"].write_text(torchrun_script(plan.best, plan, training))
        paths["sbatch"].write_text(sbatch_script(plan.best, plan, training))
        for script in (paths["torchrun"], paths["sbatch"]):
            script.chmod(0o755)
    return paths
