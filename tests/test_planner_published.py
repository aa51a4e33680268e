"""The planner's cost model against published results, every layout forced through the code
path of `tools/plan.py --evaluate` (planner.evaluate.parse_evaluate + evaluate).

References: Megatron-LM SC'21 (Narayanan et al., arXiv 2104.04473), Table 1, with the
microbatch size and interleaving from its launch script; PipeDream-2BW (Narayanan et al.,
ICML 2021), Section 5. Guards: the cost model reproduces published throughputs.
The papers' set-ups: docs/testing.md, "What each test module checks", test_planner_published.py.

Pure Python, no processes: the whole file runs in about a second.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from megatron_2bw.planner import CostModel, Layout, ModelSpec, PlanRequest, preset, search
from megatron_2bw.planner.cluster import PrecisionError
from megatron_2bw.planner.evaluate import evaluate, parse_evaluate

REPO = Path(__file__).resolve().parents[1]

# params (B) | heads | hidden | layers | TP | PP | GPUs | batch | MBS | V | TFLOP/s per GPU
SC21_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163),
]
SEQ, VOCAB = 2048, 51200


def _sc21_command(heads, hidden, layers, tp, pp, gpus, batch, mbs, v) -> str:
    """The row as run_table_1.sh launches it (Megatron-LM's flag names). The Megatron-LM of
    2021 ran its fused softmax over the full score matrices; today's name for that is
    --attention-backend unfused (the default, auto, takes FlashAttention on A100)."""
    chunk = f" --num-layers-per-virtual-pipeline-stage {layers // pp // v}" if v > 1 else ""
    return (f"torchrun --nnodes {gpus // 8} --nproc-per-node 8 pretrain_gpt.py "
            f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} "
            f"--num-layers {layers} --hidden-size {hidden} --num-attention-heads {heads} "
            f"--seq-length {SEQ} --max-position-embeddings {SEQ} --vocab-size {VOCAB} "
            f"--micro-batch-size {mbs} --global-batch-size {batch} --fp16 "
            f"--recompute-granularity full --recompute-method uniform{chunk} "
            f"--attention-backend unfused")


def _predict_sc21(row):
    params, heads, hidden, layers, tp, pp, gpus, batch, mbs, v, _ = row
    forced = parse_evaluate(_sc21_command(heads, hidden, layers, tp, pp, gpus, batch, mbs, v),
                            world=8)
    model = ModelSpec("gpt", layers, hidden, heads, SEQ, VOCAB)
    cluster = preset("dgx-a100", nodes=forced.layout.world // 8)
    cost = CostModel(model, cluster, "fp16",
                     flash_attention=cluster.attention_is_flash(forced.attention_backend, "fp16"))
    return model, forced, evaluate(cost, forced.layout)


@pytest.mark.parametrize("row", SC21_TABLE_1, ids=[f"{r[0]}B" for r in SC21_TABLE_1])
def test_sc21_table_1_within_10_percent(row):
    params, heads, hidden, layers, tp, pp, gpus, batch, mbs, v, published = row
    model, forced, result = _predict_sc21(row)
    layout = forced.layout
    assert (layout.t, layout.d, layout.w, layout.b, layout.v) == (tp, pp, gpus // (tp * pp),
                                                                  mbs, v)
    assert layout.recompute and forced.precision == "fp16"
    # The paper's model size (Eq. 2) and FLOP count (Eq. 3), written out here.
    assert model.num_parameters() / 1e9 == pytest.approx(params, abs=0.05)  # 1 decimal
    s, l, h = SEQ, layers, hidden
    eq3 = 96 * batch * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))
    assert result.model_flops == pytest.approx(eq3, rel=1e-9)
    error = result.tflops_per_gpu / published - 1
    assert abs(error) <= 0.10, f"{params}B: predicted {result.tflops_per_gpu:.1f} TFLOP/s " \
                               f"per GPU, published {published} ({error:+.1%})"
    assert result.memory.peak <= 80 * 2**30  # the published runs fit in 80 GB


def test_sc21_rows_have_no_constant_of_their_own():
    # One cluster preset for every row: the cost model sees only the row's sizes. The
    # predictions follow the published trend: the 1T model beats the 1.7B one per GPU.
    first, last = _predict_sc21(SC21_TABLE_1[0])[2], _predict_sc21(SC21_TABLE_1[-1])[2]
    assert last.tflops_per_gpu > first.tflops_per_gpu


# ---- interleaving, by hand --------------------------------------------------------------


def test_interleaved_bubble_and_stash_by_hand():
    # Uniform stages F = 1, B = 2: interleaved 1F1B with V chunks takes m (F + B) +
    # (d - 1)(F + B)/V (SC'21 Section 2.2.2: bubble fraction (d - 1)/(V m)).
    d, m = 4, 8
    for v in (1, 2, 4):
        closed = CostModel._closed_form("megatron", d, m, [1.0] * d, [2.0] * d, 0.0, 0.0,
                                        "local", v=v)
        assert closed == pytest.approx(m * 3 + (d - 1) * 3 / v)
    # Stage 0 keeps d + (d - 1)/V microbatches' activations (Korthikanti et al. 2022,
    # Section 4.2.3): 4 + 3/2 at V = 2.
    model = ModelSpec("gpt", num_layers=8, hidden_size=64, num_attention_heads=4,
                      seq_length=32, vocab_size=128)
    cost = CostModel(model, preset("dgx-a100"), "bf16")
    plain = cost.memory(Layout(1, 4, 2, 1, 8, False, "megatron"))
    interleaved = cost.memory(Layout(1, 4, 2, 1, 8, False, "megatron", v=2))
    ratio = interleaved.stages[0].activations / plain.stages[0].activations
    assert ratio == pytest.approx((4 + 3 / 2) / 4)


def test_search_tries_virtual_stages_megatron_core_can_run():
    model = ModelSpec("gpt", num_layers=8, hidden_size=64, num_attention_heads=4,
                      seq_length=32, vocab_size=128)
    plan = search(PlanRequest(model, preset("dgx-a100"), 16, micro_batch_sizes=(1,),
                              schedules=("megatron",), virtual_stages=(1, 2, 3)))
    assert any(c.layout.v == 2 and c.layout.d == 4 for c in plan.ranked)
    # 8 layers do not split into 4 x 3 chunks; at d = 2 with w = 4, m = 4 is whole groups.
    assert any(r.value("d") == 4 and "4 x 3" in r.reason for r in plan.rejected)
    assert all(8 % (c.layout.d * c.layout.v) == 0 for c in plan.ranked if c.layout.split is None)
    # an uneven split places the 8 layers over the d x V virtual stages its flags name
    assert all(len(c.layout.split) == c.layout.d * c.layout.v and sum(c.layout.split) == 8
               for c in plan.ranked if c.layout.split is not None)


# ---- the PipeDream-2BW paper's cluster ---------------------------------------------------

GPT_2_2B = ModelSpec("gpt", num_layers=32, hidden_size=2304, num_attention_heads=24,
                     seq_length=512, vocab_size=50257)
BERT_3_8B = ModelSpec("bert", num_layers=48, hidden_size=2560, num_attention_heads=40,
                      seq_length=512, vocab_size=30522)
PAPER_SCHEDULES = ("2bw", "flush", "gpipe", "naive", "megatron")
"""The schedules PipeDream-2BW's planner chooses among (Section 5: 2BW, PipeDream-Flush, GPipe,
model parallelism without pipelining, Megatron's 1F1B); ZB-H1 (2024) came later. Its planner
ranks by throughput alone (iteration_factor=1.0 below)."""


def test_paper_cluster_is_fp16_and_refuses_bf16():
    cluster = preset("paper", nodes=8)
    assert cluster.default_precision == "fp16"
    with pytest.raises(PrecisionError, match="no bf16"):
        CostModel(GPT_2_2B, cluster, "bf16")


@pytest.mark.parametrize("model", [GPT_2_2B, BERT_3_8B], ids=["gpt-2.2b", "bert-3.8b"])
def test_paper_cluster_keeps_tensor_parallelism_in_a_server(model):
    # 64 V100s in fp16: tensor parallelism inside a server (at most its 8 GPUs, on NVLink),
    # pipelined across all 8 servers as the paper does, under 2BW.
    plan = search(PlanRequest(model, preset("paper", nodes=8), 512, "fp16",
                              schedules=PAPER_SCHEDULES, iteration_factor=1.0))
    best = plan.best.layout
    assert best.t <= 8 and best.d == 8 and best.schedule == "2bw"


def test_paper_search_space_gives_the_papers_gpt_2_2b_layout():
    # PipeDream-2BW partitions without tensor parallelism; in that space its planner runs
    # GPT 2.2B as 8 stages x 8 replicas (the layout issue 17 quotes from the paper).
    plan = search(PlanRequest(GPT_2_2B, preset("paper", nodes=8), 512, "fp16",
                              schedules=PAPER_SCHEDULES, max_tensor_parallel=1,
                              iteration_factor=1.0))
    best = plan.best.layout
    assert (best.t, best.d, best.w, best.schedule) == (1, 8, 8, "2bw")


def test_cross_server_tensor_parallelism_is_10_to_30_times_slower():
    # GPT 2.2B's shape with 32 heads, so that t = 16 (two servers) divides them. PipeDream-2BW
    # reports up to 20x over model parallelism across servers; the 25 Gb/s adapter is shared by
    # the 8 GPUs of a server (Cluster.group_link).
    model = ModelSpec("gpt", 32, 2304, 32, 512, 50257)
    plan = search(PlanRequest(model, preset("paper", nodes=8), 512, "fp16"))
    inside = next(c for c in plan.ranked if c.layout.t <= 8)
    across = next(c for c in plan.ranked if c.layout.t > 8)
    assert 10 <= inside.samples_per_s / across.samples_per_s <= 30


# ---- the command line ------------------------------------------------------------------


def _plan_cli():
    spec = importlib.util.spec_from_file_location("plan_cli", REPO / "tools" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_evaluate_prints_the_layout_beside_the_choice(capsys):
    row = SC21_TABLE_1[4]  # 39.1B, t8 p2 on 512 GPUs
    command = _sc21_command(*row[1:10])
    code = _plan_cli().main(["--cluster", "dgx-a100", "--evaluate", command, "--closed-form"])
    out = capsys.readouterr().out
    assert code == 0 and "on 512 devices" in out
    assert "evaluated: t8 d2 w32 b4 m12 megatron rc" in out
    tflops = float(out.split("TFLOP/s per GPU")[1].split()[0])
    assert abs(tflops / row[-1] - 1) <= 0.10
    assert "memory: fits" in out and "planner's choice:" in out and "x the evaluated" in out


@pytest.mark.parametrize("argv,fragment", [
    (["--evaluate", "pretrain_gpt.py --tensor-model-parallel-size 3"], "--micro-batch-size"),
    (["--evaluate", "t3d1b1:megatron", "--num-layers", "4", "--hidden-size", "64",
      "--num-attention-heads", "4", "--seq-length", "32", "--global-batch-size", "8",
      "--cluster", "dgx-a100"], "t x d x w"),
    (["--cluster", "dgx-h100", "--evaluate", "pretrain_gpt.py --micro-batch-size 1 "
      "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 4096 "
      "--global-batch-size 256 --num-experts 8 --expert-model-parallel-size 8"],
     "add --moe-token-dispatcher-type alltoall"),
    (["--cluster", "paper", "--precision", "bf16", "--num-layers", "4", "--hidden-size", "64",
      "--num-attention-heads", "4", "--seq-length", "32", "--global-batch-size", "8"],
     "no bf16"),
])
def test_bad_evaluate_input_is_one_line(capsys, argv, fragment):
    with pytest.raises(SystemExit) as exit_info:
        _plan_cli().main(argv)
    error = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert error.startswith("error: ") and fragment in error
    assert len(error.strip().splitlines()) == 1


def test_evaluate_reads_the_attention_backend_of_the_command(capsys):
    """auto (not given) on A100 in fp16 is FlashAttention, as megatron-core picks it; the
    command's unfused keeps the score matrices: more activation memory per microbatch."""
    row = SC21_TABLE_1[4]
    unfused = _sc21_command(*row[1:10])
    auto = unfused.replace(" --attention-backend unfused", "")
    peaks = {}
    for name, command in (("unfused", unfused), ("auto", auto)):
        assert _plan_cli().main(["--cluster", "dgx-a100", "--evaluate", command,
                                 "--closed-form"]) == 0
        out = capsys.readouterr().out
        assert ("FlashAttention" in out) == (name == "auto")
        peaks[name] = float(out.split("stage   0:")[1].split("GiB")[0])
    assert peaks["auto"] < peaks["unfused"]
    with pytest.raises(SystemExit):
        _plan_cli().main(["--cluster", "dgx-a100", "--evaluate", unfused, "--closed-form",
                          "--attention-backend", "flash"])
    assert "differs" in capsys.readouterr().err
