"""Command-line flags: Megatron-LM's names for what Megatron-LM has, ours for the rest.

All consistency checks live in :func:`validate_args`; each failure raises :class:`FlagError`
naming the flag and printing every factor, and entry scripts turn it into one error line and a
non-zero exit on every rank, before any process group or model exists.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Sequence

from megatron_2bw import schedules
from megatron_2bw.data.tokenizer_types import (FILE_FLAGS, TOKENIZER_INPUTS, TOKENIZER_TYPES,
                                               missing_tokenizer_input, tokenizer_type)
from megatron_2bw.flag_types import CORRECTION_RULES, FlagError, int_at_least, number_in
from megatron_2bw.schedules import split
from megatron_2bw.schedules.requirements import (Batch, recompute_problem, too_few_microbatches,
                                                  v_placement_problem, virtual_stage_problem)

__all__ = ["FlagError", "SCHEDULES", "build_parser", "parse_args", "validate_args",
           "int_at_least", "number_in", "have_emerging_optimizers"]

MAX_TRAIN_SAMPLES = 2 ** 40
"""More training samples than this (beyond any real run) are refused: the dataset indices
for all of them are built before the first iteration."""

SCHEDULES = schedules.PIPELINE_SCHEDULES
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
"""--attention-backend: megatron-core's AttnBackend names."""
VIRTUAL_STAGE_SCHEDULES = schedules.VIRTUAL_STAGE_SCHEDULES


class _Parser(argparse.ArgumentParser):
    """argparse that raises FlagError instead of printing usage and exiting."""

    def error(self, message):
        # argparse's wording: "argument --num-layers: invalid int value: 'x'",
        # "unrecognized arguments: --foo 3"; the error line starts with the flag to fix.
        bad_value = re.match(r"argument ([^:/\s]+)\S*: (.*)", message)
        if bad_value:
            raise FlagError(bad_value.group(1), bad_value.group(2))
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            raise FlagError(unknown.group(1), f"unknown flag ({message}); see --help")
        raise FlagError("arguments", message)


_COUNT = int_at_least(1)
_NONNEG = int_at_least(0)
_POSITIVE = number_in(0, low_open=True)
_PROBABILITY = number_in(0, 1, high_open=True)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's model flags (megatron/training/arguments.py at core_v0.16.1: its
    "network size" group, and the TransformerConfig fields its ArgumentGroupFactory turns into
    flags, with their dests: --norm-epsilon -> layernorm_epsilon, --disable-bias-linear ->
    add_bias_linear)."""
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=_COUNT, default=None, help="required")
    g.add_argument("--hidden-size", type=_COUNT, default=None, help="required")
    g.add_argument("--ffn-hidden-size", type=_COUNT, default=None,
                   help="default: 4 x hidden size; with --swiglu int((4 x hidden x 2/3) / 64) "
                        "x 64, as Megatron-LM")
    g.add_argument("--num-attention-heads", type=_COUNT, default=None, help="required")
    g.add_argument("--kv-channels", type=_COUNT, default=None,
                   help="size of each attention head's projection; default: hidden / heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=_COUNT, default=None,
                   help="key/value head groups with --group-query-attention (default 1)")
    g.add_argument("--seq-length", type=_COUNT, default=None, help="required")
    g.add_argument("--max-position-embeddings", type=_COUNT, default=None,
                   help="required; at least --seq-length")
    g.add_argument("--make-vocab-size-divisible-by", type=_COUNT, default=128)
    g.add_argument("--hidden-dropout", type=_PROBABILITY, default=0.1)
    g.add_argument("--attention-dropout", type=_PROBABILITY, default=0.1)
    g.add_argument("--init-method-std", type=_POSITIVE, default=0.02)
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "none"),
                   default="learned_absolute")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="deprecated: use --position-embedding-type rope")
    g.add_argument("--no-position-embedding", action="store_false",
                   dest="add_position_embedding",
                   help="deprecated: use --position-embedding-type none (accepted only with "
                        "rope, as Megatron-LM)")
    g.add_argument("--rotary-percent", type=number_in(0, 1, low_open=True), default=1.0,
                   help="fraction of each head's dimensions rotated by rope")
    g.add_argument("--rotary-base", type=_COUNT, default=10000)
    g.add_argument("--rotary-seq-len-interpolation-factor", type=_COUNT, default=None)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--norm-epsilon", dest="layernorm_epsilon", type=_POSITIVE, default=1e-5)
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                   help="the original BERT's residual order")
    g.add_argument("--swiglu", action="store_true",
                   help="gated linear unit with SiLU instead of GeLU")
    g.add_argument("--squared-relu", action="store_true")
    g.add_argument("--openai-gelu", action="store_true",
                   help="OpenAI's tanh approximation of GeLU")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="no bias in any linear layer (--add-qkv-bias keeps the QKV one)")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="--normalization applied to each head's queries and keys")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true",
                   help="scale Q K^T by 1/layer number (fp16); implies "
                        "--attention-softmax-in-fp32")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split norms and dropout over the sequence on tensor-parallel ranks "
                        "(CUDA only; off when the tensor-parallel size is 1, as Megatron-LM)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS,
                   default="auto",
                   help="transformer_engine's attention kernel (TransformerConfig."
                        "attention_backend); the local layer spec has one attention")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   dest="layernorm_zero_centered_gamma",
                   help="norms hold weight - 1 (TransformerConfig.layernorm_zero_centered_gamma)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="megatron-core's fused vocab-parallel cross entropy")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="loss and gradients averaged over all tokens of the batch, not per "
                        "microbatch (megatron-core's per-token loss)")
    g.add_argument("--context-parallel-size", type=_COUNT, default=1,
                   help="only 1: context parallelism needs transformer-engine attention on CUDA")
    g.add_argument("--transformer-impl", choices=("local", "transformer_engine"),
                   default="transformer_engine",
                   help="layer implementation; transformer_engine is used only on CUDA where "
                        "transformer_engine imports, the local spec otherwise (said on rank 0)")


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


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=_COUNT, default=4)
    g.add_argument("--global-batch-size", type=_COUNT, default=None,
                   help="default: micro batch x data-parallel size")
    g.add_argument("--rampup-batch-size", nargs=3, type=_COUNT, default=None,
                   metavar=("START", "INCREMENT", "RAMPUP_SAMPLES"),
                   help="grow the global batch from START by INCREMENT up to "
                        "--global-batch-size over RAMPUP_SAMPLES samples (megatron-core's "
                        "num_microbatches_calculator); needs --train-samples")
    g.add_argument("--train-iters", type=_COUNT, default=None,
                   help="iterations to train (exclusive with --train-samples; one is required)")
    g.add_argument("--train-samples", type=_COUNT, default=None,
                   help="samples to train (exclusive with --train-iters; one is required)")
    g.add_argument("--optimizer", choices=("adam", "sgd", "muon", "dist_muon"), default="adam",
                   help="muon: Muon for the hidden layers' matrices, Adam for embeddings, "
                        "output layer, norms and biases (megatron-core's split; "
                        "docs/megatron_lm_compatibility.md says which Muon runs)")
    _add_muon_args(g)
    g.add_argument("--lr", type=_POSITIVE, default=None, help="required")
    g.add_argument("--min-lr", type=number_in(0), default=0.0)
    g.add_argument("--decoupled-lr", type=_POSITIVE, default=None,
                   help="learning rate of the input embedding and output layer")
    g.add_argument("--decoupled-min-lr", type=number_in(0), default=None,
                   help="minimum learning rate of the input embedding and output layer")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine",
                                                "inverse-square-root", "WSD"), default="cosine")
    g.add_argument("--lr-wsd-decay-style", choices=("exponential", "linear", "cosine",
                                                    "minus_sqrt"), default="exponential",
                   help="decay of WSD's annealing phase")
    g.add_argument("--lr-wsd-decay-iters", type=_COUNT, default=None,
                   help="iterations of WSD's annealing phase (with --train-iters)")
    g.add_argument("--lr-wsd-decay-samples", type=_COUNT, default=None,
                   help="samples of WSD's annealing phase (with --train-samples)")
    g.add_argument("--lr-warmup-iters", type=_NONNEG, default=0)
    g.add_argument("--lr-warmup-fraction", type=number_in(0, 1), default=None,
                   help="warm-up as a fraction of the decay iterations or samples (instead of "
                        "--lr-warmup-iters / --lr-warmup-samples)")
    g.add_argument("--lr-decay-iters", type=_COUNT, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-samples", type=_NONNEG, default=0,
                   help="warm-up samples (with --train-samples)")
    g.add_argument("--lr-decay-samples", type=_COUNT, default=None,
                   help="default: --train-samples")
    g.add_argument("--weight-decay", type=number_in(0), default=0.01)
    g.add_argument("--clip-grad", type=number_in(0), default=1.0)
    g.add_argument("--adam-beta1", type=_PROBABILITY, default=0.9)
    g.add_argument("--adam-beta2", type=_PROBABILITY, default=0.999)
    g.add_argument("--adam-eps", type=_POSITIVE, default=1e-8)
    g.add_argument("--seed", type=_NONNEG, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=_POSITIVE, default=None,
                   help="static loss scale for --fp16; dynamic when not given")
    g.add_argument("--initial-loss-scale", type=_POSITIVE, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=_POSITIVE, default=1.0)
    g.add_argument("--loss-scale-window", type=_COUNT, default=1000,
                   help="dynamic fp16 loss scaling: steps between scale increases; as many "
                        "consecutive skipped steps end the run as diverged")
    g.add_argument("--hysteresis", type=_COUNT, default=2)
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_true",
                   help="keep training on a non-finite loss or gradient norm (checked every "
                        "iteration by default)")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None)
    g.add_argument("--recompute-num-layers", type=_COUNT, default=None)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    _add_runtime_args(p)


def _add_muon_args(g) -> None:
    """Megatron-LM's --muon-* flags (its "regularization" group at core_v0.16.1), with its
    defaults."""
    g.add_argument("--muon-momentum", type=_PROBABILITY, default=0.9)
    g.add_argument("--muon-no-split-qkv", action="store_false", dest="muon_split_qkv",
                   help="orthogonalize the fused QKV weight whole, not per Q, K and V")
    g.add_argument("--muon-use-nesterov", action="store_true")
    g.add_argument("--muon-scale-mode", choices=("spectral", "unit_rms_norm", "shape_scaling"),
                   default="spectral")
    g.add_argument("--muon-fp32-matmul-prec", choices=("low", "medium", "high"),
                   default="medium", help="Newton-Schulz's matmul precision: medium and "
                   "low iterate in bf16 (Jordan's reference Muon), high in fp32 (TF32 on CUDA)")
    g.add_argument("--muon-num-ns-steps", type=_COUNT, default=5)
    g.add_argument("--muon-tp-mode", choices=("blockwise", "duplicated", "distributed"),
                   default="blockwise")
    g.add_argument("--muon-extra-scale-factor", type=_POSITIVE, default=1.0)


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's garbage-collection, memory and profiling flags (its "training" and
    "profiling" groups), as its training.py uses them."""
    g = p.add_argument_group("garbage collection, memory, profiling")
    g.add_argument("--manual-gc", action="store_true",
                   help="gc.disable(); collect every --manual-gc-interval iterations")
    g.add_argument("--manual-gc-interval", type=_NONNEG, default=0,
                   help="with --manual-gc: iterations between gc.collect() (0: never)")
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", action="store_false",
                   dest="manual_gc_eval", help="with --manual-gc: no collection around "
                                               "evaluations")
    g.add_argument("--empty-unused-memory-level", type=int, choices=(0, 1, 2), default=0,
                   help="torch.cuda.empty_cache() after the optimizer step (1) and after "
                        "evaluation (2); no effect on the CPU")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations [--profile-step-start, --profile-step-end)")
    g.add_argument("--profile-step-start", type=_NONNEG, default=10)
    g.add_argument("--profile-step-end", type=_NONNEG, default=12)
    g.add_argument("--profile-ranks", type=_NONNEG, nargs="+", default=[0])
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="torch.profiler, trace written into --tensorboard-dir (without it "
                        "--profile is nsys's, which has no effect on the CPU)")


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="indexed dataset prefix, or a blend 'weight prefix weight prefix ...'")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", default=None, type=tokenizer_type, metavar="TYPE",
                   help=", ".join(TOKENIZER_TYPES) + "; default: Megatron-LM's per script "
                        "(GPT2BPETokenizer for GPT, BertWordPieceLowerCase for BERT), or the "
                        "SentencePiece type when only --tokenizer-model is given")
    g.add_argument("--tokenizer-model", default=None,
                   help="sentencepiece .model file, or a HuggingFace tokenizer folder")
    g.add_argument("--vocab-file", default=None,
                   help="vocab.json (GPT2BPETokenizer) or vocab.txt (BertWordPiece*)")
    g.add_argument("--merge-file", default=None, help="merges.txt (GPT2BPETokenizer)")
    g.add_argument("--vocab-extra-ids", type=_NONNEG, default=0,
                   help="BertWordPiece*: append <extra_id_0> ... <extra_id_{N-1}> to the vocab")
    g.add_argument("--vocab-size", type=_COUNT, default=None, help="for NullTokenizer")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--num-workers", type=_NONNEG, default=2, help="data loader workers")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="read the .bin files instead of memory-mapping them")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader",
                   help="no attention mask in the batches (the causal mask is implied)")
    g.add_argument("--mock-data", action="store_true",
                   help="random tokens instead of --data-path (smoke tests)")


def _add_logging_and_checkpoint_args(p: argparse.ArgumentParser) -> None:
    def torch_dist_only(text: str) -> str:
        """--ckpt-format takes Megatron-LM's values, of which we write torch_dist only."""
        if text != "torch_dist":
            raise argparse.ArgumentTypeError(f"only torch_dist is supported, got {text!r}")
        return text

    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log-interval", type=_COUNT, default=10)
    g.add_argument("--eval-interval", type=_COUNT, default=100)
    g.add_argument("--eval-iters", type=_NONNEG, default=10)
    g.add_argument("--tensorboard-dir", default=None)
    # Megatron-LM's logging flags, defaults as in its LoggerConfig (training_config.py);
    # what each writes: megatron_2bw/training/logs.py
    g.add_argument("--tensorboard-log-interval", type=_COUNT, default=1)
    g.add_argument("--tensorboard-queue-size", type=_COUNT, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false",
                   dest="log_loss_scale_to_tensorboard")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0)
    g.add_argument("--timing-log-option", choices=("max", "minmax", "all"), default="minmax")
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=_COUNT, default=None)
    g.add_argument("--ckpt-keep", type=_COUNT, default=None,
                   help="keep only the N newest checkpoints in --save (older ones are deleted "
                        "once a newer one is complete); default: keep all")
    g.add_argument("--overwrite-save", action="store_true",
                   help="allow a run that starts from scratch to save into a --save directory "
                        "that holds another run's checkpoints")
    g.add_argument("--exit-interval", type=_COUNT, default=None,
                   help="stop (after saving) when the iteration is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=_POSITIVE, default=None,
                   help="stop (after saving) once training has run this long; checked every "
                        "iteration on every rank")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="accepted for Megatron-LM's command lines: SIGTERM and SIGINT are "
                        "always handled (save, then exit 0)")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true",
                   help="leave the optimizer and learning-rate schedule out of checkpoints")
    g.add_argument("--no-save-rng", action="store_true",
                   help="leave the RNG state out of checkpoints")
    g.add_argument("--ckpt-format", type=torch_dist_only, default="torch_dist",
                   help="accepted for Megatron-LM's command lines: checkpoints are always "
                        "torch_dist (megatron-core's dist_checkpointing)")
    schedule = g.add_mutually_exclusive_group()
    schedule.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                          dest="override_opt_param_scheduler", action="store_true",
                          help="on --load, take the learning-rate schedule from the flags, "
                               "not from the checkpoint")
    schedule.add_argument("--use-checkpoint-opt_param-scheduler",
                          "--use-checkpoint-opt-param-scheduler",
                          dest="use_checkpoint_opt_param_scheduler", action="store_true",
                          help="on --load, take the learning-rate schedule from the "
                               "checkpoint; by default the two must agree (as in Megatron-LM)")


def _add_ddp_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's data-parallel flags (megatron/training/arguments.py at core_v0.16.1: its
    distributed and mixed-precision groups), from which ``build.ddp_config`` makes megatron-core's
    DistributedDataParallelConfig as Megatron-LM's ``get_model`` does. (--use-distributed-optimizer
    is with the training flags.) The rules: :func:`_validate_ddp`."""
    g = p.add_argument_group("data parallelism")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="launch the data-parallel gradient reductions bucket by bucket during "
                        "the last microbatch's backward pass")
    g.add_argument("--align-grad-reduce", action=argparse.BooleanOptionalAction, default=True,
                   help="with --overlap-grad-reduce, pipeline stages other than the first "
                        "launch their reductions after their last backward pass (Megatron-LM's "
                        "config.grad_sync_func); --no-align-grad-reduce: during it")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="distributed optimizer: all-gather the updated parameters bucket by "
                        "bucket in the next forward pass (needs --overlap-grad-reduce)")
    g.add_argument("--overlap-param-gather-with-optimizer-step", action="store_true",
                   help="with virtual stages and --overlap-param-gather: the optimizer step "
                        "launches the first chunk's all-gather (no checkpoints, as in "
                        "Megatron-LM)")
    g.add_argument("--align-param-gather", action=argparse.BooleanOptionalAction, default=True,
                   help="with virtual stages and --overlap-param-gather: the schedule launches "
                        "each chunk's parameter all-gathers (config.param_sync_func); off "
                        "without virtual stages (as Megatron-LM sets it)")
    g.add_argument("--ddp-num-buckets", type=_COUNT, default=None,
                   help="split the gradient buffer into this many buckets")
    g.add_argument("--ddp-bucket-size", type=_COUNT, default=None,
                   help="parameters per gradient bucket; default with --overlap-grad-reduce: "
                        "max(40M, 1M x data-parallel size), one bucket without it")
    g.add_argument("--ddp-pad-buckets-for-high-nccl-busbw", action="store_true")
    g.add_argument("--ddp-reduce-scatter-with-fp32-accumulation", action="store_true")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="average in the data-parallel collective (ReduceOp.AVG; NCCL only)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="--bf16: accumulate and reduce gradients in bf16 (fp32 by default)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accumulate and reduce gradients in fp32 (implied by --bf16 unless "
                        "--grad-reduce-in-bf16)")
    g.add_argument("--check-for-large-grads", action="store_true",
                   help="megatron-core's check for unexpectedly large gradients before the "
                        "data-parallel collective")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=_COUNT, default=None,
                   help="refused for now (Megatron-LM: every N iterations check that all "
                        "data-parallel replicas hold the same weights)")
    g.add_argument("--num-distributed-optimizer-instances", type=_COUNT, default=1)
    g.add_argument("--use-torch-fsdp2", action="store_true", help="refused (see the error)")
    g.add_argument("--use-megatron-fsdp", action="store_true", help="refused (see the error)")


def build_parser(description: str = "Pretrain a model with megatron-2bw",
                 extra_args_provider=None) -> argparse.ArgumentParser:
    """Our flags, then ``extra_args_provider(parser)``'s (a model's own, as in Megatron-LM's
    parse_args), then every other flag of Megatron-LM's parser (megatron_lm_flags.py)."""
    from megatron_2bw.megatron_lm_flags import add_megatron_lm_flags

    parser = _Parser(description=description, allow_abbrev=False)
    _add_model_args(parser)
    _add_moe_args(parser)
    _add_parallel_args(parser)
    _add_training_args(parser)
    _add_data_args(parser)
    _add_logging_and_checkpoint_args(parser)
    _add_ddp_args(parser)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    add_megatron_lm_flags(parser)  # last: only the flags defined nowhere above
    return parser


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse and validate; ``world_size`` defaults to torchrun's WORLD_SIZE (1 without it)."""
    from megatron_2bw.megatron_lm_flags import check_megatron_lm_flags
    from megatron_2bw.runtime.device import device_kind

    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args = validate_args(args, world_size)
    args.flag_notes = vars(args).pop("validation_notes", []) + check_megatron_lm_flags(
        args, getattr(parser, "_megatron_lm_flags", []), on_cuda=device_kind(args.cpu) == "cuda")
    return args


def _require(condition: bool, flag: str, message: str) -> None:
    if not condition:
        raise FlagError(flag, message)


def _refuse(problem) -> None:
    """Raise a layout problem (megatron_2bw.schedules.requirements) as a FlagError."""
    if problem is not None:
        raise FlagError(problem.flag, problem.message)


_REQUIRED = ("--num-layers", "--hidden-size", "--num-attention-heads",
             "--max-position-embeddings", "--seq-length", "--lr")


def _validate_required(args: argparse.Namespace) -> None:
    """Megatron-LM's required flags (its validate_args at core_v0.16.1: required_args, and
    --seq-length, which it asserts unless --encoder-seq-length stands in; --lr defaults to None, which leaves the
    schedule without a peak learning rate)."""
    for flag in _REQUIRED:
        _require(getattr(args, flag[2:].replace("-", "_")) is not None, flag,
                 "required (as in Megatron-LM)")
    _require(args.context_parallel_size == 1, "--context-parallel-size",
             "context parallelism needs transformer-engine attention on CUDA, which "
             "megatron-2bw's schedules do not set up (only 1)")
    if args.decoupled_min_lr is not None:
        _require(args.decoupled_lr is not None, "--decoupled-min-lr", "needs --decoupled-lr")
        _require(args.decoupled_min_lr <= args.decoupled_lr, "--decoupled-min-lr",
                 f"must lie in [0, --decoupled-lr={args.decoupled_lr}], got "
                 f"{args.decoupled_min_lr}")
    if args.profile and args.use_pytorch_profiler:
        _require(args.tensorboard_dir is not None, "--use-pytorch-profiler",
                 "needs --tensorboard-dir (the trace is written there, as in Megatron-LM)")
    if args.profile:
        _require(args.profile_step_start < args.profile_step_end, "--profile-step-end",
                 f"must exceed --profile-step-start {args.profile_step_start}, got "
                 f"{args.profile_step_end}")


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


def _validate_training_length(args: argparse.Namespace) -> None:
    """Exactly one of --train-iters / --train-samples, with the learning-rate flags of its unit
    (``validate_args`` in Megatron-LM's megatron/training/arguments.py at core_v0.16.1;
    --lr-warmup-fraction goes with either). With --train-samples, ``train_iters`` is derived
    as Megatron-LM's ``update_train_iters`` derives it (training.py): the ramp's batches, then
    whole batches of --global-batch-size (a partial last batch is dropped)."""
    iters, samples = args.train_iters, args.train_samples
    _require(iters is not None or samples is not None, "--train-iters",
             "one of --train-iters and --train-samples is required")
    unit, other = ("--train-iters", "--train-samples") if iters is not None else \
        ("--train-samples", "--train-iters")
    _require(iters is None or samples is None, "--train-samples",
             "--train-iters and --train-samples are exclusive")
    wrong_unit = {  # flag given -> the unit it needs
        "--lr-decay-samples": args.lr_decay_samples is not None,
        "--lr-warmup-samples": args.lr_warmup_samples != 0,
        "--lr-wsd-decay-samples": args.lr_wsd_decay_samples is not None,
    } if iters is not None else {
        "--lr-decay-iters": args.lr_decay_iters is not None,
        "--lr-warmup-iters": args.lr_warmup_iters != 0,
        "--lr-wsd-decay-iters": args.lr_wsd_decay_iters is not None,
    }
    for flag, given in wrong_unit.items():
        _require(not given, flag, f"not with {unit} (use the {unit.split('-')[-1]} flag; "
                 f"this one goes with {other})")
    if args.lr_warmup_fraction is not None:
        warmup = "--lr-warmup-iters" if iters is not None else "--lr-warmup-samples"
        _require(args.lr_warmup_iters == 0 and args.lr_warmup_samples == 0,
                 "--lr-warmup-fraction", f"give --lr-warmup-fraction or {warmup}, not both")
    if args.lr_decay_style == "WSD":
        wsd = "--lr-wsd-decay-iters" if iters is not None else "--lr-wsd-decay-samples"
        _require(args.lr_wsd_decay_iters is not None or args.lr_wsd_decay_samples is not None,
                 wsd, "required with --lr-decay-style WSD (the annealing phase's length)")
    if samples is not None:
        _require(samples <= MAX_TRAIN_SAMPLES, "--train-samples",
                 f"{samples} samples exceed {MAX_TRAIN_SAMPLES:.2e} (the data indices are "
                 "built up front)")
        args.train_iters = _iterations_for_samples(args)
        _require(args.train_iters >= 1, "--train-samples",
                 f"{samples} samples do not fill one batch of {args.global_batch_size}")
    _require(args.train_iters * args.global_batch_size <= MAX_TRAIN_SAMPLES, "--train-iters",
             f"{args.train_iters} iterations of {args.global_batch_size} samples exceed "
             f"{MAX_TRAIN_SAMPLES:.2e} samples (the data indices are built up front)")


def _iterations_for_samples(args: argparse.Namespace) -> int:
    """Megatron-LM's ``update_train_iters``: count the ramp's iterations with megatron-core's
    calculator (while consumed <= ramp-up samples and <= --train-samples), then add whole
    batches of --global-batch-size."""
    if args.rampup_batch_size is None:
        return args.train_samples // args.global_batch_size
    from megatron.core.num_microbatches_calculator import (
        RampupBatchsizeNumMicroBatchesCalculator)

    start, increment, rampup_samples = args.rampup_batch_size
    ramp = RampupBatchsizeNumMicroBatchesCalculator(
        args.global_batch_size, args.micro_batch_size, args.data_parallel_size,
        decrease_batch_size_if_needed=False, rank=-1, start_global_batch_size=start,
        batch_size_increment=increment, ramup_samples=rampup_samples)
    iterations = consumed = 0
    while consumed <= rampup_samples and consumed <= args.train_samples:
        ramp.update(consumed, consistency_check=False)
        consumed += ramp.get_current_global_batch_size()
        iterations += 1
    return iterations + max(args.train_samples - consumed, 0) // args.global_batch_size


def _validate_training(args: argparse.Namespace) -> None:
    _validate_training_length(args)
    _require(not (args.bf16 and args.fp16), "--bf16", "--bf16 and --fp16 are exclusive")
    _require(args.min_lr <= args.lr, "--min-lr",
             f"must lie in [0, --lr={args.lr}], got {args.min_lr}")
    _require(args.seed < 2 ** 31, "--seed", f"must be < 2**31 (numpy's seeds), got {args.seed}")
    _require(args.min_loss_scale <= args.initial_loss_scale, "--min-loss-scale",
             f"{args.min_loss_scale:g} exceeds --initial-loss-scale {args.initial_loss_scale:g}")
    if args.train_samples is None:
        args.lr_decay_iters = args.lr_decay_iters or args.train_iters
        # megatron-core's OptimizerParamScheduler asserts warm-up < decay steps
        _require(args.lr_warmup_iters < args.lr_decay_iters, "--lr-warmup-iters",
                 f"{args.lr_warmup_iters} warm-up iterations must be fewer than the "
                 f"{args.lr_decay_iters} decay iterations (--lr-decay-iters, else --train-iters)")
    else:
        args.lr_decay_samples = args.lr_decay_samples or args.train_samples
        _require(args.lr_warmup_samples < args.lr_decay_samples, "--lr-warmup-samples",
                 f"{args.lr_warmup_samples} warm-up samples must be fewer than the "
                 f"{args.lr_decay_samples} decay samples (--lr-decay-samples, else "
                 "--train-samples)")
    _require(args.seq_length <= args.max_position_embeddings, "--seq-length",
             f"{args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    if args.recompute_granularity == "full":
        _require(args.recompute_method is not None, "--recompute-method",
                 "required with --recompute-granularity full (uniform or block)")
        args.recompute_num_layers = args.recompute_num_layers or 1
        _validate_recompute_layers(args)
    elif args.recompute_method is not None:
        _require(False, "--recompute-method", "only valid with --recompute-granularity full")
    if args.recompute_granularity is not None:
        _refuse(recompute_problem(args.pipeline_schedule))
    _validate_pipemare(args)
    _validate_muon(args)
    _validate_stale_correction(args)
    from megatron_2bw.runtime.device import device_kind

    _validate_low_precision_weights(args, on_cuda=device_kind(args.cpu) == "cuda")
    if args.save_interval is not None:
        _require(args.save is not None, "--save-interval", "needs --save DIR")
    if args.ckpt_keep is not None:
        _require(args.save is not None, "--ckpt-keep", "needs --save DIR")


def _validate_recompute_layers(args: argparse.Namespace) -> None:
    """--recompute-num-layers N within the layers of a model chunk: at most the fullest
    chunk's; with --recompute-method uniform megatron-core recomputes groups of N layers and
    indexes past a chunk whose layers are not a multiple of N, so N divides every chunk's."""
    n, chunks = args.recompute_num_layers, args.pipeline_layer_split
    most = max(chunks)
    _require(1 <= n <= most, "--recompute-num-layers",
             f"must lie in [1, {most}] (layers per model chunk), got {n}")
    if args.recompute_method == "uniform":
        odd = sorted({c for c in chunks if c % n})
        _require(not odd, "--recompute-num-layers",
                 f"--recompute-method uniform recomputes groups of {n} layers, and model "
                 f"chunks of {', '.join(map(str, odd))} layers are not a multiple of it")


def _validate_low_precision_weights(args: argparse.Namespace, on_cuda: bool) -> None:
    """FP8/FP4 (transformer-engine) only under schedules with one weight version per batch:
    transformer-engine casts a weight to FP8 when a microbatch passes ``is_first_microbatch``
    and caches the cast in place for the batch's other microbatches, so under 2bw, pipedream
    and pipemare the look-ahead forwards of batch t+1 would overwrite the cached copy that
    batch t's backward passes still read (another weight version). On the CPU the recipes
    have no effect (no transformer-engine layers), so Megatron-LM's FP8 examples still run
    there under every schedule."""
    for flag, dest in (("--fp8-format", "fp8"), ("--fp4-format", "fp4")):
        problem = low_precision_refusal(args.pipeline_schedule, getattr(args, dest, None),
                                        on_cuda)
        _require(problem is None, flag, problem or "")


def low_precision_refusal(schedule: str, recipe: str | None, on_cuda: bool) -> str | None:
    """Why an FP8/FP4 ``recipe`` cannot run under ``schedule`` (None when it can)."""
    if recipe is None or not on_cuda or not schedules.keeps_versions(schedule):
        return None
    return (f"not with --pipeline-schedule {schedule}: transformer-engine caches each "
            "weight's low-precision copy at a batch's first microbatch, and the next batch's "
            "look-ahead forwards would overwrite the copy this batch's backward passes read "
            "(another weight version); use flush, gpipe, zb-h1, naive or megatron")


def _validate_pipemare(args: argparse.Namespace) -> None:
    """The --pipemare-* flags need --pipeline-schedule pipemare."""
    given = [flag for flag, off in (("--pipemare-discrepancy-decay", None),
                                    ("--pipemare-lr-warmup-steps", 0),
                                    ("--pipemare-sync-iters", 0))
             if getattr(args, flag[2:].replace("-", "_")) != off]
    for flag in given:
        _require(args.pipeline_schedule == "pipemare", flag,
                 f"only with --pipeline-schedule pipemare, not {args.pipeline_schedule}")


_MUON_DEFAULTS = {"muon_momentum": 0.9, "muon_split_qkv": True, "muon_use_nesterov": False,
                  "muon_scale_mode": "spectral", "muon_fp32_matmul_prec": "medium",
                  "muon_num_ns_steps": 5, "muon_tp_mode": "blockwise",
                  "muon_extra_scale_factor": 1.0}


def have_emerging_optimizers() -> bool:
    """Whether NVIDIA's emerging-optimizers imports (megatron-core's TensorParallelMuon needs
    it; it requires Python >= 3.12)."""
    import importlib.util

    return importlib.util.find_spec("emerging_optimizers") is not None


def _validate_layer_wise_muon(args: argparse.Namespace) -> None:
    """--optimizer dist_muon, as Megatron-LM reads it: --optimizer muon with its state sharded
    over the data-parallel ranks by whole parameters (megatron-core's
    LayerWiseDistributedOptimizer; ``use_layer_wise_distributed_optimizer``). megatron-core's
    distributed optimizer runs Adam only, so --optimizer muon --use-distributed-optimizer
    means the same here (docs/megatron_lm_compatibility.md)."""
    mapped = args.optimizer == "muon" and args.use_distributed_optimizer
    args.use_layer_wise_distributed_optimizer = args.optimizer == "dist_muon" or mapped
    if not args.use_layer_wise_distributed_optimizer:
        return
    if mapped:
        args.validation_notes = getattr(args, "validation_notes", []) + [
            "note: --optimizer muon --use-distributed-optimizer: Muon's state is sharded by "
            "whole parameters (megatron-core's LayerWiseDistributedOptimizer, Megatron-LM's "
            "--optimizer dist_muon); megatron-core's distributed optimizer runs Adam only"]
    args.optimizer, args.use_distributed_optimizer = "muon", False
    for flag in ("--overlap-param-gather", "--overlap-param-gather-with-optimizer-step"):
        _require(not getattr(args, flag[2:].replace("-", "_")), flag,
                 "not with --optimizer dist_muon (its layer-wise optimizer all-gathers the "
                 "updated parameters in its step, megatron-core 0.16)")


def _validate_muon(args: argparse.Namespace) -> None:
    """--optimizer muon as megatron-core builds it (``get_megatron_muon_optimizer``): not with
    fp16; without emerging-optimizers, blockwise tensor parallelism only. The --muon-* flags
    need it."""
    if args.optimizer != "muon":
        for dest, default in _MUON_DEFAULTS.items():
            flag = "--muon-no-split-qkv" if dest == "muon_split_qkv" else \
                "--" + dest.replace("_", "-")
            _require(getattr(args, dest) == default, flag,
                     f"only with --optimizer muon, not {args.optimizer}")
        return
    _require(not args.fp16, "--fp16", "not with --optimizer muon (megatron-core's Muon runs "
             "fp32 or bf16 only); use --bf16")
    _require(args.muon_tp_mode == "blockwise" or have_emerging_optimizers(), "--muon-tp-mode",
             f"{args.muon_tp_mode} needs NVIDIA's emerging-optimizers package (Python >= 3.12); "
             "without it each tensor-parallel rank orthogonalizes its shard (blockwise)")


def _validate_stale_correction(args: argparse.Namespace) -> None:
    """--stale-weight-correction: 2bw's one-step delay, corrected on the optimizer's fp32
    parameters (or master copies, or shards) under every precision and optimizer."""
    rule = args.stale_weight_correction
    if rule == "none":
        _require(args.stale_weight_correction_coeff is None, "--stale-weight-correction-coeff",
                 "only with --stale-weight-correction predict, dc or ef")
        return
    flag = "--stale-weight-correction"
    _require(args.pipeline_schedule == "2bw", flag,
             f"only with --pipeline-schedule 2bw, not {args.pipeline_schedule}: its corrections "
             "assume 2BW's delay of one step on every stage (pipedream and pipemare delay "
             "some microbatches of a batch on some stages)")


# Megatron-LM's entry scripts' `args_defaults` (core_v0.16.1): pretrain_gpt.py and
# pretrain_bert.py default --tokenizer-type (their only args_defaults).
_MEGATRON_LM_TOKENIZER = {"gpt": "GPT2BPETokenizer", "bert": "BertWordPieceLowerCase"}
# Where only --tokenizer-model is given (which Megatron-LM's default type does not read).
_SENTENCEPIECE_TOKENIZER = {"gpt": "GPTSentencePieceTokenizer", "bert": "SentencePieceTokenizer"}


def _default_tokenizer_type(args: argparse.Namespace) -> None:
    """Fill --tokenizer-type when not given: Megatron-LM's default for the entry script (BERT's
    parser sets ``tokenizer_defaults_of="bert"``, taken off the namespace here), or with
    --tokenizer-model and no --vocab-file, the script's SentencePiece type (a command
    Megatron-LM refuses)."""
    model = vars(args).pop("tokenizer_defaults_of", "gpt")
    if args.tokenizer_type is not None:
        return
    only_model_file = args.tokenizer_model is not None and args.vocab_file is None
    args.tokenizer_type = (_SENTENCEPIECE_TOKENIZER if only_model_file
                           else _MEGATRON_LM_TOKENIZER)[model]


def _validate_data(args: argparse.Namespace) -> None:
    """Data and tokenizer files must exist before any process group starts."""
    _default_tokenizer_type(args)
    if args.mock_data:
        args.vocab_size = args.vocab_size or 1024
        return
    _require(args.data_path is not None, "--data-path",
             "required (an indexed dataset prefix from tools/preprocess_data.py), or --mock-data")
    inputs = {"--tokenizer-model": args.tokenizer_model, "--vocab-file": args.vocab_file,
              "--merge-file": args.merge_file, "--vocab-size": args.vocab_size}
    missing = missing_tokenizer_input(args.tokenizer_type, inputs)
    _require(missing is None, missing, f"required with --tokenizer-type {args.tokenizer_type}")
    _require(args.vocab_extra_ids == 0 or args.tokenizer_type.startswith("BertWordPiece"),
             "--vocab-extra-ids", "only used with BertWordPieceLowerCase / BertWordPieceCase")
    for flag in TOKENIZER_INPUTS[args.tokenizer_type]:
        must_be_file = flag in FILE_FLAGS or args.tokenizer_type != "HuggingFaceTokenizer"
        if flag != "--vocab-size" and must_be_file:
            _require(os.path.isfile(inputs[flag]), flag, f"no such file: {inputs[flag]}")


def _validate_model_features(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for the model-feature flags and the defaults it derives from them
    (``validate_args`` and ``core_transformer_config_from_args`` in
    megatron/training/arguments.py at core_v0.16.1; megatron-core's TransformerConfig checks,
    raised here as flag errors). Runs after :func:`_validate_layout` (hidden % heads)."""
    h, heads, tp = args.hidden_size, args.num_attention_heads, args.tensor_model_parallel_size
    if args.use_rotary_position_embeddings:  # its "Legacy RoPE arguments"
        args.position_embedding_type = "rope"
    _require(args.add_position_embedding or args.position_embedding_type == "rope",
             "--no-position-embedding", "deprecated (Megatron-LM accepts it only with rope); "
             "use --position-embedding-type none")
    _require(not (args.swiglu and args.squared_relu), "--squared-relu",
             "--swiglu and --squared-relu are exclusive")
    _require(not (args.openai_gelu and (args.swiglu or args.squared_relu)), "--openai-gelu",
             "exclusive with --swiglu and --squared-relu")
    if args.ffn_hidden_size is None:  # swiglu: two fc1 projections, ~the parameters of 4h
        args.ffn_hidden_size = int((4 * h * 2 / 3) / 64) * 64 if args.swiglu else 4 * h
        _require(args.ffn_hidden_size > 0, "--swiglu", f"the default FFN size int((4 x {h} x "
                 "2/3) / 64) x 64 is 0 for hidden sizes below 24; give --ffn-hidden-size")
    _require(args.ffn_hidden_size % tp == 0, "--ffn-hidden-size", f"{args.ffn_hidden_size} is "
             f"not divisible by tensor-parallel size {tp}")
    args.kv_channels = args.kv_channels or h // heads
    if args.num_query_groups not in (None, 1):  # 1: the default, ignored without GQA
        _require(args.group_query_attention, "--num-query-groups",
                 "needs --group-query-attention")
    if args.num_query_groups is None:  # Megatron-LM's default, saved with the flags
        args.num_query_groups = 1
    if args.group_query_attention:
        groups = args.num_query_groups
        _require(heads % groups == 0, "--num-query-groups",
                 f"{heads} attention heads do not split into {groups} query groups")
        _require(groups % tp == 0 or tp % groups == 0, "--num-query-groups",
                 f"{groups} query groups must be a multiple or a divisor of tensor-parallel "
                 f"size {tp}")
    if args.add_bias_linear:  # "keep the 'add bias' args in sync"
        args.add_qkv_bias = True
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True
    if tp == 1:  # Megatron-LM turns it off (with a warning) rather than change the numerics
        args.sequence_parallel = False
    if args.sequence_parallel:
        from megatron_2bw.runtime.device import device_kind

        if device_kind(args.cpu) != "cuda":  # the same values, the activations not split
            args.sequence_parallel = False
            args.validation_notes = getattr(args, "validation_notes", []) + [
                "note: --sequence-parallel has no effect on CPU (megatron-core's layers use "
                "torch's LayerNorm/RMSNorm there, WrappedTorchNorm, which refuses it; the "
                "tensor-parallel layers compute the same values without it); ignored"]


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


def _validate_ddp(args: argparse.Namespace) -> None:
    """Megatron-LM's rules for the data-parallel flags (``validate_args`` in
    megatron/training/arguments.py at core_v0.16.1), the settings it derives from them
    (align_param_gather off without virtual pipeline stages; accumulate_allreduce_grads_in_fp32
    on with --bf16 unless --grad-reduce-in-bf16), and ours: what 2BW and the CPU cannot run."""
    for flag, why in (("use_torch_fsdp2", "torch FSDP2 shards the model, which megatron-2bw's "
                       "pipeline schedules and 2BW's weight versions do not handle; use "
                       "--use-distributed-optimizer"),
                      ("use_megatron_fsdp", "megatron FSDP shards the parameters, which "
                       "megatron-2bw's pipeline schedules and 2BW's weight versions do not "
                       "handle; use --use-distributed-optimizer")):
        _require(not getattr(args, flag), "--" + flag.replace("_", "-"), "not supported: " + why)
    _require(args.num_distributed_optimizer_instances == 1, "--num-distributed-optimizer-instances",
             "only 1 is supported (megatron-2bw builds megatron-core's process groups without "
             "the inter-instance groups of a partial distributed optimizer)")
    _require(args.ddp_num_buckets is None or args.ddp_bucket_size is None, "--ddp-num-buckets",
             "give --ddp-num-buckets or --ddp-bucket-size, not both")
    if args.use_distributed_optimizer:
        _require(args.optimizer == "adam", "--use-distributed-optimizer",
                 f"megatron-core's distributed optimizer runs Adam only, not --optimizer "
                 f"{args.optimizer}")
    if args.overlap_param_gather:
        _require(args.use_distributed_optimizer, "--overlap-param-gather",
                 "only supported with --use-distributed-optimizer")
        _require(args.overlap_grad_reduce, "--overlap-param-gather",
                 "needs --overlap-grad-reduce")
    if args.overlap_param_gather_with_optimizer_step:
        flag = "--overlap-param-gather-with-optimizer-step"
        _require(args.use_distributed_optimizer, flag,
                 "only supported with --use-distributed-optimizer")
        _require(args.overlap_param_gather, flag, "needs --overlap-param-gather")
        _require(args.virtual_pipeline_model_parallel_size is not None, flag,
                 "only supported with interleaved pipeline parallelism "
                 "(--num-virtual-stages-per-pipeline-rank > 1, as in Megatron-LM)")
        _require(args.save is None and args.load is None, flag,
                 "not supported with distributed checkpointing yet (Megatron-LM's rule; "
                 "--save/--load write and read torch_dist checkpoints)")
    if args.ddp_average_in_collective:
        from megatron_2bw.runtime.device import device_kind

        _require(device_kind(args.cpu) == "cuda", "--ddp-average-in-collective",
                 "needs CUDA (NCCL's ReduceOp.AVG; gloo has no AVG reduction)")
    if args.virtual_pipeline_model_parallel_size is None:
        args.align_param_gather = False  # Megatron-LM: only with virtual pipeline stages
    if args.bf16 and args.grad_reduce_in_bf16:
        args.accumulate_allreduce_grads_in_fp32 = False
    elif args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check every flag against the others; fill derived fields (data_parallel_size,
    num_microbatches, ...). Raises FlagError naming the first bad flag."""
    args.world_size = world_size
    _validate_required(args)
    _validate_layout(args)
    _validate_model_features(args)
    _validate_moe(args)
    _validate_batch(args)
    _validate_virtual_stages(args)
    _validate_moe_placement(args)
    _validate_layer_wise_muon(args)
    _validate_ddp(args)
    _validate_training(args)
    _validate_data(args)
    return args
