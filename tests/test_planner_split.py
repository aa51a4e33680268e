"""The planner's uneven splits (megatron_2bw/planner/cost.py ``balanced_split``, search.py).

1. Against brute force: over every split of the layers (d = 2 and 3, loop and V), the one
   whose slowest rank's F + B (``CostModel.time``, the embedding, the output layer and the loss
   where they sit) is least, within a memory limit (``CostModel.memory``) where one is set, is
   as slow as the planner's split; at a vocabulary of 32,000 the output layer outweighs a few
   layers and the planner's split moves layers off the last stage.
2. The per-stage memory and time follow the split: a stage's parameters, stashed activations
   and F + B grow by one layer's each per layer it holds.
3. The flags the planner writes for a split are Megatron-LM's (--decoder-last-pipeline-num-
   layers where it says the split, --pipeline-model-parallel-layout under the V) and the
   training's parser derives the same split from them.
4. ``tools/plan.py`` ranks uneven layouts and says what the choice gains over the even split.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from megatron_2bw.planner import CostModel, Layout, ModelSpec, PlanRequest, preset, search
from megatron_2bw.planner.flags import launch_flags, parse_for_validation
from tests.test_planner import _plan_cli

BENCH = ModelSpec("gpt", num_layers=8, hidden_size=512, num_attention_heads=8, seq_length=128,
                  vocab_size=32000, untie_embeddings=True)
"""tools/bench_schedules.py's model at vocabulary 32,000 (untied, as the V needs)."""


def _cost(model: ModelSpec = BENCH, precision: str = "fp32") -> CostModel:
    return CostModel(model, preset("cpu-local"), precision)


def _slowest(cost: CostModel, layout: Layout) -> float:
    time = cost.time(layout)
    return max(f + b for f, b in zip(time.forward, time.backward))


def _every_split(layers: int, stages: int):
    for cut in itertools.product(range(layers + 1), repeat=stages - 1):
        if sum(cut) <= layers:
            yield (*cut, layers - sum(cut))


@pytest.mark.parametrize("schedule, d, v", [("flush", 2, 1), ("2bw", 3, 1), ("zb-v", 2, 1),
                                            ("gpipe", 3, 1), ("2bw", 2, 2)])
def test_the_balanced_split_is_the_least_slowest_stage(schedule, d, v):
    """No split of the 8 layers over the d V (the V: 2d) virtual stages has a faster slowest
    rank than the planner's; at vocabulary 32,000 the even split is not it."""
    cost = _cost()
    layout = Layout(1, d, 1, 2, 4 * d, False, schedule, v)
    split = cost.balanced_split(layout)
    assert split is not None and sum(split) == 8
    stages = d * layout.placement.chunks
    brute = min(_slowest(cost, dataclasses.replace(layout, split=s))
                for s in _every_split(8, stages))
    ours = _slowest(cost, dataclasses.replace(layout, split=split))
    assert ours == pytest.approx(brute, rel=1e-9), (split, ours, brute)
    if 8 % stages == 0:
        assert ours < _slowest(cost, layout) * 0.99


def test_the_balanced_split_fits_the_memory_limit():
    """A limit the even split breaks on stage 0 (it stashes d microbatches): the planner's
    split fits it, and no split within it has a faster slowest stage (brute force)."""
    cost = _cost(dataclasses.replace(BENCH, vocab_size=512, num_layers=9), "fp32")
    layout = Layout(1, 3, 1, 2, 6, False, "flush", split=(3, 3, 3))
    even = cost.memory(layout).stages
    limit = even[0].total - 2 ** 20  # stage 0 over, the others under
    assert even[0].total > limit >= max(s.total for s in even[1:])
    split = cost.balanced_split(dataclasses.replace(layout, split=None), limit)
    assert split is not None and cost.memory(dataclasses.replace(layout, split=split)).peak \
        <= limit
    fitting = [s for s in _every_split(9, 3)
               if cost.memory(dataclasses.replace(layout, split=s)).peak <= limit]
    brute = min(_slowest(cost, dataclasses.replace(layout, split=s)) for s in fitting)
    assert _slowest(cost, dataclasses.replace(layout, split=split)) == pytest.approx(brute)
    assert split[0] < 3


def test_memory_and_time_follow_the_split():
    """Moving one layer from the last stage to the first moves one layer's parameters,
    stashed activations (times the stage's stash) and F + B with it."""
    cost = _cost()
    layout = Layout(1, 2, 1, 2, 4, False, "flush")
    even, moved = (dataclasses.replace(layout, split=s) for s in ((4, 4), (5, 3)))
    (e0, e1), (m0, m1) = cost.memory(even).stages, cost.memory(moved).stages
    layer = BENCH.layer_parameters(1)
    assert (m0.parameters - e0.parameters, m1.parameters - e1.parameters) == (layer, -layer)
    per_layer = cost.memory(dataclasses.replace(layout, split=(1, 0))).stages[0].activations \
        - cost.memory(dataclasses.replace(layout, split=(0, 1))).stages[0].activations
    assert m0.activations - e0.activations == pytest.approx(per_layer)
    assert m0.stashed_microbatches == 2 and m1.stashed_microbatches == 1
    te, tm = cost.time(even), cost.time(moved)
    grown = (tm.forward[0] + tm.backward[0]) - (te.forward[0] + te.backward[0])
    shrunk = (te.forward[1] + te.backward[1]) - (tm.forward[1] + tm.backward[1])
    assert grown == pytest.approx(shrunk) and grown > 0


@pytest.mark.parametrize("schedule, split, flag", [
    ("flush", (7, 1), "--decoder-last-pipeline-num-layers"),
    ("2bw", (6, 2), "--decoder-last-pipeline-num-layers"),
    ("2bw", (8, 0), "--pipeline-model-parallel-layout"),  # an empty last stage: no flag says it
    ("zb-v", (3, 3, 2, 0), "--pipeline-model-parallel-layout"),
    ("flush", (3, 1, 3, 1), "--decoder-last-pipeline-num-layers"),  # V = 2: 2 chunks each
    ("2bw", (3, 1, 2, 2), "--pipeline-model-parallel-layout"),  # V = 2, chunks apart
])
def test_the_written_flags_give_the_split_back(schedule, split, flag):
    v = len(split) // 2 if schedule != "zb-v" else 1
    layout = Layout(1, 2, 1, 2, 8, False, schedule, v, split=split)
    flags = launch_flags(layout, BENCH, "fp32") + ["--mock-data", "--train-iters", "1"]
    assert flag in flags
    args = parse_for_validation(flags, BENCH, world_size=2)
    assert args.pipeline_layer_split == split


def test_the_search_ranks_uneven_splits_and_refuses_them_on_request():
    """At vocabulary 32,000 over 2 CPU stages the planner's best pipelined layout splits the
    layers unevenly; with uneven=False none does."""
    request = PlanRequest(BENCH, preset("cpu-local"), 8, "fp32", micro_batch_sizes=(2,),
                          simulate_top=0, schedules=("2bw", "flush"))
    piped = [c for c in search(request).ranked if c.layout.d == 2]
    assert piped and piped[0].layout.split is not None
    even = [c for c in piped if c.layout.split is None and c.layout.schedule
            == piped[0].layout.schedule and c.layout.b == piped[0].layout.b]
    assert even and piped[0].samples_per_s > even[0].samples_per_s
    plain = search(dataclasses.replace(request, uneven=False))
    assert all(c.layout.split is None for c in plain.ranked)


def test_plan_says_what_an_uneven_choice_gains():
    """The line under the choice: the split, its flags, its gain over the same layout with
    the even split and over the best even layout."""
    cli = _plan_cli()
    request = PlanRequest(BENCH, preset("cpu-local"), 8, "fp32", micro_batch_sizes=(2,),
                          simulate_top=0, schedules=("2bw", "flush"))
    plan = search(request)
    uneven = next(c for c in plan.ranked if c.layout.split is not None)
    said = cli.split_gain(plan, uneven)
    assert "--decoder-last-pipeline-num-layers" in said, said
    assert "samples/s over the same layout with the even split" in said, said
    assert "over the best layout with the even split" in said, said
    assert cli.short_split((4, 3, 3, 3, 1)) == "4|3x3|1"


def test_plan_evaluate_gives_the_planners_split_of_a_layout(tmp_path, capsys):
    """--evaluate t1d2w1b2:2bw (the benchmark's layout) prints the planner's split of it,
    its flags and its predicted gain."""
    code = _plan_cli().main(
        ["--cluster", "cpu-local", "--nodes", "1", "--gpus-per-node", "2",
         "--global-batch-size", "8", "--num-layers", "8", "--hidden-size", "512",
         "--num-attention-heads", "8", "--seq-length", "128", "--vocab-size", "32000",
         "--precision", "fp32", "--no-profile", "--evaluate", "t1d2w1b2:2bw",
         "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "planner's split of this layout: 7|1  --decoder-last-pipeline-num-layers 1" in out, out
