"""One given layout, predicted: what `tools/plan.py --evaluate` prints beside the planner's
choice. The layout comes from a Megatron launch command (Megatron-LM's flag names, ours or
megatron-core's `pretrain_gpt.py`) or from a short form like `t8d4b2v2:megatron+rc`.

    forced = parse_evaluate("torchrun --nnodes 4 --nproc-per-node 8 pretrain_gpt.py "
                            "--tensor-model-parallel-size 8 --micro-batch-size 1 ...", world=32)
    result = evaluate(cost, forced.layout)
    result.tflops_per_gpu, result.memory.peak, result.time_limit

Every number comes from the same CostModel the search ranks with; nothing here is tuned.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
from dataclasses import dataclass, field

from megatron_2bw.arguments import moe_freq_type
from megatron_2bw.schedules import V_SCHEDULES, LayoutError, LayoutFlags, layer_split
from megatron_2bw.schedules.split import layout_stages

from .cost import (CostModel, Layout, MemoryEstimate, TimeEstimate, expert_problem,
                   moe_placement_problem)
from .model import ModelSpec

__all__ = ["ForcedLayout", "Evaluation", "parse_evaluate", "evaluate", "MODEL_FLAGS",
           "MODEL_SWITCHES"]

MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
               "ffn_hidden_size", "make_vocab_size_divisible_by", "num_query_groups",
               "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq",
               "moe_shared_expert_intermediate_size")
"""Model flags with a value a command may carry (argparse dest names)."""

MODEL_SWITCHES = ("swiglu", "group_query_attention", "untie_embeddings_and_output_weights",
                  "disable_bias_linear", "no_dropout")
"""Model switches a command may turn on (no_dropout: --hidden-dropout 0 and
--attention-dropout 0)."""

_SHORT = re.compile(r"t(\d+)d(\d+)(?:w(\d+))?(?:e(\d+))?b(\d+)(?:v(\d+))?:([a-z0-9-]+)(\+rc)?")


@dataclass(frozen=True)
class ForcedLayout:
    """A layout given by the user, with what the command said beyond it."""

    layout: Layout
    model_flags: dict = field(default_factory=dict)
    """Model flags the command gave (dest name -> value); the planner's flags fill the rest."""
    precision: str | None = None
    """--fp16 / --bf16 in the command (None: not said)."""
    distributed_optimizer: bool = False
    clip_grad: bool = True
    kind: str | None = None
    """"gpt" or "bert" when the command names pretrain_bert*.py or pretrain_gpt*.py."""
    sequence_parallel: bool = False
    """--sequence-parallel in the command."""
    attention_backend: str | None = None
    """--attention-backend in the command (None: not said)."""
    model_switches: tuple[str, ...] = ()
    """MODEL_SWITCHES the command turns on."""


@dataclass(frozen=True)
class Evaluation:
    layout: Layout
    time: TimeEstimate
    memory: MemoryEstimate
    model_flops: float
    """FLOPs of one iteration, counted as Megatron-LM SC'21 Eq. 3 counts them."""
    world: int

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.time.iteration / self.world / 1e12

    @property
    def time_parts(self) -> dict[str, float]:
        """Seconds of one iteration by cause: the bottleneck stage's compute and sends, its
        tensor-parallel all-reduces, its experts' all-to-alls (MoE), the schedule's bubble,
        the step (data-parallel and embedding all-reduces, optimizer)."""
        t = self.time
        slowest = max(range(len(t.forward)), key=lambda i: t.forward[i] + t.backward[i])
        pipeline = t.iteration - t.step
        bubble = t.bubble_fraction * pipeline
        tensor_parallel = self.layout.m * t.tensor_parallel[slowest]
        experts = self.layout.m * t.expert_parallel[slowest] if t.expert_parallel else 0.0
        parts = {"compute and p2p": pipeline - bubble - tensor_parallel - experts,
                 "tensor-parallel all-reduces": tensor_parallel}
        if t.expert_parallel:
            parts["expert-parallel all-to-alls"] = experts
        return parts | {"pipeline bubble": bubble, "step (all-reduce, optimizer)": t.step}

    @property
    def time_limit(self) -> str:
        """The largest non-compute part (what to attack first)."""
        parts = dict(self.time_parts)
        parts.pop("compute and p2p")
        name = max(parts, key=parts.get)
        return f"{name} ({parts[name] / self.time.iteration:.0%} of the iteration)"


def _command_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add = p.add_argument
    add("--tensor-model-parallel-size", type=int, default=1)
    add("--pipeline-model-parallel-size", type=int, default=1)
    add("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    add("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    add("--micro-batch-size", type=int, default=None)
    add("--global-batch-size", type=int, default=None)
    add("--pipeline-schedule", default="megatron")
    add("--recompute-granularity", default=None)
    add("--checkpoint-activations", action="store_true")  # Megatron-LM before 2022: full
    add("--fp16", action="store_true")
    add("--bf16", action="store_true")
    add("--use-distributed-optimizer", action="store_true")
    add("--sequence-parallel", action="store_true")
    add("--attention-backend", default=None)
    add("--use-flash-attn", action="store_true")  # Megatron-LM before --attention-backend
    add("--clip-grad", type=float, default=1.0)
    add("--decoder-first-pipeline-num-layers", type=int, default=None)
    add("--decoder-last-pipeline-num-layers", type=int, default=None)
    add("--account-for-embedding-in-pipeline-split", action="store_true")
    add("--account-for-loss-in-pipeline-split", action="store_true")
    add("--pipeline-model-parallel-layout", default=None)
    add("--nnodes", type=str, default=None)
    add("--nproc-per-node", "--nproc_per_node", type=int, default=None)
    add("--expert-model-parallel-size", type=int, default=1)
    add("--expert-tensor-parallel-size", type=int, default=None)
    add("--moe-token-dispatcher-type", default="allgather")  # Megatron-LM's default
    add("--hidden-dropout", type=float, default=0.1)
    add("--attention-dropout", type=float, default=0.1)
    for dest in MODEL_FLAGS:
        add("--" + dest.replace("_", "-"), type=moe_freq_type if dest == "moe_layer_freq" else int,
            default=None)
    for dest in MODEL_SWITCHES[:-1]:
        add("--" + dest.replace("_", "-"), action="store_true")
    return p


def _world_of(nnodes: str | None, nproc: int | None, world: int) -> int:
    if nnodes is None or nproc is None:
        return world
    try:
        return int(nnodes.split(":")[-1]) * nproc
    except ValueError:
        raise ValueError(f"--nnodes {nnodes!r} is not a number of nodes") from None


def _from_short(text: str, world: int, global_batch: int | None) -> ForcedLayout:
    match = _SHORT.fullmatch(text.strip())
    t, d, w, e, b, v = (int(x) if x else None for x in match.groups()[:6])
    w = w or world // (t * d)
    if global_batch is None:
        raise ValueError(f"{text!r}: give --global-batch-size")
    layout = _layout(t, d, w, b, v or 1, match.group(7), bool(match.group(8)), global_batch,
                     world, e=e or 1)
    return ForcedLayout(layout)


def _layout(t: int, d: int, w: int, b: int, v: int, schedule: str, recompute: bool,
            global_batch: int, world: int, selective: bool = False, e: int = 1) -> Layout:
    from .search import ALL_SCHEDULES

    if min(t, d, w, b, v, e) < 1:
        raise ValueError(f"sizes must be >= 1, got t={t} d={d} w={w} b={b} v={v} e={e}")
    if t * d * w != world:
        raise ValueError(f"t x d x w = {t} x {d} x {w} = {t * d * w} is not the {world} "
                         f"devices of the cluster (--nodes x --gpus-per-node)")
    if schedule not in ALL_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose from {', '.join(ALL_SCHEDULES)}")
    if global_batch % (b * w):
        raise ValueError(f"global batch {global_batch} is not a multiple of micro batch x data "
                         f"parallel = {b} x {w}")
    return Layout(t, d, w, b, global_batch // (b * w), recompute, schedule, v, selective, e)


def parse_evaluate(text: str, world: int, global_batch: int | None = None) -> ForcedLayout:
    """The layout `text` describes on `world` devices (unless its torchrun part says
    --nnodes/--nproc-per-node); `global_batch` when the text has none. Bad input raises
    ValueError with one line."""
    if _SHORT.fullmatch(text.strip()):
        return _from_short(text, world, global_batch)
    try:
        words = shlex.split(text)
    except ValueError as err:
        raise ValueError(f"cannot split the command: {err}") from None
    try:
        args, _ = _command_parser().parse_known_args(words)
    except SystemExit:
        raise ValueError("a flag of the command lacks its value or has a bad one") from None
    e = args.expert_model_parallel_size
    if args.num_experts:
        etp = args.expert_tensor_parallel_size
        if etp not in (None, 1) or (etp is None and args.tensor_model_parallel_size > 1):
            raise ValueError(f"expert tensor-parallel size {etp or args.tensor_model_parallel_size}"
                             f" (Megatron-LM's default is the tensor-parallel size): the planner "
                             f"models experts whole on each rank; add "
                             f"--expert-tensor-parallel-size 1")
        if e > 1 and args.moe_token_dispatcher_type != "alltoall":
            raise ValueError(f"the {args.moe_token_dispatcher_type} token dispatcher "
                             f"(--moe-token-dispatcher-type; Megatron-LM's default is "
                             f"allgather): the planner prices alltoall's; add "
                             f"--moe-token-dispatcher-type alltoall")
    if args.micro_batch_size is None:
        raise ValueError("the command has no --micro-batch-size (expected a Megatron launch "
                         "command, or a layout like t8d4b1v2:megatron+rc)")
    world = _world_of(args.nnodes, args.nproc_per_node, world)
    t, d = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if t < 1 or d < 1 or world % (t * d):
        raise ValueError(f"{world} devices do not split into tensor {t} x pipeline {d}")
    w = world // (t * d)
    v = args.num_virtual_stages_per_pipeline_rank or 1
    if args.num_layers_per_virtual_pipeline_stage:
        if args.num_layers is None:
            raise ValueError("--num-layers-per-virtual-pipeline-stage needs --num-layers")
        v = args.num_layers // d // args.num_layers_per_virtual_pipeline_stage
    recompute = args.recompute_granularity == "full" or args.checkpoint_activations
    B = args.global_batch_size or global_batch or args.micro_batch_size * w
    split = _split_of(args, d)
    if args.pipeline_model_parallel_layout is not None:
        v = layout_stages(args.pipeline_model_parallel_layout) // d
    layout = _layout(t, d, w, args.micro_batch_size, v, args.pipeline_schedule, recompute, B,
                     world, selective=args.recompute_granularity == "selective", e=e)
    if split is not None:
        layout = dataclasses.replace(layout, split=split)
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else None
    kind = ("bert" if re.search(r"pretrain_bert", text) else
            "gpt" if re.search(r"pretrain_gpt", text) else None)
    given = {k: getattr(args, k) for k in MODEL_FLAGS if getattr(args, k) is not None}
    args.no_dropout = args.hidden_dropout == 0 and args.attention_dropout == 0
    switches = tuple(k for k in MODEL_SWITCHES if getattr(args, k))
    return ForcedLayout(layout, given, precision, args.use_distributed_optimizer,
                        args.clip_grad > 0, kind, args.sequence_parallel,
                        args.attention_backend or ("flash" if args.use_flash_attn else None),
                        switches)


def _split_of(args, d: int) -> tuple[int, ...] | None:
    """The command's uneven split (Megatron-LM's layout flags, `schedules.layer_split`), None
    for the even one; ValueError (one line) where the flags do not add up."""
    flags = LayoutFlags(
        num_layers=args.num_layers or 0, depth=d, chunks=args.num_virtual_stages_per_pipeline_rank,
        layers_per_chunk=args.num_layers_per_virtual_pipeline_stage,
        first=args.decoder_first_pipeline_num_layers, last=args.decoder_last_pipeline_num_layers,
        embedding=args.account_for_embedding_in_pipeline_split,
        loss=args.account_for_loss_in_pipeline_split, layout=args.pipeline_model_parallel_layout,
        shape="v" if args.pipeline_schedule in V_SCHEDULES else "loop")
    if not flags.uneven:
        return None
    if args.num_layers is None:
        raise ValueError("the command's layout flags need --num-layers")
    try:
        split = layer_split(flags)
    except LayoutError as err:
        raise ValueError(str(err)) from None
    return None if split.is_even else split.layers


def evaluate(cost: CostModel, layout: Layout, simulate: bool = False) -> Evaluation:
    """Predicted time and memory of `layout`; ValueError (one line) when it cannot run."""
    model: ModelSpec = cost.model
    if model.num_attention_heads % layout.t:
        raise ValueError(f"{model.num_attention_heads} attention heads are not divisible by "
                         f"t={layout.t}")
    problem = (expert_problem(model, layout.t, layout.w, layout.e, cost.cluster.device)
               or layout.problem(model.num_layers, model.tied)
               or moe_placement_problem(model, layout))
    if problem:
        raise ValueError(problem)
    time = cost.time(layout, simulate=simulate and layout.d * 3 * (2 * layout.m + 1) <= 4000)
    flops = model.model_flops_per_iteration(layout.global_batch, layout.recompute)
    return Evaluation(layout, time, cost.memory(layout), flops, layout.world)
