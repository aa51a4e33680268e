"""Megatron-LM's layout flags: the split they give, as megatron-core 0.16.1 builds it, and the
one-line refusals of splits that do not add up (megatron_2bw/schedules/split.py).

1. Over a grid of --num-layers, pipeline sizes, virtual stages and every layout flag, each
   command the parser accepts gives, on every (rank, chunk), the layer count and first layer
   megatron-core's own ``get_num_layers_to_build`` and ``get_transformer_layer_offset`` give
   for the TransformerConfig the training builds from the same flags (in the loop, where the
   flags reach megatron-core as Megatron-LM passes them).
2. Under the V placement (zb-v, dualpipev) the wrapped functions give what the test states
   by hand: rank i's chunk 0 is virtual stage i, its chunk 1 virtual stage 2d-1-i.
3. ``LayerSplit.layout()`` is a layout string megatron-core parses to the same split.
4. Refusals: one FlagError line naming the flag, for each rule of Megatron-LM and
   megatron-core (and ours: no MTP, E and L at the ends).
"""

from __future__ import annotations

import itertools
from unittest import mock

import pytest

from megatron_2bw.arguments import FlagError, parse_args
from megatron_2bw.schedules import LayerSplit, Placement
from megatron_2bw.schedules.split import parse_layout

BASE = ["--cpu", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--mock-data",
        "--lr", "1e-3", "--train-iters", "4", "--pipeline-schedule", "flush"]


def _parse(layers: int, d: int, flags: list[str], schedule: str = "flush"):
    return parse_args(BASE + ["--num-layers", str(layers), "--pipeline-model-parallel-size",
                              str(d), "--global-batch-size", str(4 * d),
                              "--pipeline-schedule", schedule] + flags, world_size=d)


def _megatron_core(config, d: int, chunks: int) -> dict:
    """{(rank, chunk): (first layer, layers)} from megatron-core's functions (the rank and V
    they read from parallel_state patched)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vp = chunks if chunks > 1 else None
    found = {}
    for rank, chunk in itertools.product(range(d), range(chunks)):
        with mock.patch.object(ps, "get_pipeline_model_parallel_rank", return_value=rank), \
                mock.patch.object(ps, "get_virtual_pipeline_model_parallel_world_size",
                                  return_value=vp):
            stage = chunk if vp else None
            found[rank, chunk] = (get_transformer_layer_offset(config, stage, rank),
                                  get_num_layers_to_build(config, stage, rank))
    return found


def _grid():
    for layers, d, V in itertools.product((6, 8), (1, 2, 3, 4), (1, 2)):
        chunks = [] if V == 1 else ["--num-virtual-stages-per-pipeline-rank", str(V)]
        yield layers, d, chunks
        for first, last in itertools.product((None, 1, 2, 4), repeat=2):
            if first is None and last is None:
                continue
            yield layers, d, chunks + (["--decoder-first-pipeline-num-layers", str(first)]
                                       if first else []) + (
                ["--decoder-last-pipeline-num-layers", str(last)] if last else [])
        for accounted in (["--account-for-embedding-in-pipeline-split"],
                          ["--account-for-loss-in-pipeline-split"],
                          ["--account-for-embedding-in-pipeline-split",
                           "--account-for-loss-in-pipeline-split"]):
            yield layers, d, chunks + accounted
    for layers, d, layout in ((4, 2, "E,t*3|t,L"), (4, 2, "E|t*4,L"), (4, 2, "Et*4|L"),
                              (4, 2, "Et|tt|t|L"), (4, 2, "Ett|t||tL"), (8, 4, "E|(tt|)*3tt,L"),
                              (6, 3, "Et|(tt|)*1tt,tL")):
        yield layers, d, ["--pipeline-model-parallel-layout", layout]


def test_the_split_is_megatron_cores():
    """Every accepted command of the grid: our split (`args.pipeline_layer_split`, model
    order) gives each (rank, chunk) megatron-core's first layer and count, read from the
    TransformerConfig the training builds from the same flags."""
    from megatron_2bw.training import build

    checked = uneven = 0
    for layers, d, flags in _grid():
        try:
            args = _parse(layers, d, flags)
        except FlagError:
            continue
        split = LayerSplit(args.pipeline_layer_split, d)
        config = build.transformer_config(args, "cpu")
        placement = Placement(d, split.chunks)
        ours = {(rank, chunk): (split.offset(v), split.count(v))
                for rank, chunk in itertools.product(range(d), range(split.chunks))
                for v in [placement.virtual(rank, chunk)]}
        assert ours == _megatron_core(config, d, split.chunks), (layers, d, flags)
        checked += 1
        uneven += not split.is_even
    print(f"\n{checked} accepted commands, {uneven} of them uneven")
    assert checked > 50 and uneven > 25, (checked, uneven)


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
def test_the_v_numbers_its_chunks_by_virtual_stage(schedule):
    """Under the V rank i's chunk 0 holds virtual stage i and chunk 1 virtual stage 2d-1-i:
    with 'E,t|t*2|t|L' (layers 1, 2, 1, 0 in model order) rank 0 holds layer 0 and nothing,
    rank 1 layers 1-2 and layer 3."""
    from megatron_2bw.training import build

    args = _parse(4, 2, ["--pipeline-model-parallel-layout", "E,t|t*2|t|L",
                         "--untie-embeddings-and-output-weights"], schedule)
    assert args.pipeline_layer_split == (1, 2, 1, 0)
    config = build.transformer_config(args, "cpu")
    assert _megatron_core(config, 2, 2) == {(0, 0): (0, 1), (0, 1): (4, 0),
                                            (1, 0): (1, 2), (1, 1): (3, 1)}


def test_a_layout_string_parses_back_to_its_split():
    """``LayerSplit.layout()`` in our parser and in megatron-core's PipelineParallelLayerLayout
    gives the split back (virtual stages in model order: pp fastest)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import \
        PipelineParallelLayerLayout

    for layers, d in (((7, 1), 2), ((0, 4), 2), ((4, 0), 2), ((1, 2, 0, 1), 2),
                      ((10, 20, 20, 30), 4), ((3, 3, 2, 2, 1, 1), 3)):
        split = LayerSplit(layers, d)
        text = split.layout()
        assert parse_layout(text, d, split.num_layers) == split, text
        theirs = PipelineParallelLayerLayout(text, d)
        assert [theirs.layout[v % d][v // d].count(LayerType.decoder)
                for v in range(len(layers))] == list(layers), text
    assert LayerSplit((7, 1), 2).layout() == "E,t*7|t,L"


BAD = [  # (flags after --num-layers 8 --pipeline-model-parallel-size 2, flag, words)
    (["--decoder-first-pipeline-num-layers", "0"], "--decoder-first-pipeline-num-layers",
     "must be > 0"),
    (["--decoder-first-pipeline-num-layers", "9"], "--decoder-first-pipeline-num-layers",
     "leave -1"),
    (["--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "3"],
     "--decoder-last-pipeline-num-layers", "leave 2 for the 0 pipeline stage(s) between"),
    (["--decoder-last-pipeline-num-layers", "1", "--num-virtual-stages-per-pipeline-rank", "2"],
     "--decoder-last-pipeline-num-layers", "do not split over 2 virtual stages"),
    (["--decoder-last-pipeline-num-layers", "2", "--num-layers-per-virtual-pipeline-stage",
      "1"], "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"),
    (["--decoder-first-pipeline-num-layers", "4", "--decoder-last-pipeline-num-layers", "4",
      "--num-virtual-stages-per-pipeline-rank", "2"], "--decoder-last-pipeline-num-layers",
     "megatron-core 0.16.1 cannot number the layers"),
    (["--decoder-last-pipeline-num-layers", "1", "--account-for-loss-in-pipeline-split"],
     "--account-for-loss-in-pipeline-split", "megatron-core refuses"),
    (["--account-for-loss-in-pipeline-split"], "--account-for-loss-in-pipeline-split",
     "8 layers + 1 (embedding/loss counted as layers) = 9 do not split evenly"),
    (["--account-for-embedding-in-pipeline-split", "--num-virtual-stages-per-pipeline-rank",
      "2"], "--account-for-embedding-in-pipeline-split", "= 9 do not split evenly over 2 "
     "pipeline stages x 2 virtual stages"),
    (["--pipeline-model-parallel-layout", "Et*6|tL"], "--pipeline-model-parallel-layout",
     "places 7 transformer layers, --num-layers is 8"),
    (["--pipeline-model-parallel-layout", "Et*3|t*3|tL"], "--pipeline-model-parallel-layout",
     "3 stages in 'Et*3|t*3|tL' are not a multiple of 2"),
    (["--pipeline-model-parallel-layout", "t*4|Et*3L"], "--pipeline-model-parallel-layout",
     "must open the first stage"),
    (["--pipeline-model-parallel-layout", "Et*4|t*3|L|"], "--pipeline-model-parallel-layout",
     "must close the last stage"),
    (["--pipeline-model-parallel-layout", "Et*4|t*3mL"], "--pipeline-model-parallel-layout",
     "no MTP layers"),
    (["--pipeline-model-parallel-layout", "Et*4|t*3xL"], "--pipeline-model-parallel-layout",
     "unknown layer character 'x'"),
    (["--pipeline-model-parallel-layout", "Et*7|tL", "--decoder-last-pipeline-num-layers", "1"],
     "--decoder-last-pipeline-num-layers", "not with --pipeline-model-parallel-layout"),
    (["--pipeline-model-parallel-layout", "Et|t*3|t*3|tL",
      "--num-virtual-stages-per-pipeline-rank", "2"], "--pipeline-model-parallel-layout",
     "give only one of"),
    (["--pipeline-model-parallel-layout", "Et|t*3|t*3|tL", "--pipeline-schedule", "gpipe"],
     "--pipeline-model-parallel-layout", "gpipe does not run virtual stages"),
    (["--pipeline-schedule", "zb-v", "--untie-embeddings-and-output-weights",
      "--decoder-last-pipeline-num-layers", "1"], "--decoder-last-pipeline-num-layers",
     "under the V rank 0 holds the first and the last stage"),
    (["--pipeline-schedule", "zb-v", "--untie-embeddings-and-output-weights",
      "--pipeline-model-parallel-layout", "Et*7|tL"], "--pipeline-model-parallel-layout",
     "the V placement holds 2 x 2 = 4 virtual stages"),
    (["--decoder-last-pipeline-num-layers", "1", "--recompute-granularity", "full",
      "--recompute-method", "uniform", "--recompute-num-layers", "2"],
     "--recompute-num-layers", "model chunks of 1, 7 layers are not a multiple of it"),
]


@pytest.mark.parametrize("flags, flag, words", BAD, ids=[" ".join(f) for f, _, _ in BAD])
def test_a_split_that_does_not_add_up_is_one_flag_line(flags, flag, words):
    with pytest.raises(FlagError) as error:
        _parse(8, 2, flags, "flush")
    message = str(error.value)
    assert error.value.flag == flag and words in message and "\n" not in message, message


# ---- the simulator follows the split ----------------------------------------------------------

def _work(split: LayerSplit, layer: float, head: float) -> list[float]:
    """Per stage, F + B of one microbatch with one chunk each: its layers and, on the last
    stage, the head (the backward twice the forward)."""
    d = split.depth
    return [3 * (split.count(i) * layer + (i == d - 1) * head) for i in range(d)]


@pytest.mark.parametrize("layers", [(2, 2), (3, 1), (4, 0), (1, 3)])
def test_the_simulator_times_each_stage_by_its_layers(layers):
    """Flush over d = 2 with a head worth 5 layers: one batch takes (m - 1) max_i w_i +
    sum_i w_i (w_i: stage i's F + B, its layers and the head), and 2BW's steady batch m max_i
    w_i; 3|1 beats the even 2|2 (the head makes stage 1 the bottleneck)."""
    from megatron_2bw.schedules import Costs, pipeline_actions, simulate

    split, m = LayerSplit(layers, 2), 4
    costs = Costs.of_layers(split, Placement(2), layer=(1.0, 2.0), head=(5.0, 10.0))
    work = _work(split, 1.0, 5.0)
    flush = simulate(pipeline_actions("flush", 2, m, 1), costs)
    assert flush.makespan == pytest.approx((m - 1) * max(work) + sum(work))
    twobw = simulate(pipeline_actions("2bw", 2, m, 3), costs)
    ends = [max(twobw.batch_ends(i)[k] for i in range(2)) for k in (1, 2)]
    assert ends[1] - ends[0] == pytest.approx(m * max(work))
    if layers == (3, 1):
        even = _work(LayerSplit((2, 2), 2), 1.0, 5.0)
        assert (m - 1) * max(work) + sum(work) < (m - 1) * max(even) + sum(even)


def test_the_simulator_holds_each_chunks_stash_by_its_layers():
    """Per stage, the most stashed bytes: flush at m = 4 stashes d - i microbatches on stage i,
    each its layers' bytes (3|1: 2 x 3 and 1 x 1 layers); under zb-v with 'E,t|t*2|t|L' a
    chunk's passes weigh its own layers (rank 0's chunk 1 none)."""
    from megatron_2bw.schedules import pipeline_actions, simulate

    split = LayerSplit((3, 1), 2)
    result = simulate(pipeline_actions("flush", 2, 4, 1),
                      stash_bytes=[[float(n)] for n in split.of_rank(Placement(2), 0)
                                   + split.of_rank(Placement(2), 1)])
    assert result.peak_stash_bytes == (6.0, 1.0)
    v = LayerSplit((1, 2, 1, 0), 2)
    placement = Placement.v(2)
    sizes = [[float(n) for n in v.of_rank(placement, i)] for i in range(2)]
    assert sizes == [[1.0, 0.0], [2.0, 1.0]]
    lists = pipeline_actions("zb-v", 2, 4, 1)
    zbv = simulate(lists, placement=placement, stash_bytes=sizes)
    assert zbv.peak_stash_bytes == tuple(_walked_peak(lists[i], sizes[i]) for i in range(2))
    assert zbv.peak_stash_bytes[0] < zbv.peak_stash_bytes[1]


def _walked_peak(actions, sizes: list[float]) -> float:
    """The most bytes held along one stage's list: + its chunk's size at each F, - at each B
    or I (one stage runs its list in order)."""
    from megatron_2bw.schedules import Kind

    held = peak = 0.0
    for a in actions:
        if a.kind is Kind.FORWARD:
            held += sizes[a.chunk]
        elif a.kind in (Kind.BACKWARD, Kind.INPUT_GRAD):
            held -= sizes[a.chunk]
        peak = max(peak, held)
    return peak
