"""The planner: cost model against numbers worked out by hand here, search constraints, written
scripts through our own flag validation, the CLI on GPT-3 175B. No processes are started.

Hand numbers use a small GPT: L=4, h=64, a=4, s=32, V=128 (already a multiple of 128), f=4h.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import os
import shlex
import stat
import subprocess
import time
from pathlib import Path

import pytest

from megatron_2bw.arguments import FlagError
from megatron_2bw.logparse import parse_log
from megatron_2bw.planner import (CostModel, E2EProfile, GiB, Layout, ModelSpec, PlanRequest,
                                  Profile, preset, search, write_plan)
from megatron_2bw.planner.cluster import Link
from megatron_2bw.planner.search import BF16_ITERATION_FACTORS, ITERATION_FACTORS
from megatron_2bw.planner.cost import ALL_SCHEDULES, simulated_iteration, _simulate_normalized
from megatron_2bw.schedules import SCHEDULES as SCHEDULE_SPECS
from megatron_2bw.planner.accuracy import compare, format_accuracy
from megatron_2bw.planner.flags import launch_flags, parse_for_validation
from megatron_2bw.planner.e2e import E2ERun
from megatron_2bw.planner.profile import Sample
from megatron_2bw.runtime.ports import free_port

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = ModelSpec("gpt", num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=32,
                       vocab_size=128)
SMALL = ModelSpec("gpt", num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                  vocab_size=128)
GPT3 = ModelSpec("gpt", num_layers=96, hidden_size=12288, num_attention_heads=96,
                 seq_length=2048, vocab_size=51200)


def _plan_cli():
    spec = importlib.util.spec_from_file_location("plan_cli", REPO / "tools" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- model sizes ---------------------------------------------------------------------------


def test_parameter_counts_by_hand():
    # 12h^2 + 13h per layer; embedding V h + s h; GPT-3 175B has ~174.6e9 parameters.
    assert SMALL.layer_parameters() == 12 * 64 * 64 + 13 * 64 == 49_984
    assert SMALL.embedding_parameters() == 128 * 64 + 32 * 64 == 10_240
    # Stage 0 of 2: two layers and the embedding; stage 1: two layers, final LayerNorm (2h)
    # and the last stage's copy of the tied word embedding (V h).
    assert SMALL.stage_parameters(1, 2, 0) == 2 * 49_984 + 10_240 == 110_208
    assert SMALL.stage_parameters(1, 2, 1) == 2 * 49_984 + 128 + 8_192 == 108_288
    # One stage: the output layer is the embedding itself.
    assert SMALL.num_parameters() == 4 * 49_984 + 10_240 + 128
    assert 174.5e9 < GPT3.num_parameters() < 174.7e9
    # t = 2: matrices and column-parallel biases halve, LayerNorms and row biases stay.
    h = 64
    assert SMALL.layer_parameters(2) == (4 * h * h + 2 * h * 4 * h + 3 * h + 4 * h) // 2 + 6 * h


def test_activation_bytes_match_korthikanti():
    # Korthikanti et al. 2022 Eq. 1/2 with 16-bit activations: sbh(10 + 24/t + 5as/(ht)).
    s, b, h, a = 32, 2, 64, 4
    for t in (1, 2, 4):
        expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        assert SMALL.layer_activation_bytes(b, t, element_bytes=2) == pytest.approx(expected)


# ---- memory of a layout, by hand ----------------------------------------------------------


def _cluster_small():
    return preset("dgx-a100", nodes=1)


def test_memory_of_2bw_layout_by_hand():
    cost = CostModel(SMALL, _cluster_small(), "bf16")
    memory = cost.memory(Layout(t=1, d=2, w=1, b=2, m=4, recompute=False, schedule="2bw"))
    # Per parameter: 2 weight versions x 2 bytes + fp32 main_grad 4 + fp32 master 4 + Adam 8
    # + the deferred step's fp32 gradient copy 4 (clipping is on).
    per_param = 2 * 2 + 4 + 4 + 8 + 4
    layer = 32 * 2 * 64 * (34 + 5 * 4 * 32 / 64)  # sbh(34 + 5as/h) = 180,224 bytes
    mask = 32 * 2 * 64  # embedding dropout mask, 1 byte per element
    stage0 = 110_208 * per_param + 2 * (2 * layer + mask)  # stashes d - 0 = 2 microbatches
    head = 2 * 32 * 2 * 64 * 2 + 4 * 2 * 32 * 128  # LN and output inputs; fp32 softmax
    logits_grad = 4 * 2 * 32 * 128
    stage1 = 108_288 * per_param + 1 * (2 * layer + head) + logits_grad  # stashes d - 1 = 1
    assert memory.stages[0].total == pytest.approx(stage0) == 3_374_080
    assert memory.stages[1].total == pytest.approx(stage1) == 3_041_280
    assert memory.peak == pytest.approx(stage0)
    assert memory.stages[0].stashed_microbatches == 2
    # The step where the loop calls it: no copy.
    synchronous = CostModel(SMALL, _cluster_small(), "bf16", deferred_step=False).memory(
        Layout(t=1, d=2, w=1, b=2, m=4, recompute=False, schedule="2bw"))
    assert [s.total for s in synchronous.stages] == pytest.approx(
        [stage0 - 4 * 110_208, stage1 - 4 * 108_288])


def test_memory_gpipe_recompute_fp32_by_hand():
    cost = CostModel(SMALL, _cluster_small(), "fp32")
    memory = cost.memory(Layout(t=1, d=2, w=1, b=2, m=4, recompute=True, schedule="gpipe"))
    # fp32 Adam: weights 4 + grads 4 + 2 moments 8 (no separate master); one version.
    per_param = 16
    layer_input = 32 * 2 * 64 * 4  # each checkpointed layer keeps its input, sbh x 4 bytes
    mask = 32 * 2 * 64
    # Full activations of one layer (recomputed during its backward), fp32 elements:
    # replicated 4sbh e + 2 masks sbh, split (4h + 2f) sb e + as^2 b (2e + 1).
    layer_full = 32 * 2 * 64 * (4 * 4 + 2) + 32 * 2 * (4 * 64 + 2 * 256) * 4 \
        + 4 * 32 * 32 * 2 * (2 * 4 + 1)
    stage0 = 110_208 * per_param + 4 * (2 * layer_input + mask) + layer_full  # GPipe: m = 4
    assert memory.stages[0].total == pytest.approx(stage0)
    assert memory.stages[0].stashed_microbatches == 4


def test_data_parallel_sharded_optimizer_divides_master_and_moments():
    base = CostModel(SMALL, _cluster_small(), "bf16")
    sharded = CostModel(SMALL, _cluster_small(), "bf16", distributed_optimizer=True)
    layout = Layout(t=1, d=1, w=4, b=1, m=2, recompute=False, schedule="megatron")
    params = SMALL.num_parameters()
    assert base.memory(layout).stages[0].optimizer == params * 12
    assert sharded.memory(layout).stages[0].optimizer == params * 12 / 4


def test_sharded_muon_deals_out_whole_parameters():
    """--optimizer muon --use-distributed-optimizer (dist_muon): each replica keeps the state
    of whole parameters, so the fullest keeps up to one largest tensor more than an even
    share: SMALL's FC1 (4h x h = 16,384 elements; its padded embedding is 128 x 64 = 8,192).
    bf16: an fp32 master and Muon's (or Adam's first-moment-sized) momentum, 8 bytes each."""
    sharded = CostModel(SMALL, _cluster_small(), "bf16", distributed_optimizer=True,
                        optimizer="muon")
    layout = Layout(t=1, d=1, w=4, b=1, m=2, recompute=False, schedule="megatron")
    params = SMALL.num_parameters()
    assert sharded.memory(layout).stages[0].optimizer == (params / 4 + 4 * 64 * 64) * 8
    whole = CostModel(SMALL, _cluster_small(), "bf16", optimizer="muon")
    assert whole.memory(layout).stages[0].optimizer == params * 8


def test_predict_under_bf16_keeps_a_third_version_and_the_masters_before_the_step():
    """--stale-weight-correction predict with --bf16: R's bf16 slot (2 bytes a parameter) and
    the fp32 masters' W(t) during the step (4 bytes, 4 / w with the distributed optimizer);
    sharded, R is summed over the w replicas: one ring all-reduce of the stage's bf16 weights
    more in the step."""
    layout = Layout(t=1, d=2, w=2, b=1, m=4, recompute=False, schedule="2bw")
    link = _cluster_small().group_link(2, stride=1)
    for sharded, per_parameter in ((False, 2 + 4), (True, 2 + 4 / 2)):
        plain = CostModel(SMALL, _cluster_small(), "bf16", distributed_optimizer=sharded)
        corrected = CostModel(SMALL, _cluster_small(), "bf16", distributed_optimizer=sharded,
                              correction="predict")
        for a, b in zip(plain.memory(layout).stages, corrected.memory(layout).stages):
            assert b.extra_versions - a.extra_versions == a.parameters * per_parameter
        first = plain.memory(layout).stages[0].parameters  # the fuller stage (embedding)
        more = corrected.time(layout).step - plain.time(layout).step
        assert more == pytest.approx(link.all_reduce(first * 2, 2) if sharded else 0.0)


# ---- communication, by hand ---------------------------------------------------------------


def test_ring_all_reduce_bytes():
    link = Link(bandwidth=1e9, latency=0.0)
    # Each rank sends 2(n-1)/n of the buffer.
    assert link.all_reduce(8e9, 8) == pytest.approx(2 * 7 / 8 * 8)
    assert link.all_reduce(8e9, 1) == 0.0


def test_tensor_parallel_all_reduces_on_nvlink_then_network():
    cluster = preset("dgx-h100", nodes=4)
    cost = CostModel(GPT3, cluster, "bf16")
    size = 1 * 2048 * 12288 * 2  # one (s, b, h) bf16 activation: 50,331,648 bytes
    # Middle stage of 4: 24 layers x (2 forward + 2 backward) ring all-reduces over t = 8
    # GPUs of a node, NVLink 450 GB/s per direction, 5 us per message.
    one = 2 * 7 * 5e-6 + 2 * 7 / 8 * size / 450e9
    estimate = cost.time(Layout(t=8, d=4, w=1, b=1, m=4, recompute=False, schedule="flush"))
    assert estimate.tensor_parallel[1] == pytest.approx(24 * 4 * one)
    # t = 16 spans two nodes: the ring leaves each node through its 8 members, each on its
    # own 400 Gb/s adapter (50 GB/s): 8 x 50 = 400 GB/s across, under NVLink's 450; 10 us
    # per message.
    one_ib = 2 * 15 * 10e-6 + 2 * 15 / 16 * size / 400e9
    estimate = cost.time(Layout(t=16, d=2, w=1, b=1, m=4, recompute=False, schedule="flush"))
    layers = 48
    assert estimate.tensor_parallel[0] == pytest.approx(layers * 4 * one_ib + one_ib)
    # The paper's servers share one 25 Gb/s adapter among 8 V100s: a 16-wide group crosses at
    # the whole adapter (8 members x 1/8 each); --gpus-per-node 4 does not change what the
    # adapter carries (4 members x 1/4 each).
    paper = preset("paper", nodes=2)
    assert paper.group_link(16, 1).bandwidth == pytest.approx(25e9 / 8)
    assert paper.with_(gpus_per_node=4, nodes=4).group_link(16, 1).bandwidth == \
        pytest.approx(25e9 / 8)
    # One data-parallel rank per server (t = 8): 8 rings share the adapter, 1/8 each.
    assert paper.group_link(2, 8).bandwidth == pytest.approx(25e9 / 8 / 8)
    # Recomputation replays the forward's two all-reduces in the backward.
    rc = cost.time(Layout(t=8, d=4, w=1, b=1, m=4, recompute=True, schedule="flush"))
    assert rc.tensor_parallel[1] == pytest.approx(24 * 6 * one)


def test_data_parallel_all_reduce_inside_a_node_when_it_fits():
    cluster = preset("dgx-h100", nodes=2)
    cost = CostModel(SMALL, cluster, "bf16", clip_grad=False)
    grads = SMALL.num_parameters() * 4  # fp32 main_grad
    inside = cost.time(Layout(t=1, d=1, w=8, b=1, m=1, recompute=False, schedule="megatron"))
    assert inside.data_parallel == pytest.approx(2 * 7 * 5e-6 + 2 * 7 / 8 * grads / 450e9)
    across = cost.time(Layout(t=1, d=1, w=16, b=1, m=1, recompute=False, schedule="megatron"))
    # 8 members per node, each over its own 50 GB/s NIC: 400 GB/s across the nodes.
    assert across.data_parallel == pytest.approx(2 * 15 * 10e-6 + 2 * 15 / 16 * grads / 400e9)
    # t = 8, w = 2: one member per node, 8 groups at once, each on its own NIC: 50 GB/s.
    wide = cost.time(Layout(t=8, d=1, w=2, b=1, m=1, recompute=False, schedule="megatron"))
    grads8 = SMALL.stage_parameters(8, 1, 0) * 4
    assert wide.data_parallel == pytest.approx(2 * 10e-6 + grads8 / 50e9)


# ---- bubbles, by hand ---------------------------------------------------------------------


@pytest.mark.parametrize("schedule,d,m,expected", [
    ("gpipe", 4, 8, (8 + 4 - 1) * 3),   # (m + d - 1)(F + B): bubble (d-1)/(m+d-1)
    ("flush", 4, 8, (8 + 4 - 1) * 3),
    ("flush", 2, 4, (4 + 2 - 1) * 3),
    ("naive", 4, 8, 8 * 4 * 3),         # d-fold: one stage at a time
    ("2bw", 4, 8, 8 * 3),               # steady state without a pipeline-wide step: no bubble
    ("pipedream", 4, 8, 8 * 3),         # no flush either: the same steady state
    ("pipemare", 4, 8, 8 * 3),
    # ZB-H1 (Qi et al. 2024, Section 2.1): m (F + B) + (d - 1)(F + I - W), I = W = B/2 = 1.
    ("zb-h1", 4, 8, 8 * 3 + 3 * (1 + 1 - 1)),
    ("zb-h1", 2, 4, 4 * 3 + 1 * (1 + 1 - 1)),
])
def test_uniform_pipeline_iteration_closed_form_and_simulator(schedule, d, m, expected):
    forward, backward = [1.0] * d, [2.0] * d
    closed = CostModel._closed_form(schedule, d, m, forward, backward, 0.0, 0.0, "local")
    assert closed == pytest.approx(expected)
    simulated = simulated_iteration(schedule, d, m, tuple(forward), tuple(backward), 0.0, 0.0,
                                    "local")
    assert simulated == pytest.approx(expected)
    work = m * 3
    bubble = 1 - work / expected
    if schedule in ("gpipe", "flush"):
        assert bubble == pytest.approx((d - 1) / (m + d - 1))


def test_new_schedules_memory_by_hand():
    # PipeDream-1F1B with weight stashing: two versions and 2BW's stash d - i; ZB-H1: one
    # version, flush's stash d - i and up to i + 1 pending W's; flush d - i.
    cost = CostModel(SMALL, preset("dgx-a100", nodes=1), "bf16")
    d, m = 2, 4
    memory = {s: cost.memory(Layout(1, d, 1, 2, m, False, s)).stages
              for s in ("flush", "pipedream", "zb-h1")}
    for i in range(d):
        flush, pipedream, zbh1 = (memory[s][i] for s in ("flush", "pipedream", "zb-h1"))
        assert pipedream.weights == flush.weights > 0  # the last stage reads one version
        assert pipedream.extra_versions == (pipedream.weights if i < d - 1 else 0)
        assert zbh1.extra_versions == flush.extra_versions == 0
        assert (flush.stashed_microbatches, pipedream.stashed_microbatches,
                zbh1.stashed_microbatches, zbh1.pending_weight_grads) == (d - i, d - i, d - i,
                                                                          i + 1)
        assert pipedream.activations == flush.activations
        assert pipedream.total - flush.total == pytest.approx(
            pipedream.extra_versions + pipedream.gradient_copy)
    # ZB-H1's activations: a microbatch stashed keeps A bytes, one whose W is pending keeps its
    # linear layers' inputs and output gradients (schedules/wgrad.py): per layer QKV h + 3h,
    # projection h + h, FC1 h + f, FC2 f + h = 16 sbh e, and on the last stage the output
    # layer's h + V (its copy of the tied embedding is a deferred weight), per token.
    layer = 32 * 2 * 64 * (34 + 5 * 4 * 32 / 64)  # sbh(34 + 5as/h) = 180,224 bytes
    mask = 32 * 2 * 64
    head = 2 * 32 * 2 * 64 * 2 + 4 * 2 * 32 * 128
    stash = [2 * layer + mask, 2 * layer + head]
    pending = [2 * 16 * 32 * 2 * 64 * 2, 2 * 16 * 32 * 2 * 64 * 2 + 32 * 2 * (64 + 128) * 2]
    # Stage 0 runs F0 F1 I0 W0 F2 I1 W1 ...: at most 2 stashed, or 1 and 1 pending; stage 1
    # F0 I0 F1 I1 W0 ...: 1 stashed and 1 pending, or 2 pending.
    expected = [max(2 * stash[0], stash[0] + pending[0]),
                max(stash[1] + pending[1], 2 * pending[1])]
    assert [s.activations for s in memory["zb-h1"]] == pytest.approx(expected) \
        == [729_088, 696_320]


def test_v_schedules_place_embedding_and_output_layer_on_rank_0_by_hand():
    """zb-v's V (rank i holds virtual stages i and 2d-1-i): rank 0 holds the embedding
    (virtual stage 0) and the output layer (virtual stage 2d-1), rank d-1 neither; memory and
    time per rank follow, worked out by hand for SMALL untied, d = 2, m = 4, b = 2, bf16."""
    model = dataclasses.replace(SMALL, untie_embeddings=True)
    cost = CostModel(model, preset("dgx-a100", nodes=1), "bf16")
    memory = cost.memory(Layout(1, 2, 1, 2, 4, False, "zb-v")).stages
    # Rank 0: 2 layers, the embedding (V h + s h) and the output layer (2h + V h); rank 1: 2
    # layers. bf16 weights 2 + fp32 grads 4 + master 4 + Adam 8 bytes per parameter.
    params = [2 * 49_984 + 10_240 + 128 + 8_192, 2 * 49_984]
    assert [s.parameters for s in memory] == params == [118_528, 99_968]
    # A chunk pass keeps one layer, sbh(34 + 5as/h); rank 0's chunk 0 the embedding's dropout
    # mask (sbh), its chunk 1 the output layer's inputs and fp32 softmax (2sbh e + 4sbV). A
    # pending W keeps 16 sbh e per layer, and on rank 0's chunk 1 the output layer's input and
    # logits' gradient sb(h + V) e.
    layer, mask = 32 * 2 * 64 * (34 + 5 * 4 * 32 / 64), 32 * 2 * 64
    head = 2 * 32 * 2 * 64 * 2 + 4 * 2 * 32 * 128
    layer_w, head_w = 16 * 32 * 2 * 64 * 2, 32 * 2 * (64 + 128) * 2
    # Rank 0 runs F0 F1 F2 F0c1 I0c1 W0c1 F1c1 ... F3: at most 3 chunk-0 passes and one
    # chunk-1 pass stashed (or 4 chunk-0, or 3 and a pending W). Rank 1 runs F0 F0c1 F1 F1c1
    # I0c1 W0c1 F2 ...: at most 2 + 2 or 3 + 1 passes stashed.
    rank0 = max(3 * (layer + mask) + layer + head, 4 * (layer + mask),
                3 * (layer + mask) + layer_w + head_w)
    rank1 = 4 * layer
    assert [s.activations for s in memory] == pytest.approx([rank0, rank1]) \
        == [782_336, 720_896]
    logits_grad = 4 * 2 * 32 * 128  # fp32, during the output layer's backward: rank 0's
    assert [s.transient for s in memory] == [logits_grad, 0]
    assert [s.total for s in memory] == pytest.approx(
        [params[0] * 18 + rank0 + logits_grad, params[1] * 18 + rank1])
    # Time: rank 0 computes the embedding and the output layer; at d = 4 the middle ranks send
    # twice per microbatch and direction (both chunks' neighbours are on other ranks), the ends
    # once (rank 0's chunk 1 is the model's end, rank 3's chunk 0 hands over locally).
    deep = dataclasses.replace(model, num_layers=8)
    cost = CostModel(deep, preset("dgx-a100", nodes=1), "bf16")
    time = cost.time(Layout(1, 4, 1, 2, 8, False, "zb-v"))
    send = deep.boundary_bytes(2, 2) / cost.cluster.p2p_link(4, stride=1).bandwidth
    ends = cost.kernel_time("embedding", 2, 1) + cost.kernel_time("head", 2, 1)
    for work in (time.forward, time.backward):
        assert work[1] == work[2]
        assert work[1] - work[3] == pytest.approx(send)
    assert time.forward[0] - time.forward[3] == pytest.approx(ends)
    assert time.backward[0] - time.backward[3] == pytest.approx(2 * ends)


def test_split_backward_counts_repeat_from_2d_plus_1_microbatches():
    """The memory model reads a split-backward schedule's stashed and pending counts at
    min(m, 2d + 1) microbatches (the search stays fast at m in the hundreds): beyond that the
    steady state only repeats, checked here against the schedules' own lists."""
    from megatron_2bw.planner.cost import _held_counts

    for schedule in ("zb-h1", "zb-v", "dualpipev"):
        for d in (2, 3, 4, 5):
            for m in range(2 * d + 2, 4 * d + 3):
                for i in range(d):
                    assert set(_held_counts(schedule, d, m, i)) == set(
                        _held_counts(schedule, d, 2 * d + 1, i)), (schedule, d, m, i)


def test_llama_shapes_by_hand_and_through_the_written_flags():
    """SwiGLU and grouped-query attention: FC1 2f wide (f Megatron-LM's SwiGLU default), QKV
    a + 2g heads; the planner writes the flags and the training's parser reads the same
    model back."""
    model = ModelSpec("gpt", num_layers=4, hidden_size=64, num_attention_heads=4,
                      seq_length=32, vocab_size=128, untie_embeddings=True, num_query_groups=2,
                      gated_linear_unit=True)
    h, f = 64, int(4 * 64 * 2 / 3 / 64) * 64
    assert (model.ffn, model.qkv_width, model.fc1_width) == (f, (4 + 2 * 2) * 16, 2 * f) \
        == (128, 128, 256)
    # QKV h x 2h + 2h, projection h^2, FC1 h x 2f + 2f, FC2 f h; biases h each, 2 LayerNorms.
    assert model.layer_parameters() == h * 2 * h + 2 * h + h * h + h * 2 * f + 2 * f + f * h \
        + 6 * h
    assert model.layer_forward_flops(1) == 2 * 32 * (h * 2 * h + h * h + h * 2 * f + f * h) \
        + 4 * 32 * 32 * h
    layout = Layout(1, 2, 1, 1, 4, False, "zb-v")
    flags = launch_flags(layout, model, "bf16") + ["--mock-data", "--train-iters", "1"]
    args = parse_for_validation(flags, model, world_size=2)
    assert (args.swiglu, args.num_query_groups, args.ffn_hidden_size) == (True, 2, f)
    assert ModelSpec.from_args(args) == dataclasses.replace(  # the data sets the vocabulary
        model, ffn_hidden_size=f, vocab_size=args.vocab_size)
    cli = _plan_cli()
    assert cli._model(cli.plan_parser().parse_args(
        ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "128", "--untie-embeddings-and-output-weights",
         "--swiglu", "--group-query-attention", "--num-query-groups", "2"])) == model


def test_pipedream_at_one_microbatch_holds_d_minus_i_versions():
    """PipeDream as published (an update per microbatch, m = 1): stage i keeps d - i weight
    versions (2BW paper, Section 2), the memory 2BW was made to avoid; 2BW refuses m < d."""
    cost = CostModel(SMALL, preset("dgx-a100", nodes=1), "bf16")
    d = 4
    stages = cost.memory(Layout(1, d, 1, 2, 1, False, "pipedream")).stages
    assert [s.extra_versions / s.weights for s in stages] == [d - i - 1 for i in range(d)]
    assert "2bw needs m >= d" in Layout(1, d, 1, 2, 1, False, "2bw").problem(SMALL.num_layers)
    assert Layout(1, d, 1, 2, 1, False, "pipedream").problem(SMALL.num_layers) is None


def test_every_planner_schedule_is_accepted_by_the_training_parser():
    model = ModelSpec("gpt", num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                      vocab_size=128)
    assert set(ALL_SCHEDULES) == set(SCHEDULE_SPECS) | {"megatron"}
    for schedule in ALL_SCHEDULES:
        for recompute in (False, True):
            layout = Layout(t=1, d=2, w=1, b=1, m=2, recompute=recompute, schedule=schedule)
            flags = launch_flags(layout, model, "bf16") + ["--mock-data", "--train-iters", "1"]
            # The planner refuses exactly what the training's parser refuses.
            if layout.problem(model.num_layers):
                with pytest.raises(FlagError, match=schedule):
                    parse_for_validation(flags, model, world_size=2)
            else:
                args = parse_for_validation(flags, model, world_size=2)
                assert args.pipeline_schedule == schedule
    assert Layout(1, 2, 1, 1, 2, True, "zb-h1").problem(4)
    plan = search(PlanRequest(model, preset("dgx-a100", nodes=1), 16, micro_batch_sizes=(1, 2),
                              simulate_top=0))
    assert not any(c.layout.schedule == "zb-h1" and c.layout.recompute for c in plan.ranked)
    assert any(r.value("schedule") == "zb-h1" and r.value("recompute")
               and "recomputation" in r.reason
               for r in plan.rejected)


def test_2bw_with_pipeline_wide_step_waits_for_the_backward_wave():
    # Gradient clipping makes the step a collective over all stages: it waits for stage 0's
    # last backward, d - 1 backwards after the last stage's: m(F+B) + (d-1)B + S.
    d, m, F, B, S = 4, 8, 1.0, 2.0, 0.5
    expected = m * (F + B) + (d - 1) * B + S
    assert CostModel._closed_form("2bw", d, m, [F] * d, [B] * d, 0.0, S, "pipeline") == expected
    assert simulated_iteration("2bw", d, m, (F,) * d, (B,) * d, 0.0, S, "pipeline") == \
        pytest.approx(expected)


def test_2bw_step_waits_for_the_first_stage_with_tied_embeddings():
    # Without clipping, tied input/output embeddings still sum their gradient between the first
    # and the last stage at the step: where the loop calls the step, the last stage waits for
    # stage 0's last backward, d - 1 backwards after its own, and the stages between follow the
    # last one. Untied, or with the step deferred (the default), no wait.
    profile = _profile(intra_node_link=Link(1e9, 0.0))
    cluster = preset("cpu-local", gpus_per_node=2)
    layout = Layout(t=1, d=2, w=1, b=2, m=4, recompute=False, schedule="2bw")
    untied_model = dataclasses.replace(SMALL, untie_embeddings=True)
    tied = CostModel(SMALL, cluster, "fp32", profile=profile, clip_grad=False,
                     deferred_step=False).time(layout)
    untied = CostModel(untied_model, cluster, "fp32", profile=profile,
                       clip_grad=False, deferred_step=False).time(layout)
    deferred = CostModel(SMALL, cluster, "fp32", profile=profile, clip_grad=False).time(layout)
    send = 32 * 2 * 64 * 4 / 1e9  # one fp32 (s, b, h) tensor over 1 GB/s
    # Stage 1 (2 layers + head, plus the gradient send) is the bottleneck either way.
    stage1 = (2 * 0.010 + 0.004) + (2 * 0.020 + 0.008 + send)
    assert untied.iteration == pytest.approx(4 * stage1 + untied.step)
    lag = 2 * 0.020 + 0.001  # stage 0's last backward (the gradient's send is in stage 1's)
    assert tied.iteration == pytest.approx(4 * stage1 + lag + tied.step)
    assert deferred.iteration == pytest.approx(4 * stage1 + tied.step)
    simulated = CostModel(SMALL, cluster, "fp32", profile=profile, clip_grad=False,
                          deferred_step=False).time(layout, simulate=True)
    assert simulated.iteration == pytest.approx(tied.iteration, rel=1e-3)


def test_simulator_calls_are_memoized_across_scales():
    _simulate_normalized.cache_clear()
    simulated_iteration("flush", 3, 5, (1.0, 1.0, 1.0), (2.0, 2.0, 2.0), 0.0, 0.0, "local")
    value = simulated_iteration("flush", 3, 5, (3e-3,) * 3, (6e-3,) * 3, 0.0, 0.0, "local")
    assert _simulate_normalized.cache_info().hits == 1
    assert value == pytest.approx((5 + 3 - 1) * 9e-3)


# ---- search constraints -------------------------------------------------------------------


GPT_8B = ModelSpec("gpt", num_layers=72, hidden_size=3072, num_attention_heads=32,
                   seq_length=1024, vocab_size=51200)


def test_slow_network_keeps_tensor_parallelism_inside_a_node():
    cluster = preset("paper", nodes=8)  # 8 x V100-16GB per server, 25 Gb/s between servers
    plan = search(PlanRequest(GPT_8B, cluster, global_batch_size=512, precision="fp16"))
    assert plan.best is not None
    assert any(c.layout.d > 1 for c in plan.ranked)  # a pipeline layout fits
    assert plan.best.layout.t <= cluster.gpus_per_node
    assert all(c.layout.t <= 8 for c in plan.ranked[:10])


def test_2bw_excluded_when_asked():
    cluster = preset("paper", nodes=8)
    allowed = ("flush", "gpipe", "naive", "megatron")
    with_2bw = search(PlanRequest(GPT_8B, cluster, 512, "fp16", schedules=allowed + ("2bw",),
                                  iteration_factor=1.0))  # throughput alone
    without = search(PlanRequest(GPT_8B, cluster, 512, "fp16", schedules=allowed))
    assert with_2bw.best.layout.schedule == "2bw"
    assert without.ranked and all(c.layout.schedule in allowed for c in without.ranked)
    assert all(r.value("schedule") != "2bw" for r in without.rejected)


def test_2bw_needs_as_many_microbatches_as_stages():
    cluster = preset("dgx-a100", nodes=1)
    plan = search(PlanRequest(SMALL, cluster, global_batch_size=4, micro_batch_sizes=(1, 2),
                              schedules=("2bw",)))
    # d = 4, w = 2, b = 1: m = 4 / (1 x 2) = 2 < 4.
    reasons = [r.reason for r in plan.rejected if r.values()[:4] == (1, 4, 2, 1)]
    assert reasons and "m >= d" in reasons[0]
    assert all(c.layout.m >= c.layout.d for c in plan.ranked)


def test_infeasible_memory_rejected_with_reason(tmp_path):
    # GPT-3 on one DGX-H100: 174.6e9 parameters x 18 bytes of weights, gradients and Adam
    # state are 3.1 TB, 393 GB per GPU even with t = 8, over 72 GiB (90% of 80 GiB).
    cluster = preset("dgx-h100", nodes=1)
    plan = search(PlanRequest(GPT3, cluster, global_batch_size=64))
    assert plan.best is None
    memory = [r for r in plan.rejected if r.reason.startswith("memory")]
    assert memory
    t8 = next(r for r in memory if (r.layout.t, r.layout.d, r.layout.b, r.layout.recompute,
                                    r.layout.schedule) == (8, 1, 1, True, "megatron"))
    assert t8.memory_bytes > 174.6e9 * 18 / 8
    assert "> 72.00 GiB" in t8.reason
    # A family refused at t alone: 4 heads do not split 8 ways; its other fields stay open.
    small = search(PlanRequest(SMALL, cluster, global_batch_size=64, simulate_top=0))
    heads = [r for r in small.rejected if "attention heads" in r.reason]
    assert [(r.layout, r.values()) for r in heads] == [(None, (8,) + (None,) * 7)]
    paths = write_plan(plan, tmp_path)
    rows = paths["rejected"].read_text().splitlines()
    assert rows[0].split(",")[:3] == ["t", "d", "w"] and len(rows) == len(plan.rejected) + 1
    assert "flags" not in paths


# ---- written flags and scripts through our own validation -----------------------------


def _plan_small_cluster():
    cluster = preset("dgx-a100", nodes=2)
    model = ModelSpec("gpt", num_layers=24, hidden_size=2048, num_attention_heads=16,
                      seq_length=1024, vocab_size=50257)
    return search(PlanRequest(model, cluster, global_batch_size=256)), model


def test_flag_line_passes_validate_args(tmp_path):
    plan, model = _plan_small_cluster()
    paths = write_plan(plan, tmp_path)
    layout = plan.best.layout
    flags = shlex.split(paths["flags"].read_text())
    length = ["--mock-data", "--train-iters", "1"]  # the flags file leaves the length out
    args = parse_for_validation(flags + length, model, world_size=layout.world)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.data_parallel_size) == (layout.t, layout.d, layout.w)
    assert args.num_microbatches == layout.m and args.pipeline_schedule == layout.schedule
    # The same flags for another world size are refused by our validator.
    with pytest.raises(FlagError):
        parse_for_validation(flags + length, model, world_size=layout.world + 1)
    document = json.loads(paths["plan"].read_text())
    assert document["choice"]["layout"]["t"] == layout.t
    assert len(document["alternatives"]) == min(20, len(plan.ranked))


REFUSED_BY_TRAINING = {  # (optimizer, precision, correction, sharded, experts) -> flag
    ("sgd", "fp32", "none", True, False): "--use-distributed-optimizer",
    ("muon", "fp16", "none", False, False): "--fp16",
}
"""Combinations the training refuses (each was planned, and its flags refused at launch)."""


def test_every_combination_the_planner_accepts_launches(tmp_path, capsys):
    """Every optimizer x precision x correction x sharded optimizer x experts: plan.py either
    refuses it in one line, naming the flag the training's validator names, or writes flags
    that validator accepts for the plan's world size."""
    cli = _plan_cli()
    base = ["--cluster", "dgx-h100", "--nodes", "1", "--global-batch-size", "32",
            "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
            "--seq-length", "256", "--vocab-size", "1024"]
    planned = set()
    for combo in itertools.product(("adam", "sgd", "muon"), ("fp32", "bf16", "fp16"),
                                   ("none", "predict", "dc", "ef"), (False, True),
                                   (False, True)):
        optimizer, precision, correction, sharded, experts = combo
        out = tmp_path / "-".join(map(str, combo))
        argv = base + ["--optimizer", optimizer, "--precision", precision,
                       "--stale-weight-correction", correction, "--out", str(out)]
        argv += ["--use-distributed-optimizer"] * sharded
        argv += ["--num-experts", "4", "--moe-router-topk", "2"] * experts
        try:
            cli.main(argv)
        except SystemExit as exit_info:
            error = capsys.readouterr().err
            assert exit_info.code == 2 and error.startswith("error: --"), (combo, error)
            assert len(error.strip().splitlines()) == 1
            expected = REFUSED_BY_TRAINING.get(combo)
            assert expected is None or error.startswith(f"error: {expected}:"), (combo, error)
            continue
        assert combo not in REFUSED_BY_TRAINING, combo
        capsys.readouterr()
        plan = json.loads((out / "plan.json").read_text())["choice"]["layout"]
        model = ModelSpec("gpt", 4, 256, 8, 256, 1024, num_experts=4 if experts else None)
        flags = shlex.split((out / "flags.txt").read_text())
        parse_for_validation(flags + ["--mock-data", "--train-iters", "1"], model,
                             world_size=plan["t"] * plan["d"] * plan["w"])
        planned.add(combo)
    assert planned >= {("muon", "fp32", "ef", False, False), ("adam", "bf16", "none", True, True),
                       ("muon", "bf16", "ef", False, False), ("muon", "bf16", "ef", True, False),
                       ("adam", "fp32", "dc", True, False), ("muon", "bf16", "none", False, False),
                       ("muon", "bf16", "ef", False, True), ("adam", "fp32", "dc", False, True),
                       ("adam", "bf16", "ef", True, False), ("adam", "bf16", "predict", True, False),
                       ("muon", "bf16", "predict", True, False), ("muon", "bf16", "ef", True, True)}


def test_flags_carry_no_clipping_and_the_in_place_step():
    # A plan made for --clip-grad 0 and the step in place launches that way; the defaults
    # (clipping 1.0, deferred step) write no flag.
    model = ModelSpec("gpt", num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                      vocab_size=128)
    layout = Layout(t=1, d=2, w=1, b=2, m=4, recompute=False, schedule="2bw")
    default = launch_flags(layout, model, "bf16")
    assert "--clip-grad" not in default and "--no-deferred-step" not in default
    flags = launch_flags(layout, model, "bf16", clip_grad=False, deferred_step=False)
    args = parse_for_validation(flags + ["--mock-data", "--train-iters", "1"], model,
                                world_size=2)
    assert args.clip_grad == 0 and args.no_deferred_step
    flush = launch_flags(dataclasses.replace(layout, schedule="flush"), model, "bf16",
                         deferred_step=False)
    assert "--no-deferred-step" not in flush  # only 2bw defers


def test_flags_of_interleaved_layouts_give_their_virtual_stages():
    """A layout with v model chunks per stage launches with that many virtual stages, and
    the training's validator accepts it (interleaved 1F1B: L a multiple of d v, m of d)."""
    model = ModelSpec("gpt", num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32,
                      vocab_size=128)
    layout = Layout(t=1, d=2, w=1, b=2, m=4, recompute=False, schedule="megatron", v=2)
    flags = launch_flags(layout, model, "bf16") + ["--mock-data", "--train-iters", "1"]
    args = parse_for_validation(flags, model, world_size=2)
    assert args.virtual_pipeline_model_parallel_size == 2
    single = launch_flags(dataclasses.replace(layout, v=1), model, "bf16")
    assert "--num-virtual-stages-per-pipeline-rank" not in single


@pytest.mark.parametrize("schedule,d,m,v", [
    ("flush", 2, 4, 2), ("2bw", 2, 2, 2), ("2bw", 4, 4, 2), ("2bw", 4, 8, 2), ("2bw", 2, 2, 4),
    ("gpipe", 2, 4, 2), ("pipedream", 2, 4, 2)])
def test_interleaved_layouts_the_planner_allows_are_those_the_training_runs(schedule, d, m, v):
    """Layout.problem and the training's validator agree on v > 1 for every schedule: flush
    and 2bw interleave (2bw while its first stage's warm-up, 2(d - 1) + (v - 1) d forwards,
    fits in one batch of m v: d=4 v=2 needs 10, so m = 4 is refused and m = 8 runs), the
    others do not."""
    layers = 8 if d * v <= 8 else 16
    model = ModelSpec("gpt", num_layers=layers, hidden_size=64, num_attention_heads=4,
                      seq_length=32, vocab_size=128)
    layout = Layout(t=1, d=d, w=1, b=1, m=m, recompute=False, schedule=schedule, v=v)
    flags = launch_flags(layout, model, "fp32") + ["--mock-data", "--train-iters", "1"]
    try:
        parse_for_validation(flags, model, world_size=d)
        runs = True
    except FlagError:
        runs = False
    look_ahead_fits = m * v >= 2 * (d - 1) + (v - 1) * d
    assert runs == (schedule == "flush" or (schedule == "2bw" and look_ahead_fits))
    assert (layout.problem(layers) is None) == runs, layout.problem(layers)


def test_interleaved_flush_and_2bw_are_timed_by_their_bubbles():
    """For equal stages of work F + B: interleaved flush (d - 1)/v of F + B over m (F + B),
    megatron's interleaved 1F1B the same; 2BW-interleaved has no bubble, as 2bw (m (F + B)
    with its chunks' sends); stage 0
    stashes (2(d - 1) + (v - 1) d + 1)/v microbatches under all three."""
    model = ModelSpec("gpt", num_layers=8, hidden_size=256, num_attention_heads=4,
                      seq_length=128, vocab_size=1024, untie_embeddings=True)
    cost = CostModel(model, preset("dgx-a100"), "fp32", clip_grad=False)
    d, m, v = 4, 8, 2
    one = cost.time(Layout(1, d, 1, 1, m, False, "2bw"))
    work = one.forward[1] + one.backward[1]  # a middle stage: layers only
    flush = cost.time(Layout(1, d, 1, 1, m, False, "flush", v=v))
    megatron = cost.time(Layout(1, d, 1, 1, m, False, "megatron", v=v))
    twobw = cost.time(Layout(1, d, 1, 1, m, False, "2bw", v=v))
    assert flush.iteration == pytest.approx(megatron.iteration)
    assert twobw.iteration == pytest.approx(
        m * max(f + b for f, b in zip(twobw.forward, twobw.backward)) + twobw.step)
    assert twobw.iteration > one.iteration  # each chunk boundary adds a send
    bubble = flush.iteration - flush.step - 2 * (d - 1) * flush.p2p - m * max(
        f + b for f, b in zip(flush.forward, flush.backward))
    stage_work = [f + b for f, b in zip(flush.forward, flush.backward)]
    assert bubble == pytest.approx((sum(stage_work) - max(stage_work)) / v)
    assert bubble < (d - 1) * work
    plain = cost.memory(Layout(1, d, 1, 1, m, False, "flush")).stages[0].activations  # d
    for schedule in ("flush", "2bw", "megatron"):
        stash = cost.memory(Layout(1, d, 1, 1, m, False, schedule, v=v)).stages[0].activations
        assert stash / plain == pytest.approx((2 * (d - 1) + (v - 1) * d + 1) / (v * d))


def _fake_bin(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _entry_args(recorded: str) -> list[str]:
    words = shlex.split(recorded)
    return words[next(i for i, w in enumerate(words) if w.endswith("_2bw.py")) + 1:]


@pytest.mark.parametrize("script", ["torchrun", "sbatch"])
def test_scripts_run_to_a_command_our_validator_accepts(tmp_path, script):
    plan, model = _plan_small_cluster()
    paths = write_plan(plan, tmp_path / "plan")
    bin_dir, elsewhere = tmp_path / "bin", tmp_path / "elsewhere"
    bin_dir.mkdir()
    elsewhere.mkdir()
    record, srun_record = tmp_path / "command.txt", tmp_path / "srun.txt"
    rendezvous = tmp_path / "rendezvous.txt"
    # Python, srun and scontrol stand-ins: record what would have been launched and the
    # rendezvous it was given; srun drops its own 5 words and runs the rest; the first node's
    # address is not its name (Slurm's NodeAddr).
    _fake_bin(bin_dir, "python", f'printf "%q " python "$@" > {record}\n'
                                 f'echo "$MASTER_ADDR:$MASTER_PORT" > {rendezvous}')
    _fake_bin(bin_dir, "srun", f'printf "%q " srun "$@" > {srun_record}\nshift 5\nexec "$@"')
    _fake_bin(bin_dir, "scontrol", 'if [[ $2 == node ]]; then\n'
                                   '    echo "NodeName=$3 Arch=x86_64 NodeAddr=127.0.0.1 Port=0"\n'
                                   'else printf "node-a\\nnode-b\\n"; fi')
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_text("dummy")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
               PYTHON=str(bin_dir / "python"), DATA_PATH=str(tmp_path / "d"),
               TOKENIZER_MODEL=str(tokenizer), SLURM_NNODES="2", SLURM_JOB_ID="7",
               SLURM_JOB_NODELIST="node-[a-b]")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    path = paths["torchrun"] if script == "torchrun" else paths["sbatch"]
    # Run from a folder that is neither the plan's nor the repository.
    subprocess.run(["bash", str(path), "--train-iters", "10"], env=env, check=True,
                   cwd=elsewhere)
    command = shlex.split(record.read_text())
    assert command[:3] == ["python", "-m", "torch.distributed.run"]
    entry = next(w for w in command if w.endswith("_2bw.py"))
    assert entry == str(REPO / "pretrain_gpt_2bw.py")
    if script == "sbatch":
        text = path.read_text()
        assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=1" in text
        assert "#SBATCH --gpus-per-node=8" in text
        # The allocation's first node's address, a port from the job id (20000 + 7), exported.
        assert rendezvous.read_text() == "127.0.0.1:20007\n"
        line = shlex.join(command)
        assert "--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:20007" in line
        assert "--nnodes 2 --nproc-per-node 8" in line
        assert shlex.split(srun_record.read_text())[:6] == [
            "srun", "--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    else:
        line = shlex.join(command)
        assert "--nnodes 2 --node-rank 0 --nproc-per-node 8" in line
        assert "--master-addr 127.0.0.1 --master-port 29500" in line
    args = parse_for_validation(_entry_args(shlex.join(command)), model, world_size=16)
    assert args.train_iters == 10 and args.data_path == [str(tmp_path / "d")]
    assert args.tensor_model_parallel_size == plan.best.layout.t
    # A wrong checkout, no data, no training length (none was planned): one line each.
    no_data = {k: v for k, v in env.items() if k != "DATA_PATH"}
    for changed, args, error in [
            (dict(env, REPO=str(elsewhere)), ["--train-iters", "1"],
             f"error: REPO: {elsewhere} has no pretrain_gpt_2bw.py; set REPO to the megatron-2bw "
             "checkout"),
            (no_data, ["--train-iters", "1"], "error: DATA_PATH: set DATA_PATH and "
             "TOKENIZER_MODEL, or DATA_ARGS (e.g. DATA_ARGS='--mock-data --vocab-size N')"),
            (env, ["--lr", "1e-3"], "error: --train-iters: the plan has no training length; "
             "add --train-iters N or --train-samples N")]:
        done = subprocess.run(["bash", str(path), *args], env=changed, cwd=elsewhere,
                              capture_output=True, text=True)
        assert (done.returncode, done.stderr.strip().splitlines()) == (2, [error])


def test_bert_flags_validate_with_the_bert_parser(tmp_path):
    model = ModelSpec("bert", num_layers=24, hidden_size=1024, num_attention_heads=16,
                      seq_length=512, vocab_size=30592)
    plan = search(PlanRequest(model, preset("dgx-a100", nodes=1), global_batch_size=256))
    paths = write_plan(plan, tmp_path)
    assert "pretrain_bert_2bw.py" in paths["torchrun"].read_text()
    flags = shlex.split(paths["flags"].read_text()) + ["--mock-data", "--train-iters", "1"]
    args = parse_for_validation(flags, model, world_size=plan.best.layout.world)
    assert args.num_microbatches == plan.best.layout.m


TINY_PLAN = ["--cluster", "cpu-local", "--gpus-per-node", "1", "--no-profile", "--no-scripts",
             "--global-batch-size", "4", "--micro-batch-sizes", "2", "--num-layers", "2",
             "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
             "--vocab-size", "128"]


def test_training_flags_pass_through_to_the_written_flags(tmp_path):
    cli = _plan_cli()
    training = ["--train-samples", "400", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style",
                "linear", "--lr-warmup-samples", "40", "--lr-decay-samples", "360"]
    assert cli.main([*TINY_PLAN, *training, "--out", str(tmp_path)]) == 0
    flags = shlex.split((tmp_path / "flags.txt").read_text())
    args = parse_for_validation(flags + ["--mock-data"], TINY_MODEL, world_size=1)
    assert (args.train_samples, args.lr, args.min_lr, args.lr_decay_style) == (
        400, 3e-4, 3e-5, "linear")
    assert (args.lr_warmup_samples, args.lr_decay_samples, args.train_iters) == (40, 360, 100)
    assert flags.count("--lr") == 1  # no default learning rate beside the given one
    script = (tmp_path / "launch.sh").read_text()
    assert all(f"{flag} {flags[flags.index(flag) + 1]}" in script for flag in training[::2])
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["request"]["training_flags"] == flags[flags.index("--train-samples"):]
    assert plan["choice"]["flags"] == flags


@pytest.mark.parametrize("training, flag, fragment", [
    (["--train-iters", "10", "--train-samples", "40"], "--train-samples", "exclusive"),
    (["--train-samples", "40", "--lr-warmup-iters", "2"], "--lr-warmup-iters", "not with"),
    (["--train-iters", "10", "--min-lr", "1"], "--min-lr", "must lie in"),
    (["--train-samples", "3"], "--train-samples", "one batch of 4"),
    (["--train-iters", "0"], "--train-iters", ">= 1"),
    (["--lr-decay-style", "cubic"], "--lr-decay-style", "cubic"),
])
def test_bad_training_flags_end_in_one_line(tmp_path, capsys, training, flag, fragment):
    cli = _plan_cli()
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*TINY_PLAN, *training, "--out", str(tmp_path)])
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(error.splitlines()) == 1
    assert error.startswith(f"error: {flag}: ") and fragment in error, error
    assert not (tmp_path / "plan.json").exists()  # refused before planning


def test_written_launch_script_trains_from_another_folder(tmp_path):
    """plan.py's --train-iters and --lr reach a real run of launch.sh, started from a folder
    that is neither the plan's nor the repository, without PYTHONPATH."""
    cli = _plan_cli()
    out, elsewhere = tmp_path / "plan", tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert cli.main([*TINY_PLAN, "--train-iters", "2", "--lr", "1e-3", "--out", str(out)]) == 0
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", DATA_ARGS="--mock-data --vocab-size 128",
               MASTER_PORT=str(free_port()))
    done = subprocess.run(["bash", str(out / "launch.sh"), "--log-interval", "1",
                           "--eval-iters", "0"], cwd=elsewhere, env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    log = parse_log(done.stdout + done.stderr)
    assert [(r.iteration, r.train_iters) for r in log.iterations] == [(1, 2), (2, 2)]
    assert 0 < log.iterations[0].learning_rate <= 1e-3


# ---- profiles -----------------------------------------------------------------------------


def _profile(**overrides) -> Profile:
    samples = [Sample("layer", 1, 2, False, 0.010, 0.020, 1e6),
               Sample("layer", 1, 2, True, 0.010, 0.030, 1e5),
               Sample("embedding", 1, 2, False, 0.001, 0.001, 1e3),
               Sample("head", 1, 2, False, 0.004, 0.008, 2e5)]
    fields = dict(device="cpu", device_name="cpu test", precision="fp32", model=SMALL,
                  samples=samples, optimizer_fixed_s=0.002, optimizer_per_param_s=1e-8,
                  runtime_overhead_bytes=100.0)
    fields.update(overrides)
    return Profile(**fields)


def test_profile_round_trip_and_lookup(tmp_path):
    profile = _profile(intra_node_link=Link(2e9, 50e-6))
    loaded = Profile.load(profile.save(tmp_path / "p.json"))
    assert loaded == profile
    # Nearest measured microbatch (2), scaled to 4; tp = 2 not measured: the tp = 1 sample.
    sample = loaded.lookup("layer", 2, 4, False)
    assert (sample.tp, sample.forward_s, sample.activation_bytes) == (1, 0.020, 2e6)


def test_cost_model_uses_profile_times_by_hand():
    profile = _profile(intra_node_link=Link(1e9, 0.0))
    cluster = preset("cpu-local", gpus_per_node=2)
    cost = CostModel(SMALL, cluster, "fp32", profile=profile, clip_grad=False)
    estimate = cost.time(Layout(t=1, d=2, w=1, b=2, m=4, recompute=False, schedule="flush"))
    send = 32 * 2 * 64 * 4 / 1e9  # one fp32 (s, b, h) activation over 1 GB/s
    # Stage 0: 2 layers + embedding + send; stage 1: 2 layers + head (+ send of gradient).
    assert estimate.forward == pytest.approx((2 * 0.010 + 0.001 + send, 2 * 0.010 + 0.004))
    assert estimate.backward == pytest.approx((2 * 0.020 + 0.001, 2 * 0.020 + 0.008 + send))
    # Tied embedding gradient between the two stages, then the optimizer of the larger stage.
    embedding_sync = 2 * 1 / 2 * 128 * 64 * 4 / 1e9
    optimizer = 0.002 + 1e-8 * 110_208
    assert estimate.step == pytest.approx(embedding_sync + optimizer)
    work = max(f + b for f, b in zip(estimate.forward, estimate.backward))
    total = sum(f + b for f, b in zip(estimate.forward, estimate.backward))
    assert estimate.iteration == pytest.approx(3 * work + total + estimate.step)
    # tp = 2 from the tp = 1 sample: half a layer's FLOPs per rank; the head's V = 128 pads to
    # 256 for t = 2, so a rank's logits are as wide as the unsplit ones. All-reduces over the
    # measured 1 GB/s: 4 layers x 2 + 1 (embedding) of sbh x 4 bytes, 3 of the loss's b s x 4.
    half = cost.time(Layout(t=2, d=1, w=1, b=2, m=4, recompute=False, schedule="megatron"))
    activation, loss = 32 * 2 * 64 * 4 / 1e9, 2 * 32 * 4 / 1e9  # ring of 2: 2(n-1)/n = 1
    assert half.forward[0] == pytest.approx(
        4 * 0.010 / 2 + 0.001 + 0.004 + 9 * activation + 3 * loss)
    memory = cost.memory(Layout(t=1, d=1, w=1, b=2, m=4, recompute=True, schedule="megatron"))
    assert memory.stages[0].activations == pytest.approx(4 * 1e5 + 1e3 + 2e5)
    assert memory.stages[0].overhead == 100.0


def test_muons_step_from_the_profiles_newton_schulz_by_hand():
    """A stage's Muon step: the Adam-like part per parameter, plus its layers' Newton-Schulz
    time measured on the profile's model, scaled by FLOPs to the planned blocks (per m x n
    block with m <= n: 5 x (4 m^2 n + 2 m^3)) and by the calibration."""
    profile = _profile(orthogonalize_layer_s=0.005, compute_scale=1.5)
    cost = CostModel(SMALL, preset("cpu-local", gpus_per_node=2), "fp32", profile=profile,
                     clip_grad=False, optimizer="muon")
    h, f = SMALL.hidden_size, 4 * SMALL.hidden_size

    def ns(blocks):
        return sum(5 * (4 * min(r, c) ** 2 * max(r, c) + 2 * min(r, c) ** 3) for r, c in blocks)

    whole = [(h, h), (h, h), (h, h), (h, h), (f, h), (h, f)]  # Q, K, V, projection, FC1, FC2
    halves = [(h // 2, h), (h // 2, h), (h // 2, h), (h, h // 2), (f // 2, h), (h, f // 2)]
    adam_like = 1.5 * (0.002 + 1e-8 * 110_208)
    estimate = cost.time(Layout(t=1, d=2, w=1, b=2, m=4, recompute=False, schedule="2bw"))
    assert estimate.optimizer == pytest.approx(adam_like + 2 * 0.005 * 1.5)
    # t = 2, one stage of 4 layers: Muon's step over Adam's (the profile times both alike
    # per parameter) is the Newton-Schulz of each rank's halves
    split = Layout(t=2, d=1, w=1, b=2, m=4, recompute=False, schedule="megatron")
    adam = dataclasses.replace(cost, optimizer="adam")
    assert cost.time(split).optimizer - adam.time(split).optimizer == pytest.approx(
        4 * 0.005 * 1.5 * ns(halves) / ns(whole))


@pytest.mark.parametrize("devices", [1, 2])
def test_calibration_scales_compute_by_a_whole_iteration(monkeypatch, devices):
    from megatron_2bw.planner import accuracy

    # One device, b = 2, m = 4, SMALL (tied embeddings): per microbatch 4 layers x (10 + 20 ms)
    # + embedding 1 + 1 ms + head 4 + 8 ms; the step is the optimizer on all 210,304 parameters
    # (4 x (12 h^2 + 13 h) + V h + s h + 2 h for the final LayerNorm; no all-reduce on 1 rank).
    # With 2 devices the same one-device run trains twice at once (independent copies, one
    # per core): nothing is communicated, so the scale is measured / parts either way.
    parts = 4 * (4 * 0.030 + 0.002 + 0.012) + 0.002 + 1e-8 * 210_304
    measured = 1.5 * parts
    # Memory: fp32 weights 4 + gradients 4 + Adam's two moments 8 bytes per parameter, and
    # the activations of the one microbatch in flight: 4 layers x 1e6 + embedding 1e3 + head
    # 2e5 (no recomputation), and the head's logits gradient (b s V x 4 bytes) in transit.
    tensors = 16 * 210_304 + 4 * 1e6 + 1e3 + 2e5 + 2 * 32 * 128 * 4
    peak_bytes = tensors + 50e6

    def fake_run(model, layouts, precision, copies=1, **kwargs):
        (layout,) = layouts
        assert (layout.t, layout.d, layout.w, layout.b, layout.m) == (1, 1, 1, 2, 4)
        assert copies == devices
        run = E2ERun(Layout(1, 1, 1, 2, 4, False, "megatron"), precision, measured, peak_bytes)
        return E2EProfile(model, "cpu test", [run])

    monkeypatch.setattr(accuracy, "run_end_to_end", fake_run)
    profile = accuracy.calibrate(_profile(intra_node_link=Link(1e9, 0.0)), micro_batch=2,
                                  devices=devices)
    assert profile.compute_scale == pytest.approx(1.5)
    assert profile.calibration["predicted_s"] == pytest.approx(parts)
    assert profile.runtime_overhead_bytes == pytest.approx(50e6)
    cost = CostModel(SMALL, preset("cpu-local", gpus_per_node=2), "fp32", profile=profile,
                     clip_grad=False)
    estimate = cost.time(Layout(t=1, d=2, w=1, b=2, m=4, recompute=False, schedule="flush"))
    send = 32 * 2 * 64 * 4 / 1e9  # communication is not scaled
    assert estimate.forward == pytest.approx((1.5 * (2 * 0.010 + 0.001) + send,
                                              1.5 * (2 * 0.010 + 0.004)))
    assert estimate.optimizer == pytest.approx(1.5 * (0.002 + 1e-8 * 110_208))


def test_accuracy_table_shows_the_relative_error():
    cost = CostModel(SMALL, preset("cpu-local", gpus_per_node=2), "fp32", profile=_profile())
    layout = Layout(1, 2, 1, 2, 4, False, "2bw")
    predicted = cost.time(layout, simulate=True).iteration
    run = E2ERun(layout, "fp32", seconds_per_iteration=predicted / 1.25, peak_memory_bytes=2**30)
    rows = compare(E2EProfile(SMALL, "cpu test", [run]), cost)
    assert rows[0].time_error == pytest.approx(0.25)
    assert "+25.0%" in format_accuracy(rows)


def test_shipped_cpu_profile_predicts_the_shipped_runs():
    """The CPU layer profile, measured apart from the runs, predicts each of the seven layouts
    trained end to end on the same machine within 20% (mean within 10%): the measured
    seconds per iteration are the reference, the prediction comes from the layer timings,
    the in-situ link and the calibration only."""
    folder = Path(__file__).resolve().parents[1] / "tools" / "profiles"
    profile = Profile.load(folder / "cpu-amd-epyc.json")
    measured = E2EProfile.load(folder / "cpu-amd-epyc.e2e.json")
    cost = CostModel(measured.model, preset("cpu-local", gpus_per_node=2), "fp32",
                     profile=profile)
    errors = [abs(row.time_error) for row in compare(measured, cost, simulate=False)]
    assert len(errors) == 7
    assert max(errors) <= 0.20 and sum(errors) / len(errors) <= 0.10, errors


def test_checked_in_profiles_hold_no_absolute_path():
    def strings(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for item in value.values():
                yield from strings(item)
        elif isinstance(value, list):
            for item in value:
                yield from strings(item)

    files = sorted((REPO / "tools" / "profiles").glob("*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        assert not [s for s in strings(data) if os.path.isabs(s)], path
        kind = E2EProfile if data["format"] == E2EProfile.FORMAT else Profile
        loaded = kind.load(path)
        for run in getattr(loaded, "runs", []):  # the entry script, found again
            assert Path(next(w for w in run.command if w.endswith(".py"))).is_file()
        if kind is E2EProfile:  # each run's layout flat in its object, written back the same
            assert loaded.to_json(path.parent.absolute()) == data


def _broken(document: dict, where: str, value) -> dict:
    """`document` with the field at dotted `where` ("runs.0.t") set to `value`."""
    document = json.loads(json.dumps(document))
    *path, last = where.split(".")
    node = document
    for key in path:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return document


_LAYER = _profile().to_json()
_RUNS = E2EProfile(SMALL, "cpu test", [E2ERun(Layout(1, 2, 1, 2, 4, False, "2bw"), "fp32",
                                              0.5, 2**30)]).to_json()


@pytest.mark.parametrize("flag, document, fragment", [
    ("--profile", _broken(_LAYER, "samples.0.tp", 0), "samples[0].tp: expected an integer >= 1"),
    ("--profile", _broken(_LAYER, "samples.1.part", "brain"), "samples[1].part"),
    ("--profile", _broken(_LAYER, "samples.0.forward_s", -1.0), "samples[0].forward_s"),
    ("--profile", _broken(_LAYER, "samples.0.backward_s", float("nan")), "samples[0].backward_s"),
    ("--profile", _broken(_LAYER, "model.num_layers", None), "model.num_layers"),
    ("--profile", _broken(_LAYER, "precision", "fp8"), "precision"),
    ("--profile", _broken(_LAYER, "samples", {}), "samples: expected a list"),
    ("--profile", _broken(_LAYER, "speed", 3), "wrong fields"),
    ("--profile", _RUNS, "not a 'megatron-2bw layer profile v1'"),
    ("--measured", _broken(_RUNS, "runs.0.t", "2"), "runs[0].t: expected an integer >= 1"),
    ("--measured", _broken(_RUNS, "runs.0.seconds_per_iteration", float("inf")),
     "runs[0].seconds_per_iteration"),
    ("--measured", _broken(_RUNS, "runs", {"t": 1}), "runs: expected a list"),
    ("--measured", _broken(_RUNS, "model", [4]), "model: expected an object"),
])
def test_bad_profile_files_end_in_one_line(tmp_path, capsys, flag, document, fragment):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(document))
    files = {"--profile": tmp_path / "layer.json", "--measured": tmp_path / "runs.json"}
    files["--profile"].write_text(json.dumps(_LAYER))
    files["--measured"].write_text(json.dumps(_RUNS))
    files[flag] = bad
    with pytest.raises(SystemExit) as exit_info:
        _plan_cli().main(["report", "--measured", str(files["--measured"]), "--profile",
                          str(files["--profile"])])
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(error.splitlines()) == 1, error
    assert error.startswith(f"error: {flag}: {bad}") and fragment in error, error


_PROFILE_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                  "--seq-length", "32", "--vocab-size", "128"]
_E2E = ["--end-to-end", "--global-batch-size", "8"]


@pytest.mark.parametrize("argv, flag, fragment", [
    (["--layouts", "t1d2w1b4:2bw"], "--layouts", "only with --end-to-end"),
    (["--train-iters", "5"], "--train-iters", "only with --end-to-end"),
    (["--tensor-parallel-sizes", "1,3"], "--tensor-parallel-sizes", "3 does not divide"),
    ([*_E2E, "--repeats", "3"], "--repeats", "layer-profile flag"),
    ([*_E2E, "--layouts", "t1d2w1b4:2bw", "--nproc", "1"], "--layouts", "needs 2 processes"),
    ([*_E2E, "--layouts", "t1d2w1b4:2bw,"], "--layouts", "layout ''"),
    ([*_E2E, "--layouts", "t1d2w1b3:2bw"], "--layouts", "not a multiple"),
    ([*_E2E, "--layouts", "t1d4w1b2:2bw", "--nproc", "4"], "--layouts", "--num-layers"),
    ([*_E2E, "--train-iters", "2"], "--train-iters", "log no line at --log-interval 3"),
])
def test_bad_profile_flags_end_in_one_line_before_anything_runs(monkeypatch, tmp_path, capsys,
                                                                 argv, flag, fragment):
    from megatron_2bw.planner import e2e as end_to_end
    from megatron_2bw.planner import measure

    def refuse(*args, **kwargs):
        raise AssertionError("ran despite the bad flag")

    monkeypatch.setattr(end_to_end, "run_end_to_end", refuse)
    monkeypatch.setattr(measure, "measure", refuse)
    with pytest.raises(SystemExit) as exit_info:
        _plan_cli().main(["profile", *_PROFILE_MODEL, "--cpu", *argv,
                          "--out", str(tmp_path / "p.json")])
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(error.splitlines()) == 1, error
    assert error.startswith(f"error: {flag}: ") and fragment in error, error


# ---- the command line on GPT-3 175B -------------------------------------------------------


def test_gpt3_175b_on_1024_h100s_plans_fast(tmp_path, capsys):
    cli = _plan_cli()
    started = time.perf_counter()
    code = cli.main(["--cluster", "dgx-h100", "--nodes", "128", "--global-batch-size", "1536",
                     "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads",
                     "96", "--seq-length", "2048", "--closed-form", "--out", str(tmp_path)])
    elapsed = time.perf_counter() - started
    out = capsys.readouterr().out
    assert code == 0 and elapsed < 5
    assert "on 1024 devices" in out and "samples/s" in out
    assert "#SBATCH --nodes=128" in out and "-m torch.distributed.run --nnodes" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    choice = plan["choice"]["layout"]
    assert choice["t"] * choice["d"] * choice["w"] == 1024
    assert choice["t"] <= 8 and 96 % choice["d"] == 0
    assert plan["choice"]["peak_memory_bytes"] <= 0.9 * 80 * GiB


def test_cli_explain_and_layout_syntax(tmp_path, capsys):
    cli = _plan_cli()
    code = cli.main(["--cluster", "cpu-local", "--gpus-per-node", "2", "--no-profile",
                     "--global-batch-size", "16", "--num-layers", "4", "--hidden-size", "128",
                     "--num-attention-heads", "4", "--seq-length", "128", "--vocab-size",
                     "1024", "--explain", "--no-scripts", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "rejected:" in out and "--cpu" in (tmp_path / "flags.txt").read_text()
    assert cli.parse_layout("t1d2w1b4:2bw", 16) == Layout(1, 2, 1, 4, 4, False, "2bw")
    assert cli.parse_layout("t2d1w1b4:megatron+rc", 16).recompute
    with pytest.raises(Exception):
        cli.parse_layout("t1d2w1b3:2bw", 16)


def test_report_refuses_a_layer_profile_as_measured_runs(tmp_path, capsys):
    cli = _plan_cli()
    layer = _profile().save(tmp_path / "layer.json")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", "--measured", str(layer), "--profile", str(layer)])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert error.startswith("error: --measured") and "layer profile" in error
    assert len(error.strip().splitlines()) == 1


def test_end_to_end_runs_validated_commands_and_reads_their_logs(monkeypatch, tmp_path):
    from megatron_2bw.planner import e2e as end_to_end

    launched, slower = [], iter([1.0, 1.0, 1.0, 1.2])  # the 4th launch: 20% slower

    class FakeLaunch:
        """A finished torchrun whose log is four intervals (ms, peak MiB)."""

        returncode = 0

        def __init__(self, command, stdout, **kwargs):
            launched.append(command)
            factor = next(slower)
            stdout.write("\n".join(
                f" iteration {i:>8}/      12 | elapsed time per iteration (ms): {ms * factor} | "
                f"lm loss: 6.0E+00 | peak memory (MiB): {mib}"
                for i, (ms, mib) in enumerate([(900, 400), (500, 410), (520, 420), (480, 415)])))

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(end_to_end.subprocess, "Popen", FakeLaunch)
    monkeypatch.setattr(end_to_end, "_mock_data_supported", lambda: True)
    layouts = [Layout(1, 2, 1, 4, 4, False, "2bw"), Layout(2, 1, 1, 4, 4, True, "megatron")]
    end_to_end.check_layouts(SMALL, layouts, "fp32")
    with pytest.raises(ValueError, match="layout t1 d3 .*--num-layers"):
        end_to_end.check_layouts(SMALL, [Layout(1, 3, 1, 4, 4, False, "2bw")], "fp32")
    e2e = end_to_end.run_end_to_end(SMALL, layouts, "fp32", scratch=tmp_path)
    run = e2e.runs[0]
    # The first interval holds the warm-up: median and fastest of 500, 520, 480.
    assert run.seconds_per_iteration == pytest.approx(0.5)
    assert run.fastest_s == pytest.approx(0.48) and run.peak_memory_bytes == 420 * 2**20
    for layout, command in zip(layouts, launched):
        assert command[command.index("--nproc-per-node") + 1] == str(layout.world)
        script = next(i for i, word in enumerate(command) if word.endswith("pretrain_gpt_2bw.py"))
        args = parse_for_validation(command[script + 1:], SMALL, world_size=layout.world)
        assert args.mock_data and args.cpu and args.num_microbatches == layout.m
        assert (args.recompute_granularity == "full") == layout.recompute
    # The file names the entry script relative to its own folder; loaded, absolute again.
    saved = e2e.save(tmp_path / "runs" / "e2e.json")
    stored = json.loads(saved.read_text())["runs"][0]["command"]
    entry = next(word for word in stored if word.endswith("pretrain_gpt_2bw.py"))
    assert not os.path.isabs(entry)
    assert (saved.parent / entry).resolve() == REPO / "pretrain_gpt_2bw.py"
    assert not any(os.path.isabs(word) for word in stored)
    loaded = E2EProfile.load(saved)
    assert loaded.runs == e2e.runs
    assert [run.layout for run in loaded.runs] == layouts
    # Two copies at once (the calibration's busy cores): two launches on two ports, the
    # slower copy's run kept.
    busy = end_to_end.run_end_to_end(SMALL, layouts[:1], "fp32", scratch=tmp_path, copies=2)
    ports = {command[command.index("--master-port") + 1] for command in launched[2:]}
    assert len(launched) == 4 and len(ports) == 2
    assert busy.runs[0].seconds_per_iteration == pytest.approx(0.6)
    # Fields at their defaults stay out of the file; the others come back.
    interleaved = [Layout(1, 2, 1, 4, 4, False, "megatron", v=2),
                   Layout(1, 2, 1, 4, 4, False, "flush", selective=True)]
    again = E2EProfile(SMALL, "cpu test", [E2ERun(layout, "fp32", 0.5, None)
                                           for layout in interleaved])
    assert not {"v", "selective"} & set(json.loads(saved.read_text())["runs"][0])
    assert [run.layout for run in E2EProfile.load(again.save(tmp_path / "v.json")).runs] == \
        interleaved

@pytest.mark.parametrize("schedule", ["2bw", "flush", "gpipe", "naive"])
def test_first_and_last_stage_bound_the_middle_ones(schedule):
    cost = CostModel(GPT_8B, preset("paper", nodes=8), "fp16")
    for recompute in (False, True):
        layout = Layout(t=2, d=8, w=4, b=2, m=8, recompute=recompute, schedule=schedule)
        every = cost.memory(layout)
        bounding = cost.memory(layout, every_stage=False)
        assert [s.stage for s in bounding.stages] == [0, 7]
        assert bounding.peak == every.peak


def test_selective_recomputation_replays_the_attention_core_and_sequence_parallel_flags():
    # Selective recomputation (Korthikanti et al. 2022, Section 5) adds to each layer's
    # backward the attention core's forward: QK^T and attention x V, 2 b a s^2 (h/a) / t FLOPs
    # each at the rate of their shape (smallest dimension h/a), and the softmax and dropout's
    # bytes over the a/t score matrices (each read and written in 2 bytes, plus the dropout
    # mask's 1: 2 x 2 + 2 x 2 + 1).
    model = ModelSpec("gpt", num_layers=8, hidden_size=1024, num_attention_heads=16,
                      seq_length=2048, vocab_size=50257)
    cluster = preset("dgx-a100", nodes=1)
    cost = CostModel(model, cluster, "bf16")
    plain = Layout(t=2, d=2, w=2, b=1, m=4, recompute=False, schedule="flush")
    selective = dataclasses.replace(plain, selective=True)
    s, h, a, t, b = 2048, 1024, 16, 2, 1
    bmm = 2 * b * a * s * s * (h // a) / t
    scores = a * s * s * b / t
    core = 2 * bmm / cluster.gemm_flops("bf16", h // a) + scores * 9 / cluster.stream_bandwidth
    layers = model.num_layers // plain.d
    added = cost.time(selective).backward[0] - cost.time(plain).backward[0]
    assert added == pytest.approx(layers * core, rel=1e-9)
    assert cost.time(selective).forward == cost.time(plain).forward

    flags = launch_flags(selective, model, "bf16", sequence_parallel=True)
    assert flags[flags.index("--recompute-granularity") + 1] == "selective"
    assert "--sequence-parallel" in flags
    assert "--sequence-parallel" not in launch_flags(dataclasses.replace(selective, t=1, w=4),
                                                     model, "bf16", sequence_parallel=True)
    args = parse_for_validation(launch_flags(selective, model, "bf16")
                                + ["--mock-data", "--train-iters", "1"], model, world_size=8)
    assert args.recompute_granularity == "selective"
    plan = search(PlanRequest(model, cluster, 16, micro_batch_sizes=(1,), simulate_top=0,
                              selective_recompute=True))
    chosen = [c.layout for c in plan.ranked if c.layout.selective]
    assert chosen and not any(L.recompute or L.schedule in ("zb-h1", "pipemare") for L in chosen)


def test_flash_attention_times_the_core_without_scores_and_recomputes_qk_in_the_backward():
    """Closed forms, one layer, b = 1, t = 1, bf16 on dgx-a100 (no profile): FlashAttention
    streams 4sbh e bytes for the core instead of the score matrices' as^2 b (2e + 2e + 1),
    and its backward adds QK^T (2 s^2 h FLOPs at the rate of its n = h/a)."""
    model = ModelSpec("gpt", num_layers=4, hidden_size=1024, num_attention_heads=16,
                      seq_length=4096, vocab_size=51200)
    cluster = preset("dgx-a100")
    plain = CostModel(model, cluster, "bf16")
    flash = CostModel(model, cluster, "bf16", flash_attention=True)
    s, h, a, e = 4096, 1024, 16, 2
    scores = a * s * s * (2 * e + 2 * e + 1)
    saved = (scores - 4 * s * h * e) / cluster.stream_bandwidth
    forward_plain = plain.kernel_time("layer", 1, 1)
    forward_flash = flash.kernel_time("layer", 1, 1, flash_attention=True)
    assert forward_plain - forward_flash == pytest.approx(saved)
    layout = Layout(1, 1, 8, 1, 4, False, "megatron")
    qk = 2 * s * s * h / cluster.gemm_flops("bf16", h // a)
    one, two = plain.time(layout), flash.time(layout)
    assert two.forward[0] < one.forward[0]
    assert (two.backward[0] - 2 * two.forward[0]) - (one.backward[0] - 2 * one.forward[0]) \
        == pytest.approx(model.num_layers * qk, rel=1e-9)
    assert flash.memory(layout).stages[0].activations < plain.memory(layout).stages[0].activations


def test_attention_backend_auto_is_flash_on_ampere_and_later_in_16_bit():
    assert preset("dgx-h100").attention_is_flash("auto", "bf16")
    assert not preset("dgx-h100").attention_is_flash("auto", "fp32")
    assert not preset("dgx-h100").attention_is_flash("unfused", "bf16")
    assert not preset("paper").attention_is_flash("auto", "fp16")
    with pytest.raises(ValueError, match="no FlashAttention"):
        preset("paper").attention_is_flash("flash", "fp16")


def test_iteration_factor_flips_2bw_to_flush_where_it_passes_their_throughput_ratio():
    """Stale schedules rank at samples/s / F: 2BW's best layout (throughput s2) stays ahead of
    flush's best (s1 < s2) exactly while F < s2 / s1."""
    cluster = preset("paper", nodes=8)
    base = PlanRequest(GPT_8B, cluster, 512, "fp16", schedules=("flush", "2bw"), simulate_top=0,
                       iteration_factor=1.0)
    plan = search(base)
    best = {s: max(c.samples_per_s for c in plan.ranked if c.layout.schedule == s)
            for s in ("flush", "2bw")}
    threshold = best["2bw"] / best["flush"]
    assert plan.best.layout.schedule == "2bw" and threshold > 1
    below = search(dataclasses.replace(base, iteration_factor=threshold * 0.99))
    above = search(dataclasses.replace(base, iteration_factor=threshold * 1.01))
    assert below.best.layout.schedule == "2bw"
    assert above.best.layout.schedule == "flush"
    assert above.best.samples_per_s == pytest.approx(best["flush"])
    with pytest.raises(ValueError, match="iteration factor"):
        dataclasses.replace(base, iteration_factor=0.0)


def _validation_points(path: Path) -> list[tuple[int, float]]:
    """(iteration, validation loss) from a training log, read with a regex of its own."""
    import re
    found = re.findall(r"validation loss at iteration\s+(\d+) \| lm loss value: (\S+)",
                       path.read_text())
    return [(int(i), float(v)) for i, v in found]


def _first_crossing(curve: list[tuple[int, float]], loss: float) -> float:
    """The iteration at which a validation curve first reaches ``loss`` (linear between
    validations)."""
    for (i0, l0), (i1, l1) in zip(curve, curve[1:]):
        if l1 <= loss:
            return i0 + (i1 - i0) * (l0 - loss) / (l0 - l1) if l0 > loss else i0
    raise AssertionError(f"the curve never reaches {loss}")


@pytest.mark.parametrize("factors, folder, key", [
    *[(ITERATION_FACTORS, "large-lr1e-3", k) for k in ITERATION_FACTORS if k[0] != "pipemare"],
    *[(BF16_ITERATION_FACTORS, "bf16/large-lr1e-3", k) for k in BF16_ITERATION_FACTORS]],
    ids=lambda x: "-".join(x) if isinstance(x, tuple) else x if isinstance(x, str) else None)
def test_iteration_factors_are_the_checked_in_study_runs(factors, folder, key):
    """Each factor is 1 / (flush's iterations to the run's final validation loss / the run's
    iterations), from docs/convergence/large-lr1e-3's logs (bf16/large-lr1e-3's for the bf16
    factors; flush with the same optimizer), to the table's two decimals."""
    schedule, optimizer, correction = key
    suffix = "" if optimizer == "adam" else f"+{optimizer}"
    run = schedule + ("" if correction == "none" else f"-{correction}") + suffix
    runs = REPO / "docs" / "convergence" / folder
    curve = _validation_points(runs / f"{run}.log")
    flush = _validation_points(runs / f"flush{suffix}.log")
    last_iteration, last_loss = curve[-1]
    ratio = _first_crossing(flush, last_loss) / last_iteration
    assert factors[key] == pytest.approx(1 / ratio, abs=0.006)


def test_the_planner_ranks_a_bf16_plan_with_the_bf16_factors():
    """A bf16 plan takes the bf16 study's factor where it has one, the fp32 one elsewhere."""
    from megatron_2bw.planner.search import iteration_factor

    assert iteration_factor("2bw", "muon", "ef", "bf16") == BF16_ITERATION_FACTORS[
        ("2bw", "muon", "ef")]
    assert iteration_factor("2bw", "muon", "ef") == ITERATION_FACTORS[("2bw", "muon", "ef")]
    assert iteration_factor("2bw", "adam", "dc", "bf16") == ITERATION_FACTORS[("2bw", "adam", "dc")]
