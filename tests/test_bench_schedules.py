"""tools/bench_schedules.py end to end on a tiny GPT: every row it prints comes from real runs,
and its memory columns agree with numbers derived here by hand.

One round of single / single-at-once / 2bw / flush / zb-h1 and the MoE rows with d = m = 2,
shared by the tests that read them. Timings are not checked (tests check correctness,
benchmarks report speed); bytes copied are: zb-h1's split backward copies what flush's fused
one copies, within 5% (before, its W re-ran the backward on cloned saved tensors: 1.36x flush's
bytes on this model, 22x on the benchmark's default one). At --data-parallel-size 2 each rank's
optimizer state under Muon and dist_muon is held to a count by hand.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.dist import python, torchrun_env

LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO = 2, 64, 2, 32, 128, 2


def _layer_params(h: int) -> int:
    """One GPT layer with biases: two layer norms (2h each), QKV (3h^2 + 3h), attention
    projection (h^2 + h), MLP h -> 4h -> h (8h^2 + 5h)."""
    return 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (8 * h * h + 5 * h)


def _stage_params() -> list[int]:
    """PP=2, untied: stage 0 = word and position embeddings + layer 1; stage 1 = layer 2 + the
    final layer norm + the output layer (no bias). The vocabulary is a multiple of 128 already."""
    per_layer = _layer_params(HIDDEN)
    return [VOCAB * HIDDEN + SEQ * HIDDEN + per_layer,
            per_layer + 2 * HIDDEN + VOCAB * HIDDEN]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One round of the rows both tests below read: single, single-at-once, 2bw, flush, zb-h1
    and --moe-variants' 2bw +moe and flush +moe; (the run, its JSON)."""
    measurements = tmp_path_factory.mktemp("bench") / "bench.json"
    run = python(["tools/bench_schedules.py", "--schedules", "2bw,flush,zb-h1", "--moe-variants",
                  "--iters", "2", "--warmup", "1", "--num-layers", str(LAYERS),
                  "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
                  "--seq-length", str(SEQ), "--vocab-size", str(VOCAB),
                  "--micro-batch-size", str(MICRO), "--json", str(measurements)], timeout=600,
                 **torchrun_env())
    assert run.returncode == 0, run.output[-3000:]
    return run, json.loads(measurements.read_text())


def test_bench_rows_and_memory_columns(bench_run):
    run, data = bench_run
    rows = {line[:17].strip(): line[17:].split() for line in run.output.splitlines()
            if line[:17].strip() in ("single (PP=1)", "single, d at once", "2bw", "flush",
                                     "zb-h1")}
    assert set(rows) == {"single (PP=1)", "single, d at once", "2bw", "flush", "zb-h1"}, \
        run.output

    # ms/iter samples/s vs2bw vs-ideal vs-busy cpu runq recv coll stash stash-MiB weights-MiB
    for name, cells in rows.items():
        ms, samples = float(cells[0]), float(cells[1])
        assert ms > 0 and math.isclose(samples, 2 * MICRO / (ms / 1e3), rel_tol=0.01), name
    assert float(rows["2bw"][2]) == 1.0
    assert float(rows["single (PP=1)"][3]) == 0.5  # single / d over itself
    # peak stashed microbatches: d - i for 2bw and flush (1F1B), one for a whole-model process
    assert rows["2bw"][9] == rows["flush"][9] == rows["zb-h1"][9] == "2/1"
    assert rows["single, d at once"][9] == "1/1" and rows["single (PP=1)"][9] == "1"

    expected = _stage_params()
    for name in ("2bw", "flush"):
        (run_,) = data["runs"][name]
        by_stage = sorted(run_["ranks"], key=lambda r: r["stage"])
        assert [r["param_bytes"] for r in by_stage] == [4 * n for n in expected], name
        # the forward saves at least the stage's input activation, s*b*h fp32 (stage 1)
        assert by_stage[1]["saved_bytes_per_microbatch"] >= SEQ * MICRO * HIDDEN * 4
        assert all(len(r["iterations"]) == 2 for r in by_stage)
    (busy,) = data["runs"]["single, d at once"]
    assert [r["stage"] for r in busy["ranks"]] == [0, 1]  # two independent copies
    assert all(r["param_bytes"] == 4 * sum(expected) for r in busy["ranks"])
    weights = [float(x) for x in rows["2bw"][11].split("/")]  # MiB, two versions
    assert weights == [round(2 * 4 * n / 2**20, 1) for n in expected]
    for name, versions in (("2bw", 2), ("flush", 1)):  # measured: every alive version's bytes
        by_stage = sorted(data["runs"][name][0]["ranks"], key=lambda r: r["stage"])
        assert [r["weight_bytes"] for r in by_stage] == [versions * 4 * n for n in expected]

    # zb-h1 against flush: measured action times, both bubbles, copies within 1.5x
    (flush,), (zbh1,) = data["runs"]["flush"], data["runs"]["zb-h1"]
    assert all({"F", "B", "S"} <= set(r["action_seconds"]) for r in flush["ranks"])
    assert all({"F", "I", "W", "S"} <= set(r["action_seconds"]) for r in zbh1["ranks"])
    copied = {name: sum(r["copied_bytes"] for r in run_["ranks"])
              for name, run_ in (("flush", flush), ("zb-h1", zbh1))}
    assert 0 < copied["zb-h1"] <= 1.05 * copied["flush"], copied
    lines = [line for line in run.output.splitlines() if "bubble (d-1)" in line]
    assert [line.split()[0] for line in lines] == ["flush", "zb-h1"], run.output
    assert "T_I" in lines[1] and "T_W" in lines[1] and "measured" in lines[1]
    # the predicted ratio: Qi et al.'s iterations from the stages' mean action times (d = m = 2)
    def mean(run_, kind):
        return sum(r["action_seconds"][kind] for r in run_["ranks"]) / len(run_["ranks"])

    flush_iteration = 3 * (mean(flush, "F") + mean(flush, "B"))
    f, i, w = (mean(zbh1, kind) for kind in "FIW")
    zb_iteration = 2 * (f + i + w) + f + i - w
    predicted = next(line for line in run.output.splitlines() if "predicted zb-h1 / flush" in line)
    printed = float(predicted.split("predicted zb-h1 / flush ")[1].split("x")[0])
    assert math.isclose(printed, flush_iteration / zb_iteration, abs_tol=0.006), predicted


def test_bench_splits_rows_follow_the_planners_split(tmp_path):
    """--splits even,planner: each schedule runs with megatron-core's even split and the
    planner's; at a vocabulary of 8192 on this 4-layer model the output layer outweighs
    layers and the planner's split moves them off the last stage. The stages' measured
    parameters follow the split the row names (its flags reached the runs), and the comparison
    line prints the measured and predicted ratios."""
    vocab, layers = 8192, 4
    measurements = tmp_path / "bench.json"
    run = python(["tools/bench_schedules.py", "--schedules", "2bw", "--splits", "even,planner",
                  "--no-single-rows", "--iters", "2", "--warmup", "1", "--num-layers", str(layers),
                  "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
                  "--seq-length", str(SEQ), "--vocab-size", str(vocab), "--microbatches", "4",
                  "--micro-batch-size", str(MICRO), "--json", str(measurements)], timeout=420,
                 **torchrun_env())
    assert run.returncode == 0, run.output[-3000:]
    data = json.loads(measurements.read_text())
    rows = [name for name in data["runs"] if name.startswith("2bw ")]
    assert rows[0] == "2bw even" and len(rows) == 2, rows
    split = [int(n) for n in rows[1].split()[1].split("|")]
    assert sum(split) == layers and split[1] < split[0], split
    per_layer = _layer_params(HIDDEN)
    for name, (first, last) in (("2bw even", (2, 2)), (rows[1], split)):
        (run_,) = data["runs"][name]
        by_stage = sorted(run_["ranks"], key=lambda r: r["stage"])
        assert [r["param_bytes"] for r in by_stage] == [
            4 * (vocab * HIDDEN + SEQ * HIDDEN + first * per_layer),
            4 * (last * per_layer + 2 * HIDDEN + vocab * HIDDEN)], name
    line = next(line for line in run.output.splitlines() if line.startswith("  2bw: "))
    assert "over even:" in line and "x measured (rounds" in line and "x predicted" in line, line
    assert "--decoder-last-pipeline-num-layers" in line or "--pipeline-model-parallel-layout" \
        in line, line


def _optimizer_state(stage: int) -> int:
    """Bytes of megatron-core's Muon set-up's state on one stage of the PP=2 GPT above: one fp32
    momentum per element of its 2-D weights that are not flagged embedding or output (the
    layer's QKV 3h^2, projection h^2, FC1 and FC2 4h^2 each, and on stage 0 the learned
    position embedding s x h, which megatron-core does not flag), Adam's two fp32 moments per
    element of everything else (the word embedding or output layer, norms, biases)."""
    h = HIDDEN
    matrices = 12 * h * h + (SEQ * h if stage == 0 else 0)
    rest = _layer_params(h) - 12 * h * h + (VOCAB * h if stage == 0 else 2 * h + VOCAB * h)
    return 4 * matrices + 2 * 4 * rest


def test_dist_muon_rows_at_dp2(tmp_path):
    """--data-parallel-size 2: 2bw+muon and 2bw+dist_muon at PP=2 x DP=2 (4 processes). Under
    Muon every rank holds its stage's whole optimizer state (counted here by hand); under
    dist_muon each parameter's state lies on exactly one of the stage's two replicas (the two
    sum to Muon's, each holds part of it), and only dist_muon all-gathers after its step. The
    comparison lines name the update's time and the state per rank."""
    measurements = tmp_path / "bench.json"
    run = python(["tools/bench_schedules.py", "--schedules", "2bw+muon,2bw+dist_muon",
                  "--data-parallel-size", "2", "--no-single-rows", "--iters", "2",
                  "--warmup", "1", "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
                  "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
                  "--vocab-size", str(VOCAB), "--micro-batch-size", str(MICRO),
                  "--json", str(measurements)], timeout=420,
                 **torchrun_env())
    assert run.returncode == 0, run.output[-3000:]
    data = json.loads(measurements.read_text())
    whole, sharded = ({r["stage"]: [] for r in data["runs"][name][0]["ranks"]}
                      for name in ("2bw+muon", "2bw+dist_muon"))
    for name, by_stage in (("2bw+muon", whole), ("2bw+dist_muon", sharded)):
        (run_,) = data["runs"][name]
        assert len(run_["ranks"]) == 4
        for r in run_["ranks"]:
            by_stage[r["stage"]].append(r)
            gathers = [i["gather_seconds"] for i in r["iterations"]]
            assert all(g > 0 for g in gathers) if name.endswith("dist_muon") \
                else all(g == 0 for g in gathers), (name, gathers)
            assert all(i["step_seconds"] > 0 for i in r["iterations"])
    for stage in (0, 1):
        assert [r["optimizer_state_bytes"] for r in whole[stage]] == [_optimizer_state(stage)] * 2
        parts = [r["optimizer_state_bytes"] for r in sharded[stage]]
        assert sum(parts) == _optimizer_state(stage) and min(parts) > 0, (stage, parts)
    lines = run.output.splitlines()
    start = lines.index("  2bw+dist_muon / 2bw+muon:")
    assert [line.split(":")[0].strip() for line in lines[start + 1:start + 5]] == [
        "update wall", "update CPU", "iteration", "optimizer state per rank"], run.output


def _moe_layer_params(h: int, experts: int = 4) -> int:
    """One MoE GPT layer without linear biases (the rows' --disable-bias-linear): two layer
    norms (2h each), QKV (3h^2), attention projection (h^2), the router (experts x h), and per
    expert an FFN h -> 4h -> h (8h^2)."""
    return 2 * 2 * h + 3 * h * h + h * h + experts * h + experts * 8 * h * h


def test_moe_rows(bench_run):
    """--moe-variants: "2bw +moe" and "flush +moe" run the same GPT with MoE FFNs (4 experts,
    top-2, all on each stage): each stage holds the parameters counted here by hand, flush one
    version of them and 2BW two (experts and router included), measured."""
    run, data = bench_run
    rows = {line[:17].strip() for line in run.output.splitlines()}
    assert {"2bw", "2bw +moe", "flush +moe"} <= rows, run.output
    per_layer = _moe_layer_params(HIDDEN)
    expected = [VOCAB * HIDDEN + SEQ * HIDDEN + per_layer, per_layer + 2 * HIDDEN + VOCAB * HIDDEN]
    for name, versions in (("2bw +moe", 2), ("flush +moe", 1)):
        by_stage = sorted(data["runs"][name][0]["ranks"], key=lambda r: r["stage"])
        assert [r["param_bytes"] for r in by_stage] == [4 * n for n in expected], name
        assert [r["weight_bytes"] for r in by_stage] == [versions * 4 * n for n in expected]


def test_rounds_alternate_the_order_of_the_rows(monkeypatch):
    """Rounds 1, 3, ... run the rows in the table's order, rounds 2, 4, ... in reverse, so a
    drift of the machine's speed within a round favours each of two neighbouring rows (even and
    the planner's split) equally often; the table keeps its order."""
    import argparse

    from tests.test_compare import _tool

    bench = _tool("bench_schedules")
    order = []
    monkeypatch.setattr(bench, "_launch", lambda a, config, keep: order.append(config) or config)
    configs = ["single", "busy", "2bw even", "2bw 6|2"]
    configs = [argparse.Namespace(name=n, processes=2, world=2) for n in configs]
    runs = bench._run_rounds(argparse.Namespace(rounds=3, timeline_dir=None), configs)
    names = [c.name for c in order]
    assert names == ["single", "busy", "2bw even", "2bw 6|2", "2bw 6|2", "2bw even", "busy",
                     "single", "single", "busy", "2bw even", "2bw 6|2"]
    assert list(runs) == ["single", "busy", "2bw even", "2bw 6|2"]
