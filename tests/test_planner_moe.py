"""The planner's Mixture-of-Experts model: parameters, FLOPs, all-to-alls, memory and time of
expert-parallel layouts against numbers derived here and published ones, the search against the
training's own flag validation, and Megatron-LM MoE commands through `plan.py --evaluate`.

Published numbers: Mixtral 8x7B and 8x22B parameter counts (Mistral AI), and the TFLOPS and
layouts of Megatron-LM's MoE README and yanring/Megatron-MoE-ModelZoo; TFLOPS counted with
Megatron-LM's `num_floating_point_operations`, written out below.
Guards: the planner's MoE costs match published models and runs.
The sources, quoted: docs/testing.md, "What each test module checks", test_planner_moe.py.

Pure Python, no processes.
"""

from __future__ import annotations

import shlex

import pytest

from megatron_2bw.arguments import FlagError
from megatron_2bw.planner import (CostModel, GiB, Layout, ModelSpec, PlanRequest, preset,
                                  search, write_plan)
from megatron_2bw.planner.evaluate import evaluate, parse_evaluate
from megatron_2bw.planner.flags import launch_flags, parse_for_validation
from tests.test_planner import _plan_cli


MIXTRAL_8X7B = ModelSpec("gpt", num_layers=32, hidden_size=4096, num_attention_heads=32,
                         seq_length=4096, vocab_size=32000, ffn_hidden_size=14336,
                         num_query_groups=8, gated_linear_unit=True, untie_embeddings=True,
                         add_bias_linear=False, dropout=False, num_experts=8, moe_router_topk=2)
MIXTRAL_8X22B = ModelSpec("gpt", num_layers=56, hidden_size=6144, num_attention_heads=48,
                          seq_length=4096, vocab_size=32000, ffn_hidden_size=16384,
                          num_query_groups=8, gated_linear_unit=True, untie_embeddings=True,
                          add_bias_linear=False, dropout=False, num_experts=8,
                          moe_router_topk=2)
# A small MoE GPT for hand numbers: L=4, h=64, a=4, s=32, V=128, E=4, k=2, f_e=96.
SMALL_MOE = ModelSpec("gpt", num_layers=4, hidden_size=64, num_attention_heads=4,
                      seq_length=32, vocab_size=128, add_bias_linear=False, num_experts=4,
                      moe_router_topk=2, moe_ffn_hidden_size=96)


# ---- parameters ----------------------------------------------------------------------------


def _mixtral_parameters(L, h, a, g, f, V, s, E, experts_counted):
    """Mixtral's parameters written out: untied embedding and output (2 V h), the learned
    positions the planner's GPT keeps (s h; Mixtral itself uses RoPE: 0.04% of 8x7B), per layer
    Q (h h), K and V (2 g h/a h), the projection (h h), two LayerNorms (2 x 2h, the planner's
    LayerNorm; Mixtral's RMSNorm has h), the router (E h) and SwiGLU experts of 3 h f each; the
    final LayerNorm (2h). No biases."""
    attention = h * h + 2 * g * (h // a) * h + h * h
    layer = attention + 4 * h + E * h + experts_counted * 3 * h * f
    return 2 * V * h + s * h + L * layer + 2 * h


def test_mixtral_parameters_as_published():
    m = MIXTRAL_8X7B
    total = _mixtral_parameters(32, 4096, 32, 8, 14336, 32000, 4096, 8, experts_counted=8)
    active = _mixtral_parameters(32, 4096, 32, 8, 14336, 32000, 4096, 8, experts_counted=2)
    assert m.num_parameters() == total
    assert m.num_active_parameters() == active
    assert m.num_parameters() / 1e9 == pytest.approx(46.7, abs=0.05)
    assert m.num_active_parameters() / 1e9 == pytest.approx(12.9, abs=0.05)
    # Mixtral 8x22B: 141B total, 39B active (whole billions).
    assert MIXTRAL_8X22B.num_parameters() / 1e9 == pytest.approx(141, abs=0.5)
    assert MIXTRAL_8X22B.num_active_parameters() / 1e9 == pytest.approx(39, abs=0.5)


def test_one_expert_top_1_is_the_dense_layer_plus_a_router():
    # An MoE layer with one expert of the dense FFN size, each token through it: the dense
    # layer's parameters and GEMM FLOPs plus the router's h x 1 (2bsh FLOPs).
    dense = ModelSpec("gpt", 4, 64, 4, 32, 128, add_bias_linear=False)
    moe = ModelSpec("gpt", 4, 64, 4, 32, 128, add_bias_linear=False, num_experts=1,
                    moe_router_topk=1)
    assert sum(moe.moe_layer_parameters()) == dense.layer_parameters() + 64
    assert moe.moe_layer_forward_flops(2) == dense.layer_forward_flops(2) + 2 * 2 * 32 * 64
    assert moe.moe_layer_forward_flops(2, router=False) == dense.layer_forward_flops(2)
    for t in (1, 2):
        assert sum(f for f, _ in moe.moe_layer_gemms(2, t, 1)) == pytest.approx(
            moe.moe_layer_forward_flops(2) / t)


def test_experts_split_over_expert_ranks_and_the_optimizer_over_expert_data_ranks():
    # SMALL_MOE on 8 GPUs, t1 d2 w4 e2, distributed optimizer: a stage holds 2 MoE layers, each
    # with E/e = 2 experts of FC1 h x f_e and FC2 f_e x h (no biases, no gate); Adam's bf16
    # mixed precision keeps 4 (master) + 8 (moments) bytes per parameter, sharded over w = 4
    # for the rest and over the t w / e = 2 expert-data-parallel ranks for the experts.
    h, fe = 64, 96
    experts = 2 * (4 // 2) * (h * fe + fe * h)
    cost = CostModel(SMALL_MOE, preset("dgx-a100"), "bf16", distributed_optimizer=True)
    stage = cost.memory(Layout(1, 2, 4, 1, 4, False, "flush", e=2)).stages[1]
    assert stage.expert_parameters == experts
    assert stage.optimizer == pytest.approx((stage.parameters - experts) * 12 / 4
                                             + experts * 12 / 2)
    # e = 4: one expert each, the same layer's other parameters.
    wider = cost.memory(Layout(1, 2, 4, 1, 4, False, "flush", e=4)).stages[1]
    assert stage.parameters - wider.parameters == experts // 2



def test_sharded_muon_deals_out_whole_experts_over_the_expert_data_ranks():
    # The same layout under --optimizer dist_muon: whole parameters dealt out, so the fullest
    # rank keeps up to one largest tensor more than an even share of each: a dense layer's
    # FC1 (4h x h; the stage holds no embedding) and an expert's FC1 (f_e x h); bf16 Muon
    # keeps an fp32 master and a momentum, 8 bytes a parameter.
    h, fe = 64, 96
    experts = 2 * (4 // 2) * (h * fe + fe * h)
    cost = CostModel(SMALL_MOE, preset("dgx-a100"), "bf16", distributed_optimizer=True,
                     optimizer="muon")
    stage = cost.memory(Layout(1, 2, 4, 1, 4, False, "flush", e=2)).stages[1]
    assert stage.optimizer == pytest.approx(((stage.parameters - experts) / 4 + 4 * h * h
                                             + experts / 2 + fe * h) * 8)


# ---- FLOPs ---------------------------------------------------------------------------------


def test_flops_are_megatron_lms_count():
    # core_r0.9.0 num_floating_point_operations for Mixtral 8x7B, B = 256.
    B, s, L, h, a, g, f, k, V = 256, 4096, 32, 4096, 32, 8, 14336, 2, 32000
    megatron = 12 * B * s * L * h * h * ((1 + g / a + s / h) + f / h * k * 3 / 2
                                         + V / (2 * L * h))
    assert MIXTRAL_8X7B.model_flops_per_iteration(B) == pytest.approx(megatron, rel=1e-12)
    # What the time model multiplies: one rank's GEMMs, 1/t of the layer's FLOPs whatever e
    # (k token copies through whole experts, the tokens split over t by sequence parallelism).
    for t, e in ((1, 1), (1, 8), (2, 4)):
        gemms = MIXTRAL_8X7B.moe_layer_gemms(1, t, e)
        assert sum(f for f, _ in gemms) == pytest.approx(
            MIXTRAL_8X7B.moe_layer_forward_flops(1) / t, rel=1e-12)
    # core_v0.16.1 moe_layer_flops with a shared expert, f_e != f and --moe-layer-freq 2:
    # per MoE layer 4 B s h f_e k 3/2 + 4 B s h f_s 3/2, dense MLP 4 B s h f 3/2 (the
    # attention as core_r0.9.0 counts it, full s x s).
    m = ModelSpec("gpt", 4, 256, 4, 64, 1024, ffn_hidden_size=512, gated_linear_unit=True,
                  num_experts=8, moe_router_topk=3, moe_ffn_hidden_size=128,
                  moe_layer_freq=2, moe_shared_expert_intermediate_size=192)
    B, s, h, L = 2, 64, 256, 4
    attention = 4 * B * s * h * (h + h + s)
    dense = 4 * B * s * h * 512 * 3 / 2
    moe = 4 * B * s * h * 128 * 3 * 3 / 2 + 4 * B * s * h * 192 * 3 / 2
    logits = 2 * B * s * h * 1024
    expected = 3 * (L * attention + 2 * dense + 2 * moe + logits)
    assert m.moe_pattern == (1, 0, 1, 0)
    assert m.model_flops_per_iteration(B) == pytest.approx(expected, rel=1e-12)


# ---- all-to-all ----------------------------------------------------------------------------


def test_all_to_all_inside_a_node_and_across():
    cluster = preset("dgx-h100", nodes=4)
    n = 64 * 2**20
    # 8 ranks of one node: 7 steps of 5 us, 7/8 of the buffer over NVLink (450 GB/s).
    assert cluster.all_to_all(n, 8, 1) == pytest.approx(7 * 5e-6 + 7 / 8 * n / 450e9)
    # 16 ranks over two nodes: 7/16 of it to node mates over NVLink while 8/16 leaves over
    # the rank's own 400 Gb/s adapter (50 GB/s), every GPU of the node sending across.
    assert cluster.all_to_all(n, 16, 1) == pytest.approx(15 * 10e-6 + 8 / 16 * n / 50e9)
    # 4 ranks, 8 apart: one per node, 3/4 of the buffer across.
    assert cluster.all_to_all(n, 4, 8) == pytest.approx(3 * 10e-6 + 3 / 4 * n / 50e9)
    assert cluster.all_to_all(n, 1, 1) == 0.0


def test_dispatch_bytes_per_token():
    # Each token goes to k experts, h bf16 elements a copy: 2 x 4096 x 2 = 16 KiB for
    # Mixtral; a microbatch of one 4096-token sequence, 64 MiB per rank; sequence parallelism
    # at t = 2 gives a rank half the tokens.
    assert MIXTRAL_8X7B.dispatch_bytes(1, 1, 2) / 4096 == 2 * 4096 * 2
    assert MIXTRAL_8X7B.dispatch_bytes(1, 1, 2) == 64 * 2**20
    assert MIXTRAL_8X7B.dispatch_bytes(1, 2, 2) == 32 * 2**20


def test_each_moe_layer_pays_four_all_to_alls_six_with_recomputation():
    # Dispatch and combine in the forward, their gradients in the backward; recomputation
    # replays the forward's two. SMALL_MOE t1 d2 w4 e4 on one DGX A100: e = 4 consecutive
    # ranks on NVLink (300 GB/s one way, 5 us).
    cluster = preset("dgx-a100")
    cost = CostModel(SMALL_MOE, cluster, "bf16")
    a2a = 3 * 5e-6 + 3 / 4 * (2 * 32 * 64 * 2) / 300e9
    for rc, count in ((False, 4), (True, 6)):
        time = cost.time(Layout(1, 2, 4, 1, 4, rc, "flush", e=4))
        assert time.expert_parallel == pytest.approx((2 * count * a2a,) * 2)
    assert cost.time(Layout(1, 2, 4, 1, 4, False, "flush", e=1)).expert_parallel == (0.0, 0.0)
    assert CostModel(ModelSpec("gpt", 4, 64, 4, 32, 128), cluster, "bf16").time(
        Layout(1, 2, 4, 1, 4, False, "flush")).expert_parallel == ()


def test_expert_gradients_reduce_over_the_expert_data_parallel_ranks():
    # t1 d1 w8 e4 on one DGX H100, no clipping: the dense gradients' ring all-reduce over the
    # 8 replicas, the experts' (E/e = 1 expert per layer, 4 layers) over the t w / e = 2 ranks
    # 4 apart, both fp32 on NVLink.
    cost = CostModel(SMALL_MOE, preset("dgx-h100"), "bf16", clip_grad=False)
    layout = Layout(1, 1, 8, 1, 1, False, "megatron", e=4)
    stage = cost.memory(layout).stages[0]
    experts, dense = stage.expert_parameters, stage.parameters - stage.expert_parameters
    assert experts == 4 * 1 * 2 * 64 * 96
    expected = (2 * 7 * 5e-6 + 2 * 7 / 8 * dense * 4 / 450e9
                + 2 * 1 * 5e-6 + 2 * 1 / 2 * experts * 4 / 450e9)
    assert cost.time(layout).data_parallel == pytest.approx(expected)


# ---- Megatron-LM's published MoE throughput, through --evaluate's code path ----------------

MIXTRAL_8X7B_COMMAND = (
    "torchrun --nnodes 8 --nproc-per-node 8 pretrain_gpt.py "
    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 "
    "--num-layers-per-virtual-pipeline-stage 1 --expert-model-parallel-size 8 "
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --swiglu "
    "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 4096 "
    "--max-position-embeddings 4096 --vocab-size 32000 --hidden-dropout 0 "
    "--attention-dropout 0 --num-experts 8 --moe-router-topk 2 "
    "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --micro-batch-size 1 "
    "--global-batch-size 256 --bf16 --use-distributed-optimizer --use-flash-attn")
MIXTRAL_8X22B_COMMAND = (
    "torchrun --nnodes 16 --nproc-per-node 8 pretrain_gpt.py "
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 "
    "--expert-model-parallel-size 8 --expert-tensor-parallel-size 1 --sequence-parallel "
    "--num-layers 56 --hidden-size 6144 --ffn-hidden-size 16384 --num-attention-heads 48 "
    "--group-query-attention --num-query-groups 8 --swiglu "
    "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 4096 "
    "--max-position-embeddings 4096 --vocab-size 32000 --hidden-dropout 0 "
    "--attention-dropout 0 --num-experts 8 --moe-router-topk 2 "
    "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --micro-batch-size 1 "
    "--global-batch-size 256 --bf16 --use-distributed-optimizer --use-flash-attn")


@pytest.mark.parametrize("command,model,published", [
    (MIXTRAL_8X7B_COMMAND, MIXTRAL_8X7B, 438),
    (MIXTRAL_8X22B_COMMAND, MIXTRAL_8X22B, 455),
], ids=["mixtral-8x7b", "mixtral-8x22b"])
def test_published_mixtral_throughput_within_15_percent(command, model, published):
    forced = parse_evaluate(command, world=8)
    layout = forced.layout
    gpus = 64 if model is MIXTRAL_8X7B else 128
    assert layout.world == gpus and layout.b == 1 and layout.global_batch == 256
    if model is MIXTRAL_8X7B:
        assert (layout.t, layout.d, layout.v, layout.e) == (1, 4, 8, 8)
    else:
        assert (layout.t, layout.d, layout.v, layout.e) == (2, 8, 1, 8)
    for name in ("swiglu", "group_query_attention", "untie_embeddings_and_output_weights",
                 "disable_bias_linear", "no_dropout"):
        assert name in forced.model_switches
    cluster = preset("dgx-h100", nodes=gpus // 8)
    cost = CostModel(model, cluster, "bf16", distributed_optimizer=True,
                     flash_attention=cluster.attention_is_flash(forced.attention_backend,
                                                                "bf16"))
    result = evaluate(cost, layout)
    error = result.tflops_per_gpu / published - 1
    assert abs(error) <= 0.15, f"predicted {result.tflops_per_gpu:.1f} TFLOP/s per GPU, " \
                               f"published {published} ({error:+.1%})"
    assert result.memory.peak <= 80 * GiB  # the published runs fit on 80 GB H100s


def test_evaluate_prints_the_all_to_alls(capsys):
    code = _plan_cli().main(["--cluster", "dgx-h100", "--evaluate", MIXTRAL_8X7B_COMMAND,
                             "--closed-form", "--no-profile", "--expert-model-parallel-size",
                             "8", "--micro-batch-sizes", "1", "--recompute", "off"])
    out = capsys.readouterr().out
    assert code == 0 and "12.90B active: 8 experts, top-2" in out
    assert "evaluated: t1 d4 w16 b1 m16 megatron v8 e8" in out
    assert "expert-parallel all-to-alls" in out and "planner's choice:" in out


@pytest.mark.parametrize("extra,fragment", [
    (" --tensor-model-parallel-size 2", "--expert-tensor-parallel-size 1"),
    (" --moe-token-dispatcher-type allgather", "add --moe-token-dispatcher-type alltoall"),
    (" --expert-model-parallel-size 3", "8 experts do not split over e=3"),
])
def test_moe_commands_the_planner_cannot_price_are_one_line(capsys, extra, fragment):
    with pytest.raises(SystemExit) as exit_info:
        _plan_cli().main(["--cluster", "dgx-h100", "--evaluate", MIXTRAL_8X7B_COMMAND + extra,
                          "--closed-form", "--no-profile"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.startswith("error: ") and fragment in error
    assert len(error.strip().splitlines()) == 1


# ---- the search against the training's own validation --------------------------------------


def _validate(flags, model, world):
    return parse_for_validation(flags + ["--mock-data", "--train-iters", "1"], model, world)


def test_every_feasible_moe_layout_passes_the_trainings_validation():
    # A small MoE GPT on 8 GPUs: every feasible layout's written flags are accepted by the
    # training's validator (flags.parse_for_validation), with its expert-parallel size, and
    # every expert-parallel size the planner refuses for E % e is refused by it too. Held to
    # t = 1 (the training's sequence parallelism, which MoE needs at t > 1, is CUDA only).
    model = ModelSpec("gpt", 8, 64, 4, 32, 128, add_bias_linear=False, num_experts=4,
                      moe_router_topk=2, moe_layer_freq=2)
    plan = search(PlanRequest(model, preset("dgx-a100"), 16, max_tensor_parallel=1,
                              micro_batch_sizes=(1, 2), simulate_top=0))
    assert {c.layout.e for c in plan.ranked} == {1, 2, 4}
    for candidate in plan.ranked:
        layout = candidate.layout
        args = _validate(launch_flags(layout, model, "bf16"), model, layout.world)
        assert (args.expert_model_parallel_size, args.num_experts, args.moe_router_topk) == (
            layout.e, 4, 2)
        assert args.moe_layer_freq == 2 and args.moe_token_dispatcher_type == "alltoall"
    refused = [r for r in plan.rejected if "do not split over" in r.reason]
    assert {r.value("e") for r in refused} == {8}
    bad = Layout(1, 1, 8, 1, 2, False, "megatron", e=8)
    with pytest.raises(FlagError, match="expert-model-parallel-size"):
        _validate(launch_flags(bad, model, "bf16"), model, 8)
    # A stage without an MoE layer: 8 layers, one MoE layer in 4 (0 and 4), 4 stages.
    sparse = ModelSpec("gpt", 8, 64, 4, 32, 128, add_bias_linear=False, num_experts=4,
                       moe_layer_freq=4)
    plan = search(PlanRequest(sparse, preset("dgx-a100"), 16, max_tensor_parallel=1,
                              micro_batch_sizes=(1,), simulate_top=0))
    assert all(c.layout.d in (1, 2) for c in plan.ranked)
    no_moe = [r for r in plan.rejected if "holds no MoE layer" in r.reason]
    assert no_moe and all(r.layout.d in (4, 8) for r in no_moe)
    d4 = no_moe[0].layout
    with pytest.raises(FlagError, match="moe-layer-freq"):
        _validate(launch_flags(d4, sparse, "bf16"), sparse, d4.world)


def test_biases_need_expert_parallelism_and_tensor_parallelism_needs_cuda():
    # The training refuses experts with biases at e = 1 and sequence parallelism on the CPU.
    biased = ModelSpec("gpt", 4, 64, 4, 32, 128, num_experts=4)
    plan = search(PlanRequest(biased, preset("dgx-a100"), 16, simulate_top=0))
    assert plan.ranked and all(c.layout.e > 1 for c in plan.ranked)
    assert any("--disable-bias-linear" in r.reason for r in plan.rejected)
    one = Layout(1, 1, 8, 1, 2, False, "megatron", e=1)
    with pytest.raises(FlagError, match="disable-bias-linear"):
        _validate(launch_flags(one, biased, "bf16"), biased, 8)
    cpu = preset("cpu-local", gpus_per_node=4)
    plan = search(PlanRequest(SMALL_MOE, cpu, 8, "fp32", simulate_top=0))
    assert plan.ranked and all(c.layout.t == 1 for c in plan.ranked)
    # On GPUs t > 1 runs with sequence parallelism and experts whole on each rank.
    plan = search(PlanRequest(SMALL_MOE, preset("dgx-a100"), 16, simulate_top=0))
    wide = next(c for c in plan.ranked if c.layout.t > 1)
    flags = launch_flags(wide.layout, SMALL_MOE, "bf16")
    assert "--sequence-parallel" in flags
    assert flags[flags.index("--expert-tensor-parallel-size") + 1] == "1"


def test_plan_cli_searches_or_fixes_the_expert_parallel_size(tmp_path, capsys):
    base = ["--cluster", "dgx-a100", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "128",
            "--global-batch-size", "16", "--num-experts", "4", "--moe-ffn-hidden-size", "96",
            "--disable-bias-linear", "--no-scripts", "--closed-form", "--no-profile",
            "--top", "100"]
    assert _plan_cli().main(base + ["--out", str(tmp_path / "any")]) == 0
    searched = capsys.readouterr().out
    header = next(line.split() for line in searched.splitlines() if line.strip().startswith("#"))
    assert header[:5] == ["#", "t", "d", "w", "e"]
    rows = [line.split() for line in searched.splitlines() if line[:3].strip().isdigit()]
    assert {row[4] for row in rows} >= {"1", "2"}  # both searched
    assert _plan_cli().main(base + ["--out", str(tmp_path / "two"),
                                    "--expert-model-parallel-size", "2"]) == 0
    capsys.readouterr()
    flags = shlex.split((tmp_path / "two" / "flags.txt").read_text())
    assert flags[flags.index("--expert-model-parallel-size") + 1] == "2"
    assert flags[flags.index("--num-experts") + 1] == "4"
    assert flags[flags.index("--moe-ffn-hidden-size") + 1] == "96"
    assert "--disable-bias-linear" in flags
    rows = (tmp_path / "two" / "rejected.csv").read_text().splitlines()
    assert rows[0].split(",")[:8] == ["t", "d", "w", "b", "m", "recompute", "schedule", "e"]


@pytest.mark.parametrize("argv,fragment", [
    (["--moe-router-topk", "2"], "--moe-router-topk: only with --num-experts"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size: needs --num-experts"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "top-k 5"),
])
def test_bad_moe_plan_flags_are_one_line(capsys, argv, fragment):
    base = ["--cluster", "dgx-a100", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--global-batch-size", "16"]
    with pytest.raises(SystemExit) as exit_info:
        _plan_cli().main(base + argv)
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.startswith("error: ") and fragment in error
    assert len(error.strip().splitlines()) == 1


def test_profiles_are_taken_of_dense_layers(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _plan_cli().main(["profile", "--num-layers", "2", "--hidden-size", "32",
                          "--num-attention-heads", "4", "--seq-length", "32",
                          "--num-experts", "4"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.startswith("error: --num-experts: profiles")
    assert len(error.strip().splitlines()) == 1


def test_moe_plan_json_round_trips(tmp_path):
    plan = search(PlanRequest(SMALL_MOE, preset("dgx-a100"), 16, simulate_top=0))
    import json

    document = json.loads(write_plan(plan, tmp_path)["plan"].read_text())
    assert document["choice"]["layout"]["e"] == plan.best.layout.e
    assert ModelSpec(**document["request"]["model"]) == SMALL_MOE
