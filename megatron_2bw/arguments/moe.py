"""Mixture of Experts: the --moe-* flags, their rules (`_validate_moe` and the checks it
calls, `_validate_moe_placement` once the layers are split) and the layer pattern the model
and the planner share (`moe_layer_pattern`)."""

from __future__ import annotations

import argparse
import re

from megatron_2bw import schedules
from megatron_2bw.arguments.common import _COUNT, _POSITIVE, _require
from megatron_2bw.flag_types import int_at_least, number_in
from megatron_2bw.schedules import split


def moe_freq_type(text: str):
    """Megatron-LM's --moe-layer-freq type (its ``moe_freq_type``): an integer N (an expert
    layer every N layers, from the first) or a Python list expression of 0s and 1s, one per
    layer ("([1]*3+[0])*2"), made only of digits, commas, brackets, parentheses, + and *."""
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer or a pattern such as "
                                             f"'([1]*3+[0])*2', got {text!r}") from None
    if re.search(r"[^,\d\[\]\(\)\+\*\s]", text):
        raise argparse.ArgumentTypeError(f"a pattern holds only digits, commas, [ ] ( ) + *, "
                                         f"got {text!r}")
    try:
        pattern = eval(text, {"__builtins__": {}})  # noqa: S307 (checked above, as Megatron-LM)
    except Exception:
        raise argparse.ArgumentTypeError(f"not a valid pattern: {text!r}") from None
    if not isinstance(pattern, list) or any(x not in (0, 1) for x in pattern):
        raise argparse.ArgumentTypeError(f"expected a list of 0s and 1s, got {text!r}")
    return pattern


MOE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
"""--moe-router-load-balancing-type's choices (Megatron-LM's); `_validate_moe` says which run."""


def _add_moe_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's Mixture-of-Experts flags (its "moe" group and the TransformerConfig fields
    of the same names, megatron/training/arguments.py at core_v0.16.1) that megatron-2bw
    implements; the rest stay refused (megatron_lm_flags.py). Rules: :func:`_validate_moe`;
    the model: ``training/moe.py``."""
    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int_at_least(0), default=None,
                   help="experts per MoE layer (0 or unset: a dense model)")
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                   help="an expert layer every N layers (from the first), or a 0/1 pattern per "
                        "layer such as '([0]+[1]*3)'")
    g.add_argument("--moe-ffn-hidden-size", type=_COUNT, default=None,
                   help="each expert's FFN size (default: --ffn-hidden-size)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=_COUNT, default=None,
                   help="FFN size of the shared experts, run on every token")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="a sigmoid gate on the shared experts' output")
    g.add_argument("--moe-router-topk", type=_COUNT, default=2)
    g.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"),
                   default="softmax")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax before the top-k (needed at top-1)")
    g.add_argument("--moe-router-topk-scaling-factor", type=_POSITIVE, default=None)
    g.add_argument("--moe-router-num-groups", type=_COUNT, default=None,
                   help="group-limited routing: expert groups")
    g.add_argument("--moe-router-group-topk", type=_COUNT, default=None,
                   help="group-limited routing: groups chosen per token")
    g.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), default=None,
                   help="the router's compute precision")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", choices=MOE_LOAD_BALANCING,
                   default="aux_loss", help="aux_loss, seq_aux_loss or none (several: one "
                                            "--moe-aux-loss-coeff each)")
    g.add_argument("--moe-aux-loss-coeff", type=number_in(0), nargs="+", default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=number_in(0), default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert routing bias moved after each "
                        "batch by its token counts (sigmoid scores; synchronous schedules)")
    g.add_argument("--moe-router-bias-update-rate", type=_POSITIVE, default=1e-3)
    g.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall", "flex"),
                   default="allgather", help="allgather or alltoall (flex needs DeepEP)")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="tokens per expert at most capacity x tokens x topk / experts; the "
                        "rest are dropped (negative: no limit)")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-token-drop-policy", choices=("probs", "position"), default="probs")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="TensorBoard: each MoE layer's load-balancing losses too")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="transformer-engine's (or grouped_gemm's) grouped expert GEMM on CUDA; "
                        "on the CPU a note, and megatron-core's SequentialMLP runs")
    g.add_argument("--moe-permute-fusion", action="store_true",
                   help="transformer-engine's fused token permutation: CUDA only, refused on "
                        "the CPU")
    g.add_argument("--moe-router-fusion", action="store_true",
                   help="transformer-engine's fused router: CUDA only, refused on the CPU")
    g.add_argument("--expert-model-parallel-size", type=_COUNT, default=1,
                   help="experts split over this many ranks of a pipeline stage (carved out "
                        "of tensor x data parallelism)")
    g.add_argument("--expert-tensor-parallel-size", type=_COUNT, default=None,
                   help="tensor parallelism inside each expert (default: "
                        "--tensor-model-parallel-size)")


_MOE_DEFAULTS = {"moe_layer_freq": 1, "moe_ffn_hidden_size": None,
                 "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
                 "moe_router_topk": 2, "moe_router_score_function": "softmax",
                 "moe_router_pre_softmax": False, "moe_router_topk_scaling_factor": None,
                 "moe_router_num_groups": None, "moe_router_group_topk": None,
                 "moe_router_dtype": None, "moe_router_load_balancing_type": "aux_loss",
                 "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None,
                 "moe_router_enable_expert_bias": False, "moe_router_bias_update_rate": 1e-3,
                 "moe_token_dispatcher_type": "allgather", "moe_expert_capacity_factor": None,
                 "moe_pad_expert_input_to_capacity": False, "moe_token_drop_policy": "probs",
                 "moe_per_layer_logging": False, "moe_grouped_gemm": False,
                 "moe_permute_fusion": False, "moe_router_fusion": False,
                 "expert_model_parallel_size": 1, "expert_tensor_parallel_size": None}
"""The MoE flags' defaults (Megatron-LM's): a flag off its default needs --num-experts."""


def _one_or_list(value):
    """Megatron-LM's rule for --moe-router-load-balancing-type and --moe-aux-loss-coeff: a list
    of one becomes its element."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _validate_moe(args: argparse.Namespace) -> None:
    """Mixture of Experts as Megatron-LM checks and derives it (``validate_args`` in
    megatron/training/arguments.py at core_v0.16.1, and megatron-core's TransformerConfig
    checks, raised here as flag errors), and what megatron-2bw runs: alltoall and allgather
    dispatch with megatron-core's SequentialMLP experts; no CUDA-only kernels on the CPU;
    expert bias (router state carried over a batch's forwards) only under schedules whose
    forwards of a batch all run before its step. docs/moe.md says why."""
    if args.num_experts == 0:  # Megatron-LM: "if args.num_experts == 0: args.num_experts = None"
        args.num_experts = None
    args.moe_router_load_balancing_type = _one_or_list(args.moe_router_load_balancing_type)
    args.moe_aux_loss_coeff = _one_or_list(args.moe_aux_loss_coeff)
    if args.num_experts is None:
        for dest, default in _MOE_DEFAULTS.items():
            value = getattr(args, dest)
            _require(value == default, "--" + dest.replace("_", "-"),
                     "only with --num-experts (a Mixture-of-Experts model)")
        return
    if args.expert_tensor_parallel_size is None:  # Megatron-LM: the tensor-parallel size
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    _validate_expert_parallel(args)
    freq = args.moe_layer_freq
    if isinstance(freq, list):
        _require(len(freq) == args.num_layers, "--moe-layer-freq",
                 f"the pattern has {len(freq)} entries for {args.num_layers} layers")
    else:
        _require(freq >= 1, "--moe-layer-freq", f"expected N >= 1 or a pattern, got {freq}")
    _validate_moe_router(args)
    _require(args.moe_token_dispatcher_type != "flex", "--moe-token-dispatcher-type",
             "flex needs DeepEP or HybridEP (CUDA), which megatron-2bw does not set up; use "
             "alltoall or allgather")
    if args.moe_pad_expert_input_to_capacity:
        _require(args.moe_expert_capacity_factor is not None,
                 "--moe-pad-expert-input-to-capacity", "needs --moe-expert-capacity-factor")
    _validate_expert_bias(args)
    _validate_moe_on_cpu(args)
    _require(not getattr(args, "layernorm_zero_centered_gamma", False), "--apply-layernorm-1p",
             "not supported with --num-experts yet (the MoE block spec's local norms)")


def _validate_expert_parallel(args: argparse.Namespace) -> None:
    """The experts split over the expert-parallel and expert tensor-parallel ranks, with
    biases only where megatron-core's experts run them correctly."""
    E, ep, etp, pp = (args.num_experts, args.expert_model_parallel_size,
                      args.expert_tensor_parallel_size, args.pipeline_model_parallel_size)
    _require(E % ep == 0, "--expert-model-parallel-size",
             f"{E} experts do not split over {ep} expert-parallel ranks")
    _require(args.world_size % (etp * ep * pp) == 0, "--expert-model-parallel-size",
             f"world size {args.world_size} is not divisible by expert tensor ({etp}) x expert "
             f"({ep}) x pipeline ({pp}) = {etp * ep * pp}")
    _require(args.moe_ffn_hidden_size % etp == 0, "--moe-ffn-hidden-size",
             f"{args.moe_ffn_hidden_size} is not divisible by expert tensor-parallel size {etp}")
    _require(not args.add_bias_linear or etp == 1, "--disable-bias-linear",
             f"megatron-core's experts have biases only at expert tensor-parallel size 1, not "
             f"{etp}: add --disable-bias-linear")
    _require(not args.add_bias_linear or ep > 1, "--disable-bias-linear",
             "experts with biases at expert-parallel size 1 hit a megatron-core 0.16.1 bug (the "
             "bias is added in place to an autograd Function's output view): add "
             "--disable-bias-linear (as Megatron-LM's MoE examples do)")


def _validate_moe_router(args: argparse.Namespace) -> None:
    """The router's load balancing (one coefficient per kind), top-k and group-limited
    routing, as megatron-core checks them; the load-balancing kinds megatron-2bw runs."""
    E = args.num_experts
    kinds = args.moe_router_load_balancing_type
    kinds = kinds if isinstance(kinds, list) else [kinds]
    coeffs = args.moe_aux_loss_coeff
    if isinstance(args.moe_router_load_balancing_type, list):
        _require(isinstance(coeffs, list) and len(coeffs) == len(kinds), "--moe-aux-loss-coeff",
                 f"give one coefficient per --moe-router-load-balancing-type ({len(kinds)})")
    for kind in kinds:
        _require(kind in ("aux_loss", "seq_aux_loss", "none"), "--moe-router-load-balancing-type",
                 f"{kind} is not supported by megatron-2bw (aux_loss, seq_aux_loss or none)")
    _require(args.moe_router_topk <= E, "--moe-router-topk",
             f"{args.moe_router_topk} exceeds the {E} experts")
    _require(args.moe_router_topk != 1 or args.moe_router_pre_softmax, "--moe-router-topk",
             "1 needs --moe-router-pre-softmax (softmax over one score has a zero gradient; "
             "megatron-core's rule)")
    if args.moe_router_num_groups is not None or args.moe_router_group_topk is not None:
        groups, chosen = args.moe_router_num_groups, args.moe_router_group_topk
        _require(groups is not None and chosen is not None, "--moe-router-num-groups",
                 "give --moe-router-num-groups and --moe-router-group-topk together")
        _require(E % groups == 0 and chosen <= groups, "--moe-router-group-topk",
                 f"{E} experts must split into {groups} groups, of which {chosen} <= {groups} "
                 "are chosen")


def _validate_expert_bias(args: argparse.Namespace) -> None:
    """--moe-router-enable-expert-bias: sigmoid scores, and only under schedules whose
    forwards of a batch all run before its step."""
    if args.moe_router_enable_expert_bias:
        flag = "--moe-router-enable-expert-bias"
        _require(args.moe_router_score_function == "sigmoid", flag,
                 "needs --moe-router-score-function sigmoid (megatron-core's rule)")
        _require(not schedules.keeps_versions(args.pipeline_schedule), flag,
                 f"not under --pipeline-schedule {args.pipeline_schedule}: the bias moves after "
                 "each batch by the token counts of that batch's forwards, and the look-ahead "
                 "forwards of the next batch run before its step (their counts would join this "
                 "batch's, their routing read a bias of no weight version); use flush, gpipe, "
                 "naive, zb-h1, zb-v, dualpipev or megatron")


def _validate_moe_on_cpu(args: argparse.Namespace) -> None:
    """On the CPU: no transformer-engine kernel (grouped GEMM ignored with a note, the
    fusions refused), no tensor parallelism (MoE needs sequence parallelism with it, which the
    CPU's norms refuse) and no uneven all-gather (gloo) for alltoall at expert TP > 1."""
    from megatron_2bw.runtime.device import device_kind

    etp = args.expert_tensor_parallel_size
    cpu = device_kind(args.cpu) != "cuda"
    if cpu and args.moe_grouped_gemm:  # the same experts' GEMMs, one by one (Mixtral's example)
        args.moe_grouped_gemm = False
        args.validation_notes = getattr(args, "validation_notes", []) + [
            "note: --moe-grouped-gemm has no effect on CPU (transformer-engine's grouped GEMM "
            "is a CUDA kernel; megatron-core's SequentialMLP runs the same experts one by one, "
            "with the same checkpoint keys); ignored"]
    if cpu:
        for flag, kernel in (("--moe-permute-fusion", "fused permutation"),
                             ("--moe-router-fusion", "fused router")):
            _require(not getattr(args, flag[2:].replace("-", "_")), flag,
                     f"transformer-engine's {kernel} is a CUDA kernel; on the CPU megatron-core's "
                     "SequentialMLP experts and unfused routing run: leave it out")
        _require(args.tensor_model_parallel_size == 1, "--tensor-model-parallel-size",
                 f"{args.tensor_model_parallel_size} with MoE layers needs --sequence-parallel "
                 "(megatron-core's MoELayer), which needs CUDA (on the CPU megatron-core's "
                 "norms refuse it): on the CPU use --tensor-model-parallel-size 1 and "
                 "--expert-model-parallel-size")
        _require(args.moe_token_dispatcher_type != "alltoall" or etp == 1,
                 "--expert-tensor-parallel-size",
                 f"{etp} with the alltoall dispatcher needs an uneven all-gather, which gloo "
                 "lacks: use --expert-tensor-parallel-size 1 or --moe-token-dispatcher-type "
                 "allgather on the CPU")


def moe_layer_pattern(freq, num_layers: int) -> list[int]:
    """1 for each MoE layer, 0 for each dense one: --moe-layer-freq N puts an expert layer at
    every N-th layer from the first (megatron-core's ``get_gpt_decoder_layer_specs``)."""
    if isinstance(freq, list):
        return list(freq)
    return [1 if i % freq == 0 else 0 for i in range(num_layers)]


def _validate_moe_placement(args: argparse.Namespace) -> None:
    """Every pipeline rank holds an MoE layer: megatron-core builds the expert optimizer only
    where expert parameters exist, and the chain's expert grad-norm all-reduce spans the
    expert x pipeline group, so a rank without experts would leave the others waiting in it."""
    if not getattr(args, "num_experts", None):
        return
    pattern = moe_layer_pattern(args.moe_layer_freq, args.num_layers)
    pp, V = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size or 1
    placement = schedules.placement_of(args.pipeline_schedule, pp, V)
    layers_of = split.LayerSplit(args.pipeline_layer_split, pp)  # `_validate_split`'s
    for stage in range(pp):
        layers = [layer for chunk in range(V)
                  for v in [placement.virtual(stage, chunk)]
                  for layer in range(layers_of.offset(v), layers_of.offset(v) + layers_of.count(v))]
        _require(any(pattern[layer] for layer in layers), "--moe-layer-freq",
                 f"pipeline stage {stage} holds layers {layers}, none of them an MoE layer "
                 f"(pattern {pattern}); every stage needs one (the expert optimizer's grad-norm "
                 "all-reduce spans the stages)")
