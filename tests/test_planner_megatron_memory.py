"""Predicted memory per stage against Megatron-LM's own estimate.

Source: NVIDIA/Megatron-LM, megatron/training/theoretical_memory_usage.py (commit d98e8a64,
2026-08-22), re-derived below for dense GPT and compared with the planner's first stage under
1F1B (flush and megatron, one weight version). Where our model differs by design, the difference
is added to the reference term by term, and the rest must agree within TOLERANCE. Guards: the
planner's memory model stays Megatron-LM's plus documented differences. The formulas and each
difference: docs/testing.md, "What each test module checks", test_planner_megatron_memory.py.
"""

from __future__ import annotations

import pytest

from megatron_2bw.planner import CostModel, Layout, ModelSpec, preset

TOLERANCE = 1e-3
"""Relative: after the differences above, only integer rounding remains."""


def megatron_weight_and_optimizer_bytes(model: ModelSpec, t: int, p: int, dp: int,
                                        distributed_optimizer: bool) -> float:
    """compute_weight_and_optimizer_memory for a dense GPT with LayerNorm and tied embeddings."""
    h, f, L = model.hidden_size, model.ffn_hidden_size, model.num_layers
    attention = 2 * h * h * (1 + 1) * 1          # (1 + groups/heads) * (kv_channels a / h)
    mlp = 2 * h * f
    layernorms = 2 * h * 2
    final_layernorm = 2 * h
    embedding = h * model.padded_vocab(t)
    tp_sharded = ((attention + mlp) * L / p + embedding) / t
    replicated = (layernorms * L + final_layernorm) / p
    per_parameter = 6 + 12 / dp if distributed_optimizer else 18
    return (tp_sharded + replicated) * per_parameter


def megatron_activation_bytes_without_sp(model: ModelSpec, t: int, p: int, b: int,
                                         m: int) -> float:
    """compute_activation_memory_without_sp, pipeline size p > 1, no interleaving."""
    s, h, L = model.seq_length, model.hidden_size, model.num_layers
    total = s * b * h * (10 + 24 / t) * L
    total += 8 * s * b * p                       # input token ids, p microbatches in flight
    total += s * b * h * p                       # embedding dropout mask
    total *= min(1, m / p)
    return total * 1.05


def ours_minus_megatron_weights(model: ModelSpec, t: int, p: int, per_parameter: float) -> float:
    """The parameters our first stage holds and Megatron's formula leaves out, in bytes."""
    h, f, L, s = model.hidden_size, model.ffn_hidden_size, model.num_layers, model.seq_length
    biases = L // p * ((3 * h + f) / t + 2 * h)
    positions = s * h
    final_layernorm_share = 2 * h / p
    return (biases + positions - final_layernorm_share) * per_parameter


def attention_scores_bytes(model: ModelSpec, t: int, b: int) -> float:
    """Softmax output (2 bytes), its dropout mask (1) and dropout output (2) per layer."""
    a, s = model.num_attention_heads, model.seq_length
    return 5 * a * s * s * b / t


LAYOUTS = [
    # (model shape h, a, L), t, d, w, b, m, distributed optimizer, schedule
    ((2048, 16, 24), 2, 4, 2, 1, 8, False, "flush"),
    ((4096, 32, 32), 4, 2, 1, 2, 1, False, "megatron"),   # m < p: one microbatch in flight
    ((5120, 40, 40), 8, 8, 4, 1, 16, True, "megatron"),
]


@pytest.mark.parametrize("flash", [False, True], ids=["scores", "flash"])
@pytest.mark.parametrize("shape,t,d,w,b,m,distributed,schedule", LAYOUTS,
                         ids=["1.3b-t2d4", "6.7b-t4d2-m1", "13b-t8d8-distopt"])
def test_first_stage_memory_matches_megatron_theoretical_memory(shape, t, d, w, b, m,
                                                                distributed, schedule, flash):
    # Megatron's formula keeps no attention scores, as FlashAttention runs: with
    # --attention-backend flash the 5as^2b/t difference goes, and ours adds only the
    # softmax's fp32 log-sum-exp per row and head, 4asb/t per layer.
    h, a, L = shape
    model = ModelSpec("gpt", num_layers=L, hidden_size=h, num_attention_heads=a,
                      seq_length=2048, vocab_size=50257, ffn_hidden_size=4 * h)
    cost = CostModel(model, preset("dgx-a100", nodes=8), "bf16",
                     distributed_optimizer=distributed, flash_attention=flash)
    first = cost.memory(Layout(t, d, w, b, m, False, schedule)).stages[0]
    assert first.extra_versions == 0 and first.gradient_copy == 0

    per_parameter = 6 + 12 / w if distributed else 18
    weights = (megatron_weight_and_optimizer_bytes(model, t, d, w, distributed)
               + ours_minus_megatron_weights(model, t, d, per_parameter))
    ours_weights = first.weights + first.gradients + first.optimizer
    assert ours_weights == pytest.approx(weights, rel=TOLERANCE)

    in_flight = min(1, m / d)
    attention_bytes = (4 * a * model.seq_length * b / t if flash
                       else attention_scores_bytes(model, t, b))
    activations = (megatron_activation_bytes_without_sp(model, t, d, b, m) / 1.05
                   - 8 * model.seq_length * b * d * in_flight
                   + attention_bytes * L * in_flight)
    assert first.activations == pytest.approx(activations, rel=TOLERANCE)


@pytest.mark.parametrize("t,b", [(2, 1), (8, 4)])
def test_layer_bytes_with_sequence_parallel_and_selective_match_megatron(t, b):
    # Megatron's `compute_activation_memory` (sequence parallelism with selective
    # recomputation, Korthikanti et al. Table 2): sbh (18 + 4 f/h) / t per layer, 34 sbh/t for
    # f = 4h, the same file. Without selective recomputation Korthikanti's Eq. 6 adds the
    # attention core's 5as^2b/t.
    model = ModelSpec("gpt", num_layers=24, hidden_size=2048, num_attention_heads=16,
                      seq_length=2048, vocab_size=50257)
    s, h, a = model.seq_length, model.hidden_size, model.num_attention_heads
    megatron = s * b * h * (18 + 4 * model.ffn / h) / t
    both = model.layer_activation_bytes(b, t, 2, sequence_parallel=True,
                                        selective_recompute=True)
    assert both == pytest.approx(megatron, rel=TOLERANCE)
    sequence_only = model.layer_activation_bytes(b, t, 2, sequence_parallel=True)
    assert sequence_only == pytest.approx(megatron + attention_scores_bytes(model, t, b),
                                          rel=TOLERANCE)


def megatron_activation_bytes_with_sp(model: ModelSpec, t: int, p: int, b: int, m: int) -> float:
    """compute_activation_memory (sequence parallelism and selective recomputation), p > 1,
    no interleaving: everything on the first stage divided by t."""
    s, h, L = model.seq_length, model.hidden_size, model.num_layers
    total = s * b * h * (18 + 4 * model.ffn / h) * L
    total += 8 * s * b * p + s * b * h * p
    return total * min(1, m / p) / t


@pytest.mark.parametrize("t,d,b,m", [(2, 4, 1, 8), (8, 8, 2, 4)])
def test_first_stage_with_sequence_parallel_and_selective_matches_megatron(t, d, b, m):
    # The planner's path (CostModel with --sequence-parallel, a selective layout) against the
    # same file's estimate; ours leaves out the int64 token ids (8sb per microbatch, / t).
    model = ModelSpec("gpt", num_layers=24, hidden_size=2048, num_attention_heads=16,
                      seq_length=2048, vocab_size=50257)
    cost = CostModel(model, preset("dgx-a100", nodes=8), "bf16", sequence_parallel=True)
    layout = Layout(t, d, 64 // (t * d), b, m, False, "flush", selective=True)
    first = cost.memory(layout).stages[0]
    token_ids = 8 * model.seq_length * b * d * min(1, m / d) / t
    assert first.activations == pytest.approx(
        megatron_activation_bytes_with_sp(model, t, d, b, m) - token_ids, rel=TOLERANCE)
    # The attention core exists again while one layer's backward replays it.
    assert first.transient == pytest.approx(attention_scores_bytes(model, t, b), rel=TOLERANCE)

