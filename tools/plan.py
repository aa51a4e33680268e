"""Plan a megatron-2bw training run: layout, microbatch size, recomputation and schedule.

  plan     (default) rank every feasible layout; write plan.json, rejected.csv, flags.txt,
           launch.sh (torchrun) and plan.sbatch (Slurm) under --out, print table and scripts
      tools/plan.py --cluster dgx-h100 --nodes 128 --global-batch-size 1536 \\
          --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
  profile  measure one transformer layer (and the embedding, head, optimizer step, local
           links) on this device into tools/profiles/<device>.json; --end-to-end trains
           layouts for a few iterations with torchrun instead (time and peak memory)
  report   predicted vs measured for an end-to-end profile
  --evaluate  one given layout (a Megatron launch command, or t8d4b1v2:megatron+rc) beside the
           planner's choice: time per iteration, TFLOP/s per GPU, memory per stage, the limit

Every subcommand's example, Mixture of Experts, profiles and accuracy: docs/planner.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_2bw.cli import (ToolError, ToolParser, comma_list, existing_file,  # noqa: E402
                              fraction, main_guard, nonneg_int, output_file, positive_float,
                              positive_int, reading, writable_dir)
from megatron_2bw.planner import (ALL_SCHEDULES, GiB, CostModel, E2EProfile, Layout,  # noqa: E402
                                  ModelSpec, Plan, PlanRequest, Profile, preset, search,
                                  write_plan)
from megatron_2bw.planner import flags as plan_flags  # noqa: E402
from megatron_2bw.planner import accuracy, links, measure  # noqa: E402
from megatron_2bw.planner import e2e as end_to_end  # noqa: E402
from megatron_2bw.planner.profile import default_profile_path  # noqa: E402
from megatron_2bw.planner.cluster import Link, PrecisionError  # noqa: E402
from megatron_2bw.planner.search import ITERATION_FACTOR, Candidate, Plan  # noqa: E402
from megatron_2bw.flag_types import CORRECTION_RULES  # noqa: E402
from megatron_2bw.arguments import ATTENTION_BACKENDS, FlagError, moe_freq_type  # noqa: E402
from megatron_2bw.planner.cost import SCHEDULE_NOTES  # noqa: E402
from megatron_2bw.planner.evaluate import (MODEL_FLAGS, MODEL_SWITCHES,  # noqa: E402
                                           Evaluation, evaluate, parse_evaluate)

_Gb = 1e9 / 8


_ints = comma_list(positive_int)
"""Comma-separated integers >= 1, at least one."""
_schedules = comma_list(str, ALL_SCHEDULES)
"""Comma-separated schedule names, at least one."""


def _add_model_flags(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = p.add_argument_group("model (Megatron's flags)")
    g.add_argument("--model", choices=("gpt", "bert"), default="gpt")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"):
        g.add_argument(flag, type=positive_int, required=required)
    g.add_argument("--vocab-size", type=positive_int, default=None,
                   help="tokenizer vocabulary (default: 51200 GPT, 30592 BERT)")
    g.add_argument("--ffn-hidden-size", type=positive_int, default=None,
                   help="default: 4 x hidden")
    g.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--swiglu", action="store_true",
                   help="gated FC1 (2 x FFN size); FFN size default int(4h x 2/3 / 64) x 64")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=positive_int, default=None,
                   help="key/value heads with --group-query-attention")
    g.add_argument("--no-dropout", action="store_true",
                   help="the run uses --hidden-dropout 0 --attention-dropout 0")
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="linear layers without biases (Megatron-LM's MoE examples)")
    g = p.add_argument_group("Mixture of Experts (Megatron-LM's flags)")
    g.add_argument("--num-experts", type=positive_int, default=None,
                   help="E experts in each MoE layer (default: a dense model)")
    g.add_argument("--moe-router-topk", type=positive_int, default=None,
                   help="k experts per token (default 2)")
    g.add_argument("--moe-ffn-hidden-size", type=positive_int, default=None,
                   help="an expert's FFN size (default: --ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=None,
                   help="an MoE layer every N layers, or a pattern like '([1]*3+[0])*8' "
                        "(default 1)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=positive_int, default=None,
                   help="a shared expert's FFN size (default: none)")


def _model(args) -> ModelSpec:
    """The model the flags describe; heads that do not divide the hidden size are refused."""
    if args.hidden_size % args.num_attention_heads:
        raise ToolError("--hidden-size", f"{args.hidden_size} is not divisible by "
                                         f"--num-attention-heads {args.num_attention_heads}")
    groups = (args.num_query_groups or 1) if args.group_query_attention else None
    if args.num_query_groups and not args.group_query_attention:
        raise ToolError("--num-query-groups", "needs --group-query-attention")
    if groups and args.num_attention_heads % groups:
        raise ToolError("--num-query-groups", f"{args.num_attention_heads} attention heads do "
                                              f"not split into {groups} groups")
    if args.swiglu and not args.ffn_hidden_size and int(4 * args.hidden_size * 2 / 3) < 64:
        raise ToolError("--swiglu", f"the default FFN size int((4 x {args.hidden_size} x 2/3) "
                                    f"/ 64) x 64 is 0; give --ffn-hidden-size")
    vocab = args.vocab_size or (30592 if args.model == "bert" else 51200)
    moe = {}
    if args.num_experts:
        if args.model != "gpt":
            raise ToolError("--num-experts", "Mixture-of-Experts models are GPTs here")
        moe = dict(num_experts=args.num_experts, moe_router_topk=args.moe_router_topk or 2,
                   moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                   moe_layer_freq=args.moe_layer_freq or 1,
                   moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size)
    else:
        for flag in _MOE_MODEL_FLAGS:
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                raise ToolError(flag, "only with --num-experts (a Mixture-of-Experts model)")
    try:
        return ModelSpec(args.model, args.num_layers, args.hidden_size,
                         args.num_attention_heads, args.seq_length, vocab,
                         ffn_hidden_size=args.ffn_hidden_size,
                         make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                         untie_embeddings=args.untie_embeddings_and_output_weights,
                         dropout=not args.no_dropout, num_query_groups=groups,
                         gated_linear_unit=args.swiglu,
                         add_bias_linear=not args.disable_bias_linear, **moe)
    except ValueError as err:
        raise ToolError("--num-experts" if moe else "--num-layers", str(err)) from None


_MOE_MODEL_FLAGS = ("--moe-router-topk", "--moe-ffn-hidden-size", "--moe-layer-freq",
                    "--moe-shared-expert-intermediate-size")


def _add_cluster_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--cluster", default="cpu-local",
                   help="v100-25gbe (alias paper: 8 x V100-16GB, 25 Gb/s Ethernet, fp16), "
                        "dgx-a100, dgx-h100, dgx-h200, cpu-local (this machine, one process "
                        "per core)")
    g.add_argument("--nodes", type=positive_int, default=1)
    g.add_argument("--gpus-per-node", type=positive_int, default=None)
    g.add_argument("--gpu-memory-gib", type=positive_float, default=None)
    g.add_argument("--intra-node-gbytes", type=positive_float, default=None,
                   help="GB/s per device and direction inside a node (NVLink)")
    g.add_argument("--inter-node-gbits", type=positive_float, default=None,
                   help="Gb/s of a node's whole network (all its adapters together)")
    g.add_argument("--nic-gbits", type=positive_float, default=None,
                   help="Gb/s of one network adapter, one direction")
    g.add_argument("--gpus-per-nic", type=positive_int, default=None,
                   help="devices sharing one adapter (1 on DGX, 8 on p3.16xlarge)")


def _cluster(args):
    """The --cluster preset with the flags' changes; an unknown name is refused."""
    changes = {}
    if args.gpus_per_node:
        changes["gpus_per_node"] = args.gpus_per_node
    if args.gpu_memory_gib:
        changes["memory_bytes"] = args.gpu_memory_gib * GiB
    try:
        cluster = preset(args.cluster, nodes=args.nodes, **changes)
    except ValueError as err:
        raise ToolError("--cluster", str(err)) from None
    if args.intra_node_gbytes:
        cluster = cluster.with_(intra_node=Link(args.intra_node_gbytes * 1e9,
                                                cluster.intra_node.latency))
    if args.gpus_per_nic:
        cluster = cluster.with_(gpus_per_nic=args.gpus_per_nic)
    if args.nic_gbits and args.inter_node_gbits:
        raise ToolError("--nic-gbits", "give --nic-gbits or --inter-node-gbits, not both")
    if args.nic_gbits or args.inter_node_gbits:
        # A node of G devices has G / gpus_per_nic adapters.
        per_nic = args.nic_gbits or (args.inter_node_gbits * cluster.gpus_per_nic
                                     / cluster.gpus_per_node)
        cluster = cluster.with_(nic=Link(per_nic * _Gb, cluster.nic.latency))
    return cluster


def _load(kind, path, flag: str):
    """`kind.load(path)`; a file that cannot be read or parsed raises ToolError naming the
    flag."""
    with reading(flag, path):
        return kind.load(path)


def _precision(args, cluster, given: str | None = None) -> str:
    """--precision, else the one `given` (an evaluated command's), else the cluster's default
    (fp16 on V100, bf16 on A100/H100/H200, fp32 on CPU); one the devices lack is refused."""
    precision = args.precision or given or cluster.default_precision
    try:
        cluster.check_precision(precision)
    except PrecisionError as err:
        raise ToolError("--precision", str(err)) from None
    return precision


def _flash_attention(args, cluster, precision: str) -> bool:
    """Whether the planned runs' attention is FlashAttention-style (--attention-backend, auto
    when not given; Cluster.attention_is_flash)."""
    try:
        return cluster.attention_is_flash(args.attention_backend or "auto", precision)
    except ValueError as err:
        raise ToolError("--attention-backend", str(err)) from None


def _load_profile(args, cluster) -> Profile | None:
    if args.no_profile:
        return None
    path = args.profile
    if path is None:
        auto = default_profile_path(cluster.device_name)
        if not auto.is_file():
            return None
        path = auto
    profile = _load(Profile, path, "--profile")
    print(f"profile: {path} ({profile.device_name}, {profile.precision}, "
          f"{len(profile.samples)} samples)")
    return profile


# ---- plan -------------------------------------------------------------------------------


def plan_parser() -> argparse.ArgumentParser:
    p = ToolParser(prog="plan.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_flags(p, required=False)  # an --evaluate command may give them
    _add_cluster_flags(p)
    g = p.add_argument_group("training")
    g.add_argument("--global-batch-size", type=positive_int, default=None,
                   help="B: the largest global batch that still trains well")
    g.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default=None,
                   help="default: bf16 on GPUs, fp32 on cpu-local")
    g.add_argument("--schedules", type=_schedules, default=ALL_SCHEDULES,
                   help="allowed schedules (leave out 2bw to forbid the 1-stale update)")
    g.add_argument("--iteration-factor", type=positive_float, default=None,
                   help="iterations 2bw, pipedream and pipemare need per flush iteration to reach "
                        "the same loss; they rank at samples/s / this (default "
                        "per schedule, optimizer and correction, docs/convergence.md's "
                        f"table; {ITERATION_FACTOR:g} for 2bw with Adam)")
    g.add_argument("--micro-batch-sizes", type=_ints, default=(1, 2, 4, 8, 16, 32, 64))
    g.add_argument("--recompute", choices=("both", "on", "off"), default="both")
    g.add_argument("--memory-fraction", type=fraction, default=0.9)
    g.add_argument("--optimizer", choices=("adam", "sgd", "muon"), default="adam")
    g.add_argument("--stale-weight-correction", choices=CORRECTION_RULES, default="none",
                   help="2bw's correction of its stale update: its memory (one more fp32 "
                        "weight copy per stage) and iteration factor; needs --precision fp32")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None,
                   help="the runs' attention kernel, written into their flags when given "
                        "(default auto: FlashAttention where the devices have it, in 16-bit); "
                        "attention is timed and sized by it")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="every layout with t > 1 runs --sequence-parallel (CUDA only)")
    g.add_argument("--selective-recompute", action="store_true",
                   help="also try --recompute-granularity selective where full is off")
    g.add_argument("--no-clip-grad", action="store_true",
                   help="the run uses --clip-grad 0 (no pipeline-wide norm before each step)")
    g.add_argument("--no-deferred-step", action="store_true",
                   help="2bw runs its step where the loop calls it (clipping or tied embeddings "
                        "then stall the pipeline at each step)")
    g.add_argument("--max-tensor-parallel", type=positive_int, default=None)
    g.add_argument("--no-uneven", action="store_true",
                   help="only megatron-core's even split of the layers (by default each layout "
                        "is also tried with the split that evens out its stages' work, the "
                        "embedding, the output layer and the loss counted where they sit)")
    g.add_argument("--expert-model-parallel-size", type=_ints, default=None,
                   help="expert-parallel size, or sizes to try (comma-separated); default: "
                        "every size the experts and the layout allow")
    g.add_argument("--virtual-stages", type=_ints, default=(1,),
                   help="V values the search tries under the schedules that interleave "
                        "(megatron, flush, 2bw): virtual stages when V > 1")
    g.add_argument("--evaluate", default=None, metavar="COMMAND_OR_LAYOUT",
                   help="predict this layout beside the planner's choice: a Megatron launch "
                        "command in one string (its model flags fill in missing ones), or "
                        "t<T>d<D>[w<W>]b<B>[v<V>]:<schedule>[+rc]")
    plan_flags.add_training_flags(p)
    g = p.add_argument_group("output")
    g.add_argument("--profile", type=existing_file, default=None,
                   help="layer profile JSON (default: tools/profiles/<device>.json if present)")
    g.add_argument("--no-profile", action="store_true", help="closed forms only")
    g.add_argument("--measured", type=existing_file, default=None,
                   help="end-to-end profile JSON: print predicted vs measured")
    g.add_argument("--closed-form", action="store_true",
                   help="no simulator refinement of the leading candidates")
    g.add_argument("--simulate-top", type=nonneg_int, default=5)
    g.add_argument("--top", type=positive_int, default=10, help="rows of the ranked table")
    g.add_argument("--explain", action="store_true", help="print every rejected layout")
    g.add_argument("--out", type=writable_dir, default="plan",
                   help="directory for plan.json and the scripts")
    g.add_argument("--no-scripts", action="store_true", help="do not print the scripts")
    return p


def format_table(plan: Plan, top: int) -> str:
    moe = plan.request.model.is_moe
    head = (f"{'#':>3} {'t':>3} {'d':>3} {'w':>4} " + (f"{'e':>3} " if moe else "")
            + f"{'b':>3} {'m':>4} {'schedule':<8} {'rc':<3} "
            f"{'samples/s':>10} {'s/iter':>9} {'bubble':>7} {'GiB/dev':>8} {'stage':>5}  "
            f"{'time':<11}  layers")
    lines = [head]
    for i, c in enumerate(plan.ranked[:top], 1):
        L = c.layout
        lines.append(
            f"{i:>3} {L.t:>3} {L.d:>3} {L.w:>4} " + (f"{L.e:>3} " if moe else "")
            + f"{L.b:>3} {L.m:>4} {L.schedule:<8} "
            f"{'yes' if L.recompute else '-':<3} {c.samples_per_s:>10.2f} {c.time.iteration:>9.4f} "
            f"{c.time.bubble_fraction:>7.1%} {c.memory.peak / GiB:>8.2f} "
            f"{c.memory.peak_stage.stage:>5}  {c.time.method:<11}  {short_split(L.split)}")
    return "\n".join(lines)


def short_split(split: tuple[int, ...] | None) -> str:
    """Layers per virtual stage, runs of one count written once: (4, 3, 3, 3, 1) ->
    "4|3x3|1"; "even" for megatron-core's even split."""
    if split is None:
        return "even"
    runs = [[n, len(list(group))] for n, group in itertools.groupby(split)]
    return "|".join(f"{n}x{k}" if k > 1 else str(n) for n, k in runs)


def split_gain(plan: Plan, candidate: Candidate) -> str | None:
    """What an uneven split gains over the even one of the same layout: its predicted
    samples/s against the even split's, or why the even split cannot run."""
    layout = candidate.layout
    if layout.split is None:
        return None
    even = dataclasses.replace(layout, split=None)
    flags = " ".join(plan_flags.layout_flags(layout, plan.request.model.num_layers))
    lines = [f"layers per virtual stage {short_split(layout.split)} ({flags})"]
    same = next((c for c in plan.ranked if c.layout == even), None)
    if same is not None:
        lines.append(f"{candidate.samples_per_s / same.samples_per_s - 1:+.1%} samples/s over "
                     f"the same layout with the even split ({same.samples_per_s:.2f}; the "
                     f"slowest stage's F+B {_slowest(same) * 1e3:.1f} -> "
                     f"{_slowest(candidate) * 1e3:.1f} ms per microbatch)")
    else:
        why = next((r.reason for r in plan.rejected if r.layout == even),
                   f"{plan.request.model.num_layers} layers do not split evenly over "
                   f"{layout.d * layout.placement.chunks} virtual stages")
        lines.append(f"the same layout with the even split does not run ({why})")
    best_even = next((c for c in plan.ranked if c.layout.split is None), None)
    if best_even is not None:
        lines.append(f"{candidate.samples_per_s / best_even.samples_per_s - 1:+.1%} samples/s "
                     f"over the best layout with the even split ({best_even.layout.label()}: "
                     f"{best_even.samples_per_s:.2f})")
    return "\n".join(lines)


def _slowest(candidate: Candidate) -> float:
    return max(f + b for f, b in zip(candidate.time.forward, candidate.time.backward))


def format_rejections(plan: Plan) -> str:
    def show(v):
        return "*" if v is None else str(v)

    lines = [f"{'t':>4} {'d':>4} {'w':>5} {'b':>4} {'m':>5} {'rc':>5} {'schedule':<8} "
             f"{'e':>3} reason"]
    for r in plan.rejected:
        t, d, w, b, m, recompute, schedule, e = map(show, r.values())
        lines.append(f"{t:>4} {d:>4} {w:>5} {b:>4} {m:>5} {recompute:>5} {schedule:<8} "
                     f"{e:>3} {r.reason}")
    return "\n".join(lines)


def _require_plan_flags(args) -> None:
    """The flags a plan needs, given on the command line or by --evaluate's command."""
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                 "--global-batch-size"):
        if getattr(args, flag[2:].replace("-", "_")) is None:
            raise ToolError(flag, "is required (on the command line, or in --evaluate's "
                                  "command)")


def _forced_layout(args, cluster):
    """--evaluate's layout, its model flags merged into `args` (a flag given both ways must
    agree), and the cluster resized to the command's torchrun world when it names one."""
    if args.evaluate is None:
        return None, cluster
    try:
        forced = parse_evaluate(args.evaluate, cluster.num_gpus, args.global_batch_size)
    except ValueError as err:
        raise ToolError("--evaluate", str(err)) from None
    for dest in MODEL_SWITCHES:
        if dest in forced.model_switches:
            setattr(args, dest, True)
    if (forced.layout.e > 1 and args.expert_model_parallel_size is not None
            and forced.layout.e not in args.expert_model_parallel_size):
        raise ToolError("--evaluate", f"the command's --expert-model-parallel-size "
                                      f"{forced.layout.e} is not among "
                                      f"--expert-model-parallel-size "
                                      f"{','.join(map(str, args.expert_model_parallel_size))}")
    for dest in MODEL_FLAGS:
        given, ours = forced.model_flags.get(dest), getattr(args, dest)
        if given is None:
            continue
        if ours is not None and ours != given and dest != "make_vocab_size_divisible_by":
            flag = "--" + dest.replace("_", "-")
            raise ToolError("--evaluate", f"the command's {flag} {given} differs from "
                                          f"{flag} {ours}")
        setattr(args, dest, given)
    if args.global_batch_size not in (None, forced.layout.global_batch):
        raise ToolError("--evaluate", f"the command's global batch {forced.layout.global_batch}"
                                      f" differs from --global-batch-size "
                                      f"{args.global_batch_size}")
    args.global_batch_size = forced.layout.global_batch
    args.model = forced.kind or args.model
    args.use_distributed_optimizer |= forced.distributed_optimizer
    args.sequence_parallel |= forced.sequence_parallel
    if forced.attention_backend is not None:
        if args.attention_backend not in (None, forced.attention_backend):
            raise ToolError("--evaluate", f"the command's --attention-backend "
                                          f"{forced.attention_backend} differs from "
                                          f"--attention-backend {args.attention_backend}")
        args.attention_backend = forced.attention_backend
    args.no_clip_grad |= not forced.clip_grad
    world = forced.layout.world
    if world != cluster.num_gpus:
        if world % cluster.gpus_per_node:
            raise ToolError("--evaluate", f"the command's {world} devices are not whole nodes "
                                          f"of {cluster.gpus_per_node}")
        cluster = cluster.with_(nodes=world // cluster.gpus_per_node)
    return forced, cluster


def _check_moe_flags(args, model: ModelSpec) -> None:
    """What the training refuses with or without experts, before anything is planned."""
    sizes = args.expert_model_parallel_size
    if sizes and not model.is_moe and set(sizes) != {1}:
        raise ToolError("--expert-model-parallel-size", "needs --num-experts (a "
                                                        "Mixture-of-Experts model)")


def run_plan(argv) -> int:
    args = plan_parser().parse_args(argv)
    started = time.perf_counter()
    forced, cluster = _forced_layout(args, _cluster(args))
    _require_plan_flags(args)
    training = plan_flags.training_flags(args)
    if args.attention_backend not in (None, "auto"):
        training += ["--attention-backend", args.attention_backend]
    model = _model(args)
    precision = _precision(args, cluster, forced.precision if forced else None)
    _check_moe_flags(args, model)
    try:
        plan_flags.refuse_what_training_refuses(model, precision, args.optimizer,
                                                args.use_distributed_optimizer,
                                                args.stale_weight_correction)
    except FlagError as error:
        raise ToolError(error.flag, str(error).split(": ", 1)[-1]) from None
    profile = _load_profile(args, cluster)
    e2e = _load(E2EProfile, args.measured, "--measured") if args.measured else None
    request = PlanRequest(
        model, cluster, args.global_batch_size, precision, schedules=args.schedules,
        micro_batch_sizes=args.micro_batch_sizes,
        recompute={"both": (False, True), "on": (True,), "off": (False,)}[args.recompute],
        memory_fraction=args.memory_fraction, optimizer=args.optimizer,
        correction=args.stale_weight_correction,
        distributed_optimizer=args.use_distributed_optimizer, clip_grad=not args.no_clip_grad,
        deferred_step=not args.no_deferred_step, max_tensor_parallel=args.max_tensor_parallel,
        simulate_top=0 if args.closed_form else args.simulate_top,
        virtual_stages=args.virtual_stages, selective_recompute=args.selective_recompute,
        sequence_parallel=args.sequence_parallel, iteration_factor=args.iteration_factor,
        uneven=not args.no_uneven, expert_parallel=args.expert_model_parallel_size)
    cost = CostModel(model, cluster, precision, profile=profile, optimizer=args.optimizer,
                     correction=args.stale_weight_correction,
                     distributed_optimizer=args.use_distributed_optimizer,
                     clip_grad=not args.no_clip_grad, deferred_step=not args.no_deferred_step,
                     sequence_parallel=args.sequence_parallel,
                     flash_attention=_flash_attention(args, cluster, precision))
    if forced is not None:
        return _run_evaluate(args, forced.layout, request, cost, started)
    plan = search(request, cost)
    paths = write_plan(plan, args.out, training=training)
    print(f"{_describe(model, cluster, args.global_batch_size, precision, cost)}, "
          f"schedules {','.join(args.schedules)}; ranked by samples/s, divided by "
          f"{_factors(request)} for the stale-weight schedules")
    print(f"{plan.considered} layouts considered, {len(plan.ranked)} feasible, "
          f"{len(plan.rejected)} rejected ({paths['rejected']}); search {plan.seconds:.3f} s")
    if args.explain:
        print("\nrejected:\n" + format_rejections(plan))
    if plan.best is None:
        print("\nno feasible layout: see the rejections above (--explain) or "
              f"{paths['rejected']}", file=sys.stderr)
        return 1
    print("\n" + format_table(plan, args.top))
    best = plan.best
    print(f"\nchoice: {best.layout.label()}  (plan: {paths['plan']})")
    gain = split_gain(plan, best)
    if gain:
        print(gain)
    line = plan_flags.flag_line(best, plan, training)
    print(f"flags ({paths['flags']}):\n  {line}")
    if best.layout.v > 1 and "--num-virtual-stages-per-pipeline-rank" not in line \
            and "--pipeline-model-parallel-layout" not in line:
        print(f"note: add --num-virtual-stages-per-pipeline-rank {best.layout.v} to the flags "
              f"and scripts (the choice interleaves)", file=sys.stderr)
    if not args.no_scripts:
        print(f"\n--- {paths['torchrun']} ---\n{paths['torchrun'].read_text()}"
              f"--- {paths['sbatch']} ---\n{paths['sbatch'].read_text()}", end="")
    if e2e is not None:
        print("\npredicted vs measured:\n"
              + accuracy.format_accuracy(accuracy.compare(e2e, cost,
                                                          simulate=not args.closed_form)))
    print(f"\nplanned in {time.perf_counter() - started:.2f} s")
    return 0


def _factors(request: PlanRequest) -> str:
    """The iteration factors the ranking divides by, in words."""
    if request.iteration_factor is not None:
        return f"--iteration-factor {request.iteration_factor:g}"
    stale = [s for s in request.schedules if request.factor_of(s) != 1.0]
    return "the iteration factors " + ", ".join(f"{s} {request.factor_of(s):g}" for s in stale) \
        + f" ({request.optimizer}" + (f", {request.correction}" if request.correction != "none"
                                       else "") + ", docs/convergence.md)"


def _describe(model: ModelSpec, cluster, batch: int, precision: str, cost: CostModel) -> str:
    experts = (f" ({model.num_active_parameters() / 1e9:.2f}B active: {model.num_experts} "
               f"experts, top-{model.moe_router_topk})" if model.is_moe else "")
    return (f"{model.kind.upper()} {model.num_parameters() / 1e9:.2f}B parameters{experts} "
            f"(L={model.num_layers} h={model.hidden_size} a={model.num_attention_heads} "
            f"s={model.seq_length} V={model.padded_vocab()}) on {cluster.num_gpus} devices "
            f"({cluster.nodes} x {cluster.gpus_per_node} {cluster.name}, "
            f"{cluster.memory_bytes / GiB:.0f} GiB each), B={batch}, {precision}, "
            f"{'FlashAttention' if cost.flash_attention else 'attention with its s x s scores'}")


def _stage_line(stage) -> str:
    return (f"  stage {stage.stage:>3}: {stage.total / GiB:7.2f} GiB = weights "
            f"{(stage.weights + stage.extra_versions) / GiB:.2f} + gradients "
            f"{(stage.gradients + stage.gradient_copy) / GiB:.2f} + optimizer "
            f"{stage.optimizer / GiB:.2f} + activations {stage.activations / GiB:.2f} "
            f"({stage.stashed_microbatches} microbatches) + transient "
            f"{(stage.transient + stage.overhead) / GiB:.2f}")


def format_evaluation(result: Evaluation, limit: float, peak_flops: float) -> str:
    """The evaluated layout: time and its parts, TFLOP/s per GPU, memory per stage and what
    limits the layout."""
    t, memory = result.time, result.memory
    lines = [f"evaluated: {result.layout.label()}",
             f"  schedule: {SCHEDULE_NOTES[result.layout.schedule]}",
             f"  time per iteration {t.iteration:.3f} s ({t.method}), "
             f"{t.samples_per_s:.2f} samples/s",
             f"  TFLOP/s per GPU    {result.tflops_per_gpu:.1f} "
             f"({result.tflops_per_gpu * 1e12 / peak_flops:.0%} of the "
             f"{peak_flops / 1e12:.0f} peak; Megatron-LM SC'21 Eq. 3 counting)"]
    parts = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in result.time_parts.items())
    lines.append(f"  parts: {parts}")
    lines.append(f"  time limited by: {result.time_limit}")
    stages = memory.stages if len(memory.stages) <= 8 else (
        memory.stages[0], memory.peak_stage, memory.stages[-1])
    lines.append("  memory per device:")
    lines += [_stage_line(stage) for stage in dict.fromkeys(stages)]
    peak = memory.peak_stage
    verdict = "fits" if peak.total <= limit else "does NOT fit"
    lines.append(f"  memory: {verdict}: peak {peak.total / GiB:.2f} GiB on stage {peak.stage} "
                 f"of {limit / GiB:.2f} GiB allowed")
    return "\n".join(lines)


def _run_evaluate(args, layout: Layout, request: PlanRequest, cost: CostModel,
                  started: float) -> int:
    """--evaluate: the given layout beside the planner's best and the ratio between them."""
    try:
        result = evaluate(cost, layout, simulate=not args.closed_form)
    except ValueError as err:
        raise ToolError("--evaluate", str(err)) from None
    plan = search(request, cost)
    cluster = request.cluster
    print(_describe(cost.model, cluster, request.global_batch_size, request.precision, cost))
    print(format_evaluation(result, request.memory_limit,
                            cluster.peak_flops[request.precision]))
    if request.uneven:
        print(_evaluate_split(args, layout, request, cost, result))
    best = plan.best
    if best is None:
        print("planner: no feasible layout (see --explain)")
    else:
        ratio = best.samples_per_s / result.time.samples_per_s
        print(f"planner's choice: {best.layout.label()}  {best.samples_per_s:.2f} samples/s, "
              f"{best.time.iteration:.3f} s/iter, {best.memory.peak / GiB:.2f} GiB: "
              f"{ratio:.2f}x the evaluated layout's throughput")
    print(f"search {plan.seconds:.3f} s over {plan.considered} layouts; evaluated in "
          f"{time.perf_counter() - started:.2f} s")
    return 0


def _evaluate_split(args, layout: Layout, request: PlanRequest, cost: CostModel,
                    result: Evaluation) -> str:
    """The planner's split of the evaluated layout (`CostModel.balanced_split`): its flags,
    predicted time and what it gains, or that the layout's own split is the planner's."""
    model = request.model
    split = cost.balanced_split(dataclasses.replace(layout, split=None), request.memory_limit)
    if split is None or split == layout.split:
        return f"planner's split of this layout: {short_split(layout.split)} (the evaluated one)"
    balanced = evaluate(cost, dataclasses.replace(layout, split=split),
                        simulate=not args.closed_form)
    flags = " ".join(plan_flags.layout_flags(balanced.layout, model.num_layers)) or "(none)"
    return (f"planner's split of this layout: {short_split(split)}  {flags}\n"
            f"  time per iteration {balanced.time.iteration:.4f} s ({balanced.time.method}), "
            f"{balanced.time.samples_per_s:.2f} samples/s: "
            f"{result.time.iteration / balanced.time.iteration:.3f}x the evaluated layout's "
            f"throughput; peak {balanced.memory.peak / GiB:.2f} GiB on stage "
            f"{balanced.memory.peak_stage.stage}")


# ---- profile ----------------------------------------------------------------------------

_LAYOUT_RE = re.compile(r"t(\d+)d(\d+)w(\d+)b(\d+):([a-z0-9-]+)(\+rc)?")


def parse_layout(text: str, global_batch: int) -> Layout:
    """'t1d2w1b4:2bw' (+rc for recomputation) with m from the global batch; a bad one raises
    ToolError naming --layouts."""
    match = _LAYOUT_RE.fullmatch(text.strip())
    if match is None:
        raise ToolError("--layouts", f"layout {text!r}: expected like t1d2w1b4:2bw or "
                                     "t2d1w1b4:megatron+rc")
    t, d, w, b = (int(x) for x in match.groups()[:4])
    schedule, rc = match.group(5), bool(match.group(6))
    if schedule not in ALL_SCHEDULES:
        raise ToolError("--layouts", f"layout {text!r}: unknown schedule {schedule}; choose "
                                     f"from {','.join(ALL_SCHEDULES)}")
    if min(t, d, w, b) < 1:
        raise ToolError("--layouts", f"layout {text!r}: t, d, w and b must be >= 1")
    if global_batch % (b * w):
        raise ToolError("--layouts", f"layout {text!r}: --global-batch-size {global_batch} "
                                     f"is not a multiple of b x w = {b * w}")
    return Layout(t, d, w, b, global_batch // (b * w), rc, schedule)


def profile_parser() -> argparse.ArgumentParser:
    p = ToolParser(prog="plan.py profile", description="measure layers, or whole configurations")
    _add_model_flags(p)
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default=None,
                   help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--cpu", action="store_true", help="profile on CPU even where CUDA is")
    p.add_argument("--idle-below", type=positive_float, default=None,
                   help="before measuring (each run with --end-to-end) wait up to 10 min for "
                        "the 1-minute load average to drop below this: other processes slow "
                        "the measured parts even in CPU time (a core's sibling thread, shared "
                        "caches)")
    p.add_argument("--out", type=output_file, default=None,
                   help="default: tools/profiles/<device>.json (layers), e2e.json (--end-to-end)")
    g = p.add_argument_group("layer profile")
    g.add_argument("--micro-batch-sizes", type=_ints, default=(1, 2, 4, 8))
    g.add_argument("--tensor-parallel-sizes", type=_ints, default=(1, 2, 4, 8))
    g.add_argument("--no-recompute", action="store_true")
    g.add_argument("--repeats", type=positive_int, default=10)
    g.add_argument("--no-links", action="store_true",
                   help="skip timing all-reduces between two local processes")
    g.add_argument("--no-calibrate", action="store_true",
                   help="skip the one-device training run that scales the parts to a whole "
                        "iteration (compute_scale)")
    g.add_argument("--calibrate-devices", type=positive_int, default=None,
                   help="copies of the one-device calibration run trained at once, one per "
                        "device (default: every core on CPU, 1 on CUDA): as many as the "
                        "planned runs keep busy")
    g = p.add_argument_group("end-to-end profile")
    g.add_argument("--end-to-end", action="store_true")
    g.add_argument("--layouts", default=None,
                   help="comma-separated, like t1d2w1b4:2bw,t2d1w1b4:megatron,t1d1w2b4:megatron")
    g.add_argument("--candidates", type=positive_int, default=4,
                   help="without --layouts: the planner's best this many for --nproc devices")
    g.add_argument("--nproc", type=positive_int, default=2,
                   help="processes (devices) on this machine")
    g.add_argument("--global-batch-size", type=positive_int, default=16)
    g.add_argument("--train-iters", type=positive_int, default=12)
    g.add_argument("--log-interval", type=positive_int, default=3)
    g.add_argument("--repeat", type=positive_int, default=1,
                   help="run each layout this many times, keep the fastest (busy machines)")
    g.add_argument("--profile", type=existing_file, default=None,
                   help="layer profile JSON to predict the runs with (accuracy table)")
    return p


_END_TO_END_FLAGS = ("--layouts", "--candidates", "--nproc", "--global-batch-size",
                     "--train-iters", "--log-interval", "--repeat", "--profile")
_LAYER_FLAGS = ("--micro-batch-sizes", "--tensor-parallel-sizes", "--no-recompute", "--repeats",
                "--no-links", "--no-calibrate", "--calibrate-devices")


def _check_profile_flags(args, argv, model: ModelSpec) -> None:
    """A flag of the other kind of profile, a size the runs cannot use: ToolError, before
    anything is measured."""
    given = {word.split("=", 1)[0] for word in argv if word.startswith("--")}
    other = _LAYER_FLAGS if args.end_to_end else _END_TO_END_FLAGS
    for flag in other:
        if flag in given:
            raise ToolError(flag, "is a layer-profile flag, not for --end-to-end"
                            if args.end_to_end else "only with --end-to-end")
    for t in args.tensor_parallel_sizes if "--tensor-parallel-sizes" in given else ():
        if model.num_attention_heads % t or model.ffn % t:
            raise ToolError("--tensor-parallel-sizes", f"{t} does not divide the "
                                                       f"{model.num_attention_heads} attention "
                                                       f"heads and the FFN size {model.ffn}")
    if args.train_iters < args.log_interval:
        raise ToolError("--train-iters", f"{args.train_iters} iterations log no line at "
                                         f"--log-interval {args.log_interval}")


def run_profile(argv) -> int:
    args = profile_parser().parse_args(argv)
    if args.num_experts:
        raise ToolError("--num-experts", "profiles measure dense layers: profile the model "
                                         "without its MoE flags (the planner derives an MoE "
                                         "layer's time and memory from the dense layer's "
                                         "profile by the closed forms)")
    model = _model(args)
    _check_profile_flags(args, argv, model)
    if args.end_to_end:
        layouts = ([parse_layout(x, args.global_batch_size) for x in args.layouts.split(",")]
                   if args.layouts else None)
        for layout in layouts or ():
            if layout.world > args.nproc:
                raise ToolError("--layouts", f"{layout.label()} needs {layout.world} "
                                             f"processes, more than --nproc {args.nproc}")
        profile = _load(Profile, args.profile, "--profile") if args.profile else None
        return _run_end_to_end(args, model, layouts, profile)
    from megatron_2bw.runtime.device import device_kind

    on_cpu = device_kind(args.cpu) == "cpu"
    precision = args.precision or ("fp32" if on_cpu else "bf16")
    _report_load(args.idle_below)
    started = time.perf_counter()
    profile = measure.measure(
        model, precision, micro_batches=args.micro_batch_sizes,
        tensor_parallel=args.tensor_parallel_sizes,
        recompute=(False,) if args.no_recompute else (False, True), repeats=args.repeats,
        force_cpu=args.cpu, log=print)
    if not args.no_links:
        profile.intra_node_link = links.measure_links()
        link = profile.intra_node_link
        print(f"links: {link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.0f} us latency "
              f"(all-reduce between two local processes)")
    if not args.no_calibrate:
        devices = args.calibrate_devices or ((os.cpu_count() or 1) if on_cpu else 1)
        accuracy.calibrate(profile, max(args.micro_batch_sizes), devices=devices, cpu=on_cpu,
                           log=print)
    out = args.out or default_profile_path(profile.device_name)
    print(f"wrote {profile.save(out)} in {time.perf_counter() - started:.1f} s")
    return 0


def _report_load(idle_below: float | None) -> None:
    """Wait for `idle_below` if given; print the load average the parts are measured under,
    with a warning when other processes keep the CPUs busy."""
    if idle_below is not None:
        end_to_end.wait_for_idle(idle_below, print)
    load, cpus = end_to_end.load_average(), os.cpu_count() or 1
    busy = load >= 0.25 * cpus
    print(f"load average {load:.2f} on {cpus} CPUs" + (
        ": warning: other processes are running; they slow the measured parts (shared cores "
        "and caches), so the planner's times will be high (--idle-below waits for an idle "
        "machine)" if busy else ""))


def _run_end_to_end(args, model: ModelSpec, layouts: list[Layout] | None,
                    profile: Profile | None) -> int:
    """Train `layouts` (default: the planner's best --candidates) and record them; inputs are
    validated before anything runs."""
    from megatron_2bw.runtime.device import device_kind

    on_cpu = device_kind(args.cpu) == "cpu"
    precision = args.precision or ("fp32" if on_cpu else "bf16")
    if layouts is None:
        cluster = preset("cpu-local", gpus_per_node=args.nproc) if on_cpu else preset(
            "dgx-h100", gpus_per_node=args.nproc)
        cost = CostModel(model, cluster, precision, profile=profile)
        plan = search(PlanRequest(model, cluster, args.global_batch_size, precision,
                                  iteration_factor=1.0), cost)  # throughput alone
        layouts = [c.layout for c in plan.ranked[:args.candidates]]
    try:
        end_to_end.check_layouts(model, layouts, precision, cpu=on_cpu,
                                 train_iters=args.train_iters)
    except ValueError as err:
        raise ToolError("--layouts", str(err)) from None
    e2e = end_to_end.run_end_to_end(model, layouts, precision, train_iters=args.train_iters,
                                    log_interval=args.log_interval, cpu=on_cpu,
                                    repeat=args.repeat, idle_below=args.idle_below, log=print)
    out = Path(args.out or "e2e.json")
    print(f"wrote {e2e.save(out)}")
    if profile is not None:
        _print_report(e2e, profile)
    return 0


def _print_report(e2e: E2EProfile, profile: Profile, closed_form: bool = False) -> None:
    cluster = preset("cpu-local") if profile.device == "cpu" else preset("dgx-h100")
    precision = e2e.runs[0].precision if e2e.runs else profile.precision
    cost = CostModel(e2e.model, cluster, precision, profile=profile)
    print("predicted (closed form from the layer profile%s) vs measured:"
          % ("" if closed_form else ", pipeline part simulated"))
    print(accuracy.format_accuracy(accuracy.compare(e2e, cost, simulate=not closed_form)))


def run_report(argv) -> int:
    p = ToolParser(prog="plan.py report",
                   description="predicted vs measured for an end-to-end profile")
    p.add_argument("--measured", type=existing_file, required=True,
                   help="end-to-end profile JSON")
    p.add_argument("--profile", type=existing_file, required=True, help="layer profile JSON")
    p.add_argument("--closed-form", action="store_true")
    args = p.parse_args(argv)
    _print_report(_load(E2EProfile, args.measured, "--measured"),
                  _load(Profile, args.profile, "--profile"), args.closed_form)
    return 0


@main_guard
def main(argv=None) -> int:
    """Run a subcommand; bad input ends it with one `error:` line and exit code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"profile": run_profile, "report": run_report, "plan": run_plan}
    if argv and argv[0] in commands:
        return commands[argv[0]](argv[1:])
    return run_plan(argv)


if __name__ == "__main__":
    sys.exit(main())
