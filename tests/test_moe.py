"""Megatron-LM's MoE flags: what runs, what is refused in one line, and the pieces of
megatron_2bw/training/moe.py on their own (no processes but the runtime's one-rank group).

Each refusal has a repaired twin the same validator accepts, so each error is caused by the
one defect its case introduces. The multi-process runs are tests/test_moe_exact.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_2bw.arguments import FlagError, moe_layer_pattern, parse_args

TINY = ["--cpu", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--mock-data", "--lr", "1e-3", "--train-iters", "2", "--disable-bias-linear"]
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "32"]

CASES = {
    # id: (bad flags, repaired flags, world size, flag named, fragments of the message)
    "expert-parallel-without-experts": (
        ["--expert-model-parallel-size", "2"], [], 2, "--expert-model-parallel-size",
        ["only with --num-experts"]),
    "experts-not-divisible": (
        ["--num-experts", "3", "--expert-model-parallel-size", "2"],
        ["--num-experts", "4", "--expert-model-parallel-size", "2"], 2,
        "--expert-model-parallel-size", ["3 experts", "2 expert-parallel ranks"]),
    "world-not-divisible-by-expert-layout": (
        MOE + ["--expert-model-parallel-size", "4"], MOE + ["--expert-model-parallel-size", "2"],
        2, "--expert-model-parallel-size",
        ["world size 2", "expert tensor (1) x expert (4) x pipeline (1) = 4"]),
    "expert-biases-at-ep1": (
        MOE + ["--add-bias-linear-x"], MOE, 1, "--disable-bias-linear", ["megatron-core"]),
    "global-aux-loss": (
        MOE + ["--moe-router-load-balancing-type", "global_aux_loss"],
        MOE + ["--moe-router-load-balancing-type", "seq_aux_loss"], 1,
        "--moe-router-load-balancing-type", ["global_aux_loss is not supported"]),
    "one-coefficient-per-loss": (
        MOE + ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
               "--moe-aux-loss-coeff", "0.1"],
        MOE + ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
               "--moe-aux-loss-coeff", "0.1", "0.01"], 1, "--moe-aux-loss-coeff",
        ["one coefficient per"]),
    "flex-dispatcher": (
        MOE + ["--moe-token-dispatcher-type", "flex"],
        MOE + ["--moe-token-dispatcher-type", "alltoall"], 1, "--moe-token-dispatcher-type",
        ["DeepEP"]),
    "permute-fusion-on-cpu": (MOE + ["--moe-permute-fusion"], MOE, 1, "--moe-permute-fusion",
                              ["CUDA kernel"]),
    "router-fusion-on-cpu": (MOE + ["--moe-router-fusion"], MOE, 1, "--moe-router-fusion",
                             ["CUDA kernel"]),
    "alltoall-with-expert-tp-on-cpu": (
        MOE + ["--expert-tensor-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
        MOE + ["--expert-tensor-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"],
        2, "--expert-tensor-parallel-size", ["uneven all-gather", "gloo"]),
    "tensor-parallel-on-cpu": (
        MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        MOE + ["--expert-model-parallel-size", "2"], 2, "--tensor-model-parallel-size",
        ["--sequence-parallel", "CUDA", "--expert-model-parallel-size"]),
    "expert-bias-under-2bw": (
        MOE + ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid",
               "--pipeline-schedule", "2bw"],
        MOE + ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid",
               "--pipeline-schedule", "flush"], 1, "--moe-router-enable-expert-bias",
        ["--pipeline-schedule 2bw", "look-ahead forwards"]),
    "expert-bias-needs-sigmoid": (
        MOE + ["--moe-router-enable-expert-bias"],
        MOE + ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid"], 1,
        "--moe-router-enable-expert-bias", ["sigmoid"]),
    "top-1-needs-pre-softmax": (
        MOE + ["--moe-router-topk", "1"],
        MOE + ["--moe-router-topk", "1", "--moe-router-pre-softmax"], 1, "--moe-router-topk",
        ["--moe-router-pre-softmax"]),
    "layer-pattern-length": (
        MOE + ["--moe-layer-freq", "([1]*3)"], MOE + ["--moe-layer-freq", "([1]*3+[0])"], 1,
        "--moe-layer-freq", ["3 entries for 4 layers"]),
    "a-stage-without-experts": (
        MOE + ["--moe-layer-freq", "([1]*2+[0]*2)", "--pipeline-model-parallel-size", "2"],
        MOE + ["--moe-layer-freq", "([1,0]*2)", "--pipeline-model-parallel-size", "2"], 2,
        "--moe-layer-freq", ["pipeline stage 1 holds layers [2, 3]"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_flag_refused_in_one_line(case):
    bad, repaired, world, flag, fragments = CASES[case]
    tiny = TINY
    if "--add-bias-linear-x" in bad:  # the GPT-2 default: biases on
        tiny, bad = [f for f in TINY if f != "--disable-bias-linear"], \
            [f for f in bad if f != "--add-bias-linear-x"]
    parse_args([*TINY, "--global-batch-size", str(2 * world * 2), *repaired], world_size=world)
    with pytest.raises(FlagError) as error:
        parse_args([*tiny, "--global-batch-size", str(2 * world * 2), *bad], world_size=world)
    text = str(error.value)
    assert "\n" not in text and text.startswith(f"{flag}: "), text
    for fragment in fragments:
        assert fragment in text, (fragment, text)


def test_grouped_gemm_is_a_note_on_the_cpu():
    """Megatron-LM's MoE examples pass --moe-grouped-gemm; on the CPU megatron-core's
    SequentialMLP runs the same experts (one note, the flag off in the config)."""
    args = parse_args([*TINY, *MOE, "--moe-grouped-gemm"], world_size=1)
    assert args.moe_grouped_gemm is False
    assert len(args.flag_notes) == 1 and args.flag_notes[0].startswith(
        "note: --moe-grouped-gemm has no effect on CPU"), args.flag_notes


def test_megatron_lm_derivations():
    """Megatron-LM's validate_args: --num-experts 0 is a dense model, the expert FFN defaults
    to --ffn-hidden-size, the expert tensor-parallel size to the tensor-parallel size, lists
    of one become their element; the config has megatron-core's fields."""
    from megatron_2bw.training import build

    dense = parse_args([*TINY, "--num-experts", "0"], world_size=1)
    assert dense.num_experts is None
    args = parse_args([*TINY, "--num-experts", "4", "--ffn-hidden-size", "48",
                       "--moe-router-load-balancing-type", "seq_aux_loss",
                       "--moe-aux-loss-coeff", "0.01", "--moe-layer-freq", "([0]+[1]*3)"],
                      world_size=1)
    assert (args.moe_ffn_hidden_size, args.expert_tensor_parallel_size) == (48, 1)
    assert args.moe_router_load_balancing_type == "seq_aux_loss"
    assert args.moe_aux_loss_coeff == 0.01 and args.moe_layer_freq == [0, 1, 1, 1]
    config = build.transformer_config(args, "cpu")
    assert (config.num_moe_experts, config.moe_ffn_hidden_size, config.moe_layer_freq) == \
        (4, 48, [0, 1, 1, 1])
    assert moe_layer_pattern(2, 4) == [1, 0, 1, 0]
    with pytest.raises(FlagError, match="^--moe-layer-freq: .*pattern"):
        parse_args([*TINY, *MOE, "--moe-layer-freq", "[1]*4;import os"], world_size=1)


def test_transformer_config_refusal_is_one_flag_line():
    """A MoE rule of megatron-core's TransformerConfig that megatron_2bw.arguments does not mirror comes
    back as one line naming --num-experts, not a traceback."""
    from megatron_2bw.training.build import _config_or_flag_error

    class Refusing:
        def __init__(self, **fields):
            raise ValueError("moe_something only works with\nsomething else")

    with pytest.raises(FlagError, match="^--num-experts: megatron-core's TransformerConfig "
                                        "refuses these MoE flags: moe_something only works "
                                        "with$"):
        _config_or_flag_error(Refusing, {"num_moe_experts": 4})


def test_router_runs_without_transformer_engine():
    """megatron-core 0.16.1's router reads ``moe_utils.te_general_gemm``, defined only where
    transformer-engine imports; ``close_gaps`` defines it (None) and the router's linear then
    runs: the same logits as x W^T, and its gradients."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_2bw.training.moe import close_gaps

    had = hasattr(moe_utils, "te_general_gemm")
    saved = getattr(moe_utils, "te_general_gemm", None)
    if had:
        del moe_utils.te_general_gemm
    try:
        x = torch.randn(5, 8, requires_grad=True)
        w = torch.randn(4, 8, requires_grad=True)
        with pytest.raises(NameError, match="te_general_gemm"):
            moe_utils.router_gating_linear(x, w, None, torch.float32)
        close_gaps()
        logits = moe_utils.router_gating_linear(x, w, None, torch.float32)
        torch.testing.assert_close(logits, x @ w.t())
        logits.sum().backward()
        torch.testing.assert_close(w.grad, torch.ones(5, 4).t() @ x.detach())
    finally:
        if had:
            moe_utils.te_general_gemm = saved


def test_aux_loss_scale_is_the_backwards_own():
    """The scale set before a backward: the loss scale now over the microbatch's m (as the
    main loss's gradient gets it), whatever the last forward left."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_2bw.schedules.moe_microbatches import aux_loss_scale_for_backward

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([123.0]))  # another step's, say
    config = SimpleNamespace(grad_scale_func=lambda t: t * 8.0, calculate_per_token_loss=False)
    aux_loss_scale_for_backward(config, 4)
    assert float(MoEAuxLossAutoScaler.main_loss_backward_scale) == 2.0
    config.calculate_per_token_loss = True
    aux_loss_scale_for_backward(config, 4)
    assert float(MoEAuxLossAutoScaler.main_loss_backward_scale) == 8.0
    aux_loss_scale_for_backward(SimpleNamespace(grad_scale_func=None,
                                                calculate_per_token_loss=False), 2)
    assert float(MoEAuxLossAutoScaler.main_loss_backward_scale) == 0.5


def test_every_metric_megatron_core_tracks_is_one_the_log_names():
    """The MoE metrics Megatron-LM 0.16.1 logs are the names megatron-core's routers put in the
    layer-wise tracker (``track_moe_metrics`` writes every one of them); read from the
    installed megatron-core's source, every ``save_to_aux_losses_tracker`` caller and the
    names it records. None is a tokens-per-expert count (docs/moe.md, "Logs")."""
    import argparse
    import pathlib
    import re

    import megatron.core
    from megatron.core.transformer.moe import router

    from megatron_2bw.training.moe import track_names

    root = pathlib.Path(megatron.core.__file__).parent
    callers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if "save_to_aux_losses_tracker(" in p.read_text()
                     and p.name != "moe_utils.py")
    assert callers == ["transformer/moe/router.py"]
    source = pathlib.Path(router.__file__).read_text()
    recorded = set(re.findall(r'"(\w*load_balancing_loss)"', source)) | (
        {"z_loss"} if '"z_loss"' in source else set())
    everything = argparse.Namespace(
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
        moe_z_loss_coeff=1e-3)
    assert set(track_names(everything)) == recorded == {
        "load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss",
        "z_loss"}
    assert not any("tokens" in name for name in recorded)
