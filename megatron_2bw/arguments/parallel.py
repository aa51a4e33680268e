"""Parallelism and pipeline-schedule flags, and their rules: world = TP x PP x DP, the
global batch and its ramp, virtual stages (interleaving, the V schedules) and the layers'
split over them (``args.pipeline_layer_split``)."""

from __future__ import annotations

import argparse

from megatron_2bw import schedules
from megatron_2bw.arguments.common import _COUNT, _NONNEG, _POSITIVE, _refuse, _require
from megatron_2bw.flag_types import CORRECTION_RULES, FlagError, number_in
from megatron_2bw.schedules import split
from megatron_2bw.schedules.requirements import (Batch, too_few_microbatches,
                                                  v_placement_problem, virtual_stage_problem)


SCHEDULES = schedules.PIPELINE_SCHEDULES
VIRTUAL_STAGE_SCHEDULES = schedules.VIRTUAL_STAGE_SCHEDULES


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=_COUNT, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=_COUNT, default=1)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=_COUNT, default=None,
                   help="model chunks (virtual pipeline stages) per pipeline rank: V > 1 "
                        "interleaves them (Megatron's interleaved 1F1B; --pipeline-schedule "
                        "megatron)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=_COUNT, default=None,
                   help="layers per model chunk instead of a number of chunks: V = layers per "
                        "pipeline stage / N")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   metavar="N", help="transformer layers on the first pipeline stage; the "
                   "stages between the first and the last share the rest evenly (Megatron-LM's "
                   "uneven split; docs/schedules.md, Uneven layouts)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   metavar="N", help="transformer layers on the last pipeline stage (it also "
                   "holds the output layer and the loss)")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as one layer when splitting the layers evenly: "
                        "the first stage holds one transformer layer less")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the output layer and loss as one layer: the last stage holds "
                        "one transformer layer less")
    g.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
                   help="every virtual stage's layers in model order, e.g. 'E,t*7|t,L': "
                        "stages split by '|', E the embedding, t a transformer layer, L the "
                        "loss, 'x*n' and '(...)*n' repeat; d x V stages give V (under zb-v and "
                        "dualpipev 2d stages: rank i holds stages i and 2d-1-i)")
    g.add_argument("--no-overlap-p2p-communication", action="store_false",
                   dest="overlap_p2p_comm",
                   help="with virtual stages: megatron-core's batched p2p instead of its "
                        "overlapped p2p (then the pipeline needs more than 2 stages, as in "
                        "Megatron-LM)")
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, default="megatron",
                   help="2bw: PipeDream-2BW; flush: PipeDream-Flush; gpipe; pipedream: "
                        "PipeDream-1F1B with weight stashing (each stage updates after its own "
                        "backwards of a batch); pipemare: PipeMare, pipedream without weight "
                        "stashing (a backward reads the newest weights); zb-h1: zero-bubble "
                        "ZB-H1 (split backward, the weights of flush); zb-v, dualpipev: ZB-V and "
                        "DualPipeV, two model chunks per rank in a V (rank i holds stages i and "
                        "2d-1-i; the weights of flush); naive: inter-layer model "
                        "parallelism without pipelining; megatron: Megatron's own 1F1B")
    g.add_argument("--pipemare-discrepancy-decay", type=number_in(0, 1, True, True),
                   default=None, metavar="D",
                   help="pipemare: PipeMare's discrepancy correction (T2) on, with decay D in "
                        "(0, 1): a backward whose forward read an older version reads "
                        "W - (tau_fwd - tau_bkwd) * delta, delta an exponential average of the "
                        "stage's updates (one more weight copy and delta per stage)")
    g.add_argument("--pipemare-lr-warmup-steps", type=_NONNEG, default=0, metavar="K",
                   help="pipemare: PipeMare's learning-rate rescheduling (T1): stage i steps "
                        "with lr / tau_i ** (1 - min(k/K, 1)), tau_i its largest forward delay; "
                        "with m >= d microbatches tau_i <= 1, so the step size is unchanged; "
                        "at m < d tau_i = ceil((d-i-1)/m)")
    g.add_argument("--pipemare-sync-iters", type=_NONNEG, default=0, metavar="N",
                   help="pipemare: run the first N iterations synchronously (flush's order "
                        "and weights, the pipeline drained each iteration), then PipeMare's")
    g.add_argument("--stale-weight-correction", choices=CORRECTION_RULES, default="none",
                   help="2bw: correct the one-step-stale update (megatron_2bw/corrections.py, "
                        "docs/convergence.md): predict, forward and backward at the weights "
                        "extrapolated one step ahead (PipeOptim; one more weight copy); dc, "
                        "DC-ASGD's delay-compensated gradient (one more copy); ef, the "
                        "error-feedback correction of the update (one more copy); none, the "
                        "paper's update")
    g.add_argument("--stale-weight-correction-coeff", type=number_in(0, low_open=True),
                   default=None, metavar="C",
                   help="predict's look-ahead s (default 1), dc's lambda (default 1e5), ef's "
                        "beta (default 2)")
    g.add_argument("--no-deferred-step", action="store_true",
                   help="2bw: run the optimizer step where the training loop calls it; by "
                        "default a step with gradient clipping or tied embeddings is deferred "
                        "to its first reader so that its pipeline-wide all-reduces do not stall "
                        "the stages (one extra fp32 gradient copy per stage)")
    g.add_argument("--cpu", action="store_true",
                   help="train on CPU processes over gloo even where CUDA is available")
    g.add_argument("--distributed-timeout-minutes", type=_POSITIVE, default=10.0,
                   help="bound on every wait of every process group (the default group and "
                        "megatron-core's model-parallel groups); fractions allowed")


def _validate_layout(args: argparse.Namespace) -> None:
    """world = TP x PP x DP; heads over TP ranks (the layers' split: `_validate_split`)."""
    tp, pp, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size
    _require(world % (tp * pp) == 0, "--tensor-model-parallel-size",
             f"world size {world} is not divisible by tensor ({tp}) x pipeline ({pp}) = {tp * pp}")
    args.data_parallel_size = world // (tp * pp)
    _require(args.num_attention_heads % tp == 0, "--num-attention-heads",
             f"{args.num_attention_heads} heads are not divisible by tensor-parallel size {tp}")
    _require(args.hidden_size % args.num_attention_heads == 0, "--hidden-size",
             f"{args.hidden_size} is not divisible by {args.num_attention_heads} heads")


def _validate_batch(args: argparse.Namespace) -> None:
    """global batch = micro batch x DP x microbatches; 2BW needs microbatches >= depth."""
    b, dp, pp = args.micro_batch_size, args.data_parallel_size, args.pipeline_model_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = b * dp
    B = args.global_batch_size
    _require(B % (b * dp) == 0, "--global-batch-size",
             f"{B} is not divisible by micro batch ({b}) x data-parallel size ({dp}) = {b * dp}")
    args.num_microbatches = B // (b * dp)
    _refuse(too_few_microbatches(args.pipeline_schedule, pp,
                                 Batch("--global-batch-size", B, b, dp)))
    m = args.num_microbatches
    if args.pipeline_schedule == "pipemare" and m < pp:
        _require(getattr(args, "pipemare_discrepancy_decay", None) is None,
                 "--pipemare-discrepancy-decay",
                 f"PipeMare's discrepancy correction (T2) runs with m >= d microbatches per "
                 f"batch only, got m = {m} < pipeline depth {pp}")
        _require(not getattr(args, "pipemare_lr_warmup_steps", 0)
                 or getattr(args, "untie_embeddings_and_output_weights", True),
                 "--pipemare-lr-warmup-steps",
                 f"at m = {m} < pipeline depth {pp} T1 gives stages different learning rates, "
                 "so the two copies of tied embeddings would part: add "
                 "--untie-embeddings-and-output-weights")
    if args.rampup_batch_size is not None:
        _validate_rampup(args)


def _validate_virtual_stages(args: argparse.Namespace) -> None:
    """Virtual pipeline stages as Megatron-LM derives and checks them (``validate_args`` in
    megatron/training/arguments.py at core_v0.16.1): V from --num-virtual-stages-per-pipeline-rank
    or from layers per stage / --num-layers-per-virtual-pipeline-stage (one of the two), V = 1
    meaning none (``virtual_pipeline_model_parallel_size`` None); with V > 1 the pipeline has
    more than 1 stage (more than 2 with --no-overlap-p2p-communication) and the layers split
    evenly over PP x V chunks. megatron-core's interleaved schedule (0.16.1) runs microbatches
    in groups of PP per chunk (``microbatch_group_size_per_vp_stage`` defaults to PP) and
    refuses a last group smaller than PP, so m is a multiple of PP, at every step of a ramp
    too. Without virtual stages overlap_p2p_comm is off, as in Megatron-LM. The V schedules
    set their own two chunks (`_validate_v_placement`)."""
    if _validate_v_placement(args):
        return
    per_rank, per_chunk, layout = (args.num_virtual_stages_per_pipeline_rank,
                                   args.num_layers_per_virtual_pipeline_stage,
                                   args.pipeline_model_parallel_layout)
    given = [flag for flag, value in (("--num-virtual-stages-per-pipeline-rank", per_rank),
                                      ("--num-layers-per-virtual-pipeline-stage", per_chunk),
                                      ("--pipeline-model-parallel-layout", layout))
             if value is not None]
    if len(given) > 1:
        raise FlagError(given[-1], f"give only one of {' and '.join(given)}, not both (as in "
                                   "Megatron-LM)")
    pp = args.pipeline_model_parallel_size
    if layout is not None:  # d x V stages (Megatron-LM's validate_args)
        stages = split.layout_stages(layout)
        _require(stages % pp == 0, "--pipeline-model-parallel-layout",
                 f"{stages} stages in {layout!r} are not a multiple of {pp} pipeline stages")
        V = stages // pp
    elif per_chunk is not None:
        V = _validate_split(args, "loop").chunks
    else:
        V = per_rank
    args.virtual_pipeline_model_parallel_size = V if V is not None and V > 1 else None
    if args.virtual_pipeline_model_parallel_size is None:
        args.overlap_p2p_comm = False
        _validate_split(args, "loop")
        return
    flag = given[0]
    if args.pipeline_schedule in VIRTUAL_STAGE_SCHEDULES and args.pipeline_schedule != "megatron":
        _require(not args.overlap_param_gather_with_optimizer_step,
                 "--overlap-param-gather-with-optimizer-step",
                 f"not yet under --pipeline-schedule {args.pipeline_schedule} (megatron-core "
                 f"then gives chunk 0 an optimizer of its own); use --overlap-param-gather "
                 f"alone, whose all-gathers the schedule launches ahead of each chunk")
    b, dp = args.micro_batch_size, args.data_parallel_size
    batches = [Batch("--global-batch-size", args.global_batch_size, b, dp)]
    if args.rampup_batch_size is not None:
        batches += [Batch("--rampup-batch-size", size, b, dp)
                    for size in args.rampup_batch_size[:2]]
    _refuse(virtual_stage_problem(args.pipeline_schedule, pp, V, None, batches, flag,
                                  args.overlap_p2p_comm))
    _validate_split(args, "loop")


def _validate_split(args: argparse.Namespace, shape: str) -> split.LayerSplit:
    """The layers of every virtual stage from Megatron-LM's layout flags
    (``schedules.split.layer_split``, megatron-core's semantics; even without them), kept as
    ``args.pipeline_layer_split`` (model order). Megatron-LM's one-of rule for the V flags is
    checked by the caller."""
    flags = split.LayoutFlags(
        num_layers=args.num_layers, depth=args.pipeline_model_parallel_size,
        chunks=args.num_virtual_stages_per_pipeline_rank,
        layers_per_chunk=args.num_layers_per_virtual_pipeline_stage,
        first=args.decoder_first_pipeline_num_layers,
        last=args.decoder_last_pipeline_num_layers,
        embedding=args.account_for_embedding_in_pipeline_split,
        loss=args.account_for_loss_in_pipeline_split,
        layout=args.pipeline_model_parallel_layout, shape=shape)
    try:
        layers = split.layer_split(flags)
    except split.LayoutError as error:
        raise FlagError(error.flag, error.message) from None
    args.pipeline_layer_split = layers.layers
    return layers


def _validate_v_placement(args: argparse.Namespace) -> bool:
    """zb-v and dualpipev (``schedules.V_SCHEDULES``): the layout rules of
    ``requirements.v_placement_problem`` (recomputation: ``RECOMPUTE_REFUSED``). Whether the
    schedule is one of them. (Checkpoints key the V's layers by their global numbers:
    ``training.layer_numbers``.)"""
    name = args.pipeline_schedule
    if name not in schedules.V_SCHEDULES:
        return False
    pp, b, dp = (args.pipeline_model_parallel_size, args.micro_batch_size,
                 args.data_parallel_size)
    _require(args.num_layers_per_virtual_pipeline_stage is None,
             "--num-layers-per-virtual-pipeline-stage",
             f"--pipeline-schedule {name} runs 2 model chunks per rank (a V); leave it out")
    batches = [Batch("--global-batch-size", args.global_batch_size, b, dp)]
    if args.rampup_batch_size is not None:
        batches += [Batch("--rampup-batch-size", args.rampup_batch_size[0], b, dp)]
    _refuse(v_placement_problem(name, pp, args.num_virtual_stages_per_pipeline_rank, None,
                                batches, not args.untie_embeddings_and_output_weights))
    _validate_split(args, "v")
    args.virtual_pipeline_model_parallel_size = 2
    return True


def _validate_rampup(args: argparse.Namespace) -> None:
    """--rampup-batch-size START INCREMENT SAMPLES as megatron-core's
    RampupBatchsizeNumMicroBatchesCalculator needs it: START < global batch, the difference a
    multiple of INCREMENT, START and INCREMENT multiples of micro batch x DP (every batch of the
    ramp is then whole microbatches); under 2bw the first (smallest) batch has m >= depth."""
    start, increment, _ = args.rampup_batch_size
    b, dp, pp = args.micro_batch_size, args.data_parallel_size, args.pipeline_model_parallel_size
    B = args.global_batch_size
    _require(args.train_samples is not None, "--rampup-batch-size",
             "needs --train-samples (Megatron-LM: no batch-size ramp-up for iteration-based "
             "training)")
    _require(start < B, "--rampup-batch-size",
             f"START {start} must be below --global-batch-size {B}")
    _require((B - start) % increment == 0, "--rampup-batch-size",
             f"--global-batch-size {B} - START {start} = {B - start} is not divisible by "
             f"INCREMENT {increment}")
    for name, value in (("START", start), ("INCREMENT", increment)):
        _require(value % (b * dp) == 0, "--rampup-batch-size",
                 f"{name} {value} is not divisible by micro batch ({b}) x data-parallel size "
                 f"({dp}) = {b * dp}")
    _refuse(too_few_microbatches(args.pipeline_schedule, pp,
                                 Batch("--rampup-batch-size", start, b, dp, name="START"),
                                 where=" at every step of the ramp", ramp=True))
