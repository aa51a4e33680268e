"""Log parsing (megatron_2bw.logparse) and the summary math of tools/compare.py and
tools/convergence.py, on hand-written log lines and synthetic records; no training runs.
"""

from __future__ import annotations

import argparse
import json
import importlib.util
import sys
from pathlib import Path

import pytest

from megatron_2bw.logparse import (IterationRecord, ParsedLog, RunHeader, parse_header,
                                   parse_iteration, parse_log, parse_validation,
                                   rank_memory_line)

REPO = Path(__file__).resolve().parents[1]


def _tool(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


ITERATION_LINE = (
    " [2026-01-01 10:00:00] iteration     20/    40 | consumed samples:       640 |"
    " elapsed time per iteration (ms): 1500.0 | learning rate: 1.000E-04 |"
    " global batch size: 32 | lm loss: 6.931472E+00 | grad norm: 1.250 |"
    " skipped iterations: 0 | samples/s: 21.33 | tokens/s: 2731 |"
    " TFLOP/s per device: 0.0295 | peak memory (MiB): 601")
LOG = "\n".join([
    "W1122 10:00:00 torch/distributed/run.py: Setting OMP_NUM_THREADS",
    " training 2bw schedule on 2 cpu processes: TP=1 PP=2 DP=1, 8 microbatches per batch",
    ITERATION_LINE,
    "-" * 80,
    " validation loss at iteration 20 | lm loss value: 6.500000E+00 | lm loss PPL: 6.65E+02",
    "-" * 80,
    " test loss at iteration 40 | lm loss value: 6.250000E+00 | lm loss PPL: 5.18E+02",
    " rank 0 peak memory (MiB): 512",
    " rank 1 peak memory (MiB): 640",
])


# ---- logparse ---------------------------------------------------------------------------------

def test_iteration_line_fields():
    r = parse_iteration(ITERATION_LINE)
    assert (r.iteration, r.train_iters, r.global_batch_size, r.skipped) == (20, 40, 32, 0)
    assert r.ms_per_iteration == 1500.0 and r.loss == pytest.approx(6.931472)
    assert r.learning_rate == pytest.approx(1e-4) and r.grad_norm == pytest.approx(1.25)
    assert r.samples_per_s == pytest.approx(21.33) and r.tokens_per_s == 2731
    assert r.tflops_per_device == pytest.approx(0.0295) and r.peak_memory_mib == 601


def test_grad_norm_na_and_other_lines():
    assert parse_iteration(ITERATION_LINE.replace("1.250", "n/a")).grad_norm is None
    assert parse_iteration(" validation loss at iteration 20 | lm loss value: 6.5") is None
    assert parse_iteration("iteration 3/10 started") is None  # no fields
    assert parse_validation(ITERATION_LINE) is None


def test_whole_log():
    log = parse_log(LOG)
    assert log.header == RunHeader("2bw", 2, "cpu", 1, 2, 1, 8)
    assert [r.iteration for r in log.iterations] == [20]
    assert [(v.split, v.iteration, v.loss) for v in log.validations] == [
        ("validation", 20, 6.5), ("test", 40, 6.25)]
    assert [v.loss for v in log.valid()] == [6.5]
    assert log.rank_memory_mib == {0: 512.0, 1: 640.0}


def test_parser_reads_what_the_training_loop_writes(capsys):
    """Round trip through megatron_2bw.training.logs: 32 samples in 1.6 s per iteration are
    20 samples/s, x 128 tokens = 2560 tokens/s; 1e12 FLOPs / 1.6 s / 2 devices = 0.3125."""
    from megatron_2bw.training.logs import IterationLog, Logger

    line = IterationLog(iteration=30, train_iters=100, seconds_per_iteration=1.6, lr=3e-4,
                        loss=5.25, grad_norm=None, consumed_samples=960, global_batch_size=32,
                        seq_length=128, flops_per_iteration=1e12, world_size=2,
                        peak_mem_mib=700.4).line()
    r = parse_iteration(line)
    assert (r.iteration, r.train_iters, r.ms_per_iteration, r.loss) == (30, 100, 1600.0, 5.25)
    assert (r.samples_per_s, r.tokens_per_s, r.peak_memory_mib) == (20.0, 2560.0, 700.0)
    assert r.tflops_per_device == pytest.approx(0.3125)
    Logger(True, None).validation(30, 4.75)
    (v,) = parse_log(capsys.readouterr().out).validations
    assert (v.split, v.iteration, v.loss) == ("validation", 30, 4.75)
    assert parse_header(" training flush schedule on 4 cuda processes: TP=2 PP=2 DP=1, "
                        "1 microbatches per batch") == RunHeader("flush", 4, "cuda", 2, 2, 1, 1)
    assert parse_log(rank_memory_line(3, 1234.4)).rank_memory_mib == {3: 1234.0}


# ---- compare: summary math --------------------------------------------------------------------

def _records(ms: list[float], interval: int = 5, batch: int = 32) -> list[IterationRecord]:
    total = interval * len(ms)
    return [IterationRecord(iteration=interval * (i + 1), train_iters=total,
                            ms_per_iteration=t, loss=5.0, samples_per_s=batch * 1000 / t,
                            tokens_per_s=batch * 128 * 1000 / t, tflops_per_device=10 / t,
                            peak_memory_mib=600.0 + i)
            for i, t in enumerate(ms)]


# lines at iterations 5..40; 5 and 10 are warm-up, 40 (the drain) is left out
TIMES = [3000, 2000, 1000, 1100, 900, 1200, 1000, 5000]


def test_median_over_measured_lines_without_warmup_and_the_last():
    compare = _tool("compare")
    log = ParsedLog(iterations=_records(TIMES), rank_memory_mib={0: 500.0, 1: 700.0},
                    header=RunHeader("2bw", 2, "cpu", 1, 2, 1, 8))
    s = compare.summarize(compare.Entry("2BW", "2bw", 1, 2), log, warmup=10)
    # measured: 1000, 1100, 900, 1200, 1000 ms -> median 1000 ms; samples/s 32 at 1000 ms
    assert s.measured_lines == 5 and s.ms_per_iteration == 1000
    assert s.samples_per_s == pytest.approx(32.0) and s.tflops_per_device == pytest.approx(0.01)
    assert s.dp == 1 and s.microbatches == 8
    assert s.peak_memory_mib == {0: 500.0, 1: 700.0} and s.max_memory_mib == 700.0
    # warm-up 15: 1100, 900, 1200, 1000 -> median (1000 + 1100) / 2
    assert compare.summarize(compare.Entry("2BW", "2bw", 1, 2), log, warmup=15
                             ).ms_per_iteration == 1050


def test_memory_falls_back_to_the_logging_rank():
    compare = _tool("compare")
    log = ParsedLog(iterations=_records(TIMES), header=RunHeader("flush", 4, "cuda", 1, 4, 1, 8))
    s = compare.summarize(compare.Entry("Flush", "flush", 1, 4), log, warmup=10)
    assert s.peak_memory_mib == {3: 607.0}  # the last rank logs; its largest value


def test_nothing_to_measure_is_an_error():
    compare = _tool("compare")
    log = ParsedLog(iterations=_records([1000, 1000]))
    with pytest.raises(ValueError, match="no log line after 10 warm-up"):
        compare.summarize(compare.Entry("x", "2bw", 1, 2), log, warmup=10)


def _summary(compare, label, schedule, samples, memory=None, tp=1, pp=2):
    return compare.Summary(label=label, schedule=schedule, tp=tp, pp=pp, dp=1, microbatches=8,
                           measured_lines=5, ms_per_iteration=32000 / samples,
                           samples_per_s=samples, tokens_per_s=None, tflops_per_device=None,
                           peak_memory_mib=memory or {0: 500.0, 1: 600.0})


def test_speedups_and_table():
    compare = _tool("compare")
    rows = [_summary(compare, "Tensor MP", "megatron", 8.0, tp=2, pp=1),
            _summary(compare, "GPipe", "gpipe", 20.0),
            _summary(compare, "PipeDream-2BW", "2bw", 32.0)]
    assert compare.speedups(rows, "PipeDream-2BW") == {
        "Tensor MP": 4.0, "GPipe": 1.6, "PipeDream-2BW": 1.0}
    with pytest.raises(ValueError, match="not an entry"):
        compare.speedups(rows, "PipeDream")
    for s in rows:
        compare._add_schedule_memory(s)
    assert (rows[0].stash, rows[0].versions) == ([1], 1)  # PP=1: one microbatch in flight
    assert (rows[1].stash, rows[1].versions) == ([8, 8], 1)  # GPipe stashes all m
    assert (rows[2].stash, rows[2].versions) == ([2, 1], 2)  # 1F1B: d - i; two versions
    table = compare.format_table(rows, "PipeDream-2BW")
    tensor_mp = next(line for line in table.splitlines() if line.startswith("Tensor MP"))
    assert "2x1x1" in tensor_mp and "4000.0" in tensor_mp and "4.00x" in tensor_mp
    assert "500/600" in tensor_mp and "r0/r1" in table


def test_entry_spec():
    compare = _tool("compare")
    assert compare.parse_entry("2BW PP=4:2bw:1:4") == compare.Entry("2BW PP=4", "2bw", 1, 4)
    assert compare.parse_entry("a:b:megatron:2:1").label == "a:b"
    for bad in ("2bw:1:2", "x:1f1b:1:2", "x:2bw:one:2"):
        with pytest.raises(argparse.ArgumentTypeError):
            compare.parse_entry(bad)


def test_chart_is_written(tmp_path):
    compare = _tool("compare")
    rows = [_summary(compare, "GPipe", "gpipe", 20.0), _summary(compare, "2BW", "2bw", 32.0)]
    path = compare.plot(rows, tmp_path / "chart.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- convergence ------------------------------------------------------------------------------

def test_final_losses_and_relative_gap():
    convergence = _tool("convergence")
    log = parse_log(LOG + "\n" + ITERATION_LINE.replace(" 20/", " 40/").replace(
        "6.931472E+00", "5.000000E+00"))
    assert convergence.final_losses(log) == {"train": 5.0, "valid": 6.5, "iteration": 40}
    assert convergence.relative_gap(4.04, 4.00) == pytest.approx(0.01)
    assert convergence.relative_gap(3.96, 4.00) == pytest.approx(-0.01)


def test_convergence_passes_pipemare_flags_to_pipemare_only():
    """The flags after '--' go to every run but the --pipemare-* ones (with their values, as
    two words or one), which the other schedules' flags refuse."""
    convergence = _tool("convergence")
    extra = ["--pipemare-discrepancy-decay", "0.5", "--clip-grad", "0.5",
             "--pipemare-sync-iters=3"]
    assert convergence._extra_for(extra, "pipemare") == extra
    assert convergence._extra_for(extra, "flush") == ["--clip-grad", "0.5"]


def test_rounds_take_the_median_round_and_the_largest_memory():
    compare = _tool("compare")
    rounds = [_summary(compare, "2BW", "2bw", samples, memory={0: 500.0 + i, 1: 650.0 - i})
              for i, samples in enumerate((32.0, 16.0, 20.0))]  # 1000, 2000, 1600 ms
    s = compare.median_over_rounds(rounds)
    assert (s.ms_per_iteration, s.samples_per_s) == (1600.0, 20.0)
    assert s.peak_memory_mib == {0: 502.0, 1: 650.0} and s.measured_lines == 15
    # two rounds: the faster of the middle two
    assert compare.median_over_rounds(rounds[1:]).ms_per_iteration == 1600.0


# ---- compare --from-logs on Megatron-LM's own logs ---------------------------------------------

def _megatron_lm_arguments(**values) -> list[str]:
    """Megatron-LM's start-up block, as _print_args prints it (megatron/training/arguments.py
    lines 1288-1299 at core_v0.16.1): a title line, '  name <48 - len(name) dots> value' sorted
    by lower-cased line, an end line."""
    lines = ["  {} {} {}".format(name, "." * (48 - len(name)), value)
             for name, value in values.items()]
    return (["------------------------ arguments ------------------------",
             *sorted(lines, key=lambda x: x.lower()),
             "-------------------- end of arguments ---------------------"])


def _megatron_lm_iteration(iteration: int, train_iters: int, ms: float, tflops: float,
                           batch: int, loss: float) -> str:
    """One training_log line (megatron/training/training.py lines 2033-2083 at core_v0.16.1,
    with --log-throughput and a grad norm; no params norm or num zeros)."""
    line = " [2026-01-01 10:00:00.000000]"
    line += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    line += " consumed samples: {:12d} |".format(iteration * batch)
    line += " elapsed time per iteration (ms): {:.1f} |".format(ms)
    line += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    line += f" learning rate: {1.5e-4:.6E} |"
    line += f" global batch size: {batch:5d} |"
    line += " {}: {:.6E} |".format("lm loss", loss)
    line += f" loss scale: {1.0:.1f} |"
    line += f" grad norm: {0.75:.3f} |"
    line += " number of skipped iterations: {:3d} |".format(0)
    line += " number of nan iterations: {:3d} |".format(0)
    return line


# lines at iterations 5..40 of a 64-sample batch; warm-up 10 leaves 15..35 (40 is the drain)
MLM_MS = [4000.0, 2100.0, 2000.0, 1600.0, 2500.0, 1900.0, 2050.0, 9000.0]
MLM_TFLOPS = [10.0, 95.0, 100.0, 125.0, 80.0, 105.0, 97.5, 20.0]


def _megatron_lm_log(path: Path, with_arguments: bool) -> Path:
    arguments = _megatron_lm_arguments(
        world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
        data_parallel_size=2, global_batch_size=64, micro_batch_size=4, seq_length=1024,
        lr=0.00015, data_path="['my-corpus_text_document']") if with_arguments else []
    lines = [_megatron_lm_iteration(5 * (i + 1), 40, ms, tflops, 64, 7.0 - 0.1 * i)
             for i, (ms, tflops) in enumerate(zip(MLM_MS, MLM_TFLOPS))]
    path.write_text("\n".join([
        "using world size: 8, data-parallel size: 2, context-parallel size: 1, ...",
        *arguments, "> building GPT2BPETokenizer tokenizer ...", *lines[:3],
        " validation loss at iteration 15 | lm loss value: 6.800000E+00 | "
        "lm loss PPL: 8.979E+02 | ", *lines[3:]]) + "\n")
    return path


@pytest.mark.parametrize("with_arguments", [True, False])
def test_from_logs_reads_megatron_lm_logs(tmp_path, capsys, with_arguments):
    """Medians by hand over iterations 15..35: ms 2000, 1600, 2500, 1900, 2050 -> 2000 ms, so
    64 samples / 2.0 s = 32 samples/s; TFLOP/s 100, 125, 80, 105, 97.5 -> 100. The arguments
    block gives TP 2 x PP 2 x DP 2 and 64 / (4 x 2) = 8 microbatches on Megatron's own
    schedule; without it those are n/a."""
    compare = _tool("compare")
    log = _megatron_lm_log(tmp_path / "mlm.log", with_arguments)
    out = tmp_path / "summary.json"
    assert compare.main(["--from-logs", f"Megatron-LM={log}", "--warmup", "10",
                         "--out", str(tmp_path), "--json", str(out)]) == 0
    (summary,) = json.loads(out.read_text())
    assert summary["measured_lines"] == 5 and summary["ms_per_iteration"] == 2000.0
    assert summary["samples_per_s"] == pytest.approx(32.0)
    assert summary["tflops_per_device"] == pytest.approx(100.0)
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("Megatron-LM"))
    if with_arguments:
        assert (summary["schedule"], summary["tp"], summary["pp"], summary["dp"],
                summary["microbatches"]) == ("megatron", 2, 2, 2, 8)
        assert row.split()[1:4] == ["megatron", "2x2x2", "8"]
    else:
        assert (summary["schedule"], summary["tp"], summary["pp"], summary["dp"],
                summary["microbatches"]) == ("n/a", None, None, None, None)
        assert row.split()[1:4] == ["n/a", "n/a", "n/a"]


def test_megatron_lm_arguments_block_is_parsed():
    text = "\n".join([*_megatron_lm_arguments(
        world_size=4, tensor_model_parallel_size=1, pipeline_model_parallel_size=4,
        data_parallel_size=1, global_batch_size=32, micro_batch_size=2, rampup_batch_size=None),
        _megatron_lm_iteration(1, 10, 500.0, 1.0, 32, 7.5)])
    log = parse_log(text)
    assert log.arguments["rampup_batch_size"] == "None"
    assert log.arguments["pipeline_model_parallel_size"] == "4"
    assert log.header == RunHeader("megatron", 4, "cuda", 1, 4, 1, 16)  # 32 / (2 x 1)
    assert [r.iteration for r in log.iterations] == [1]
    assert log.iterations[0].samples_per_s == pytest.approx(64.0)  # 32 / 0.5 s


# ---- convergence: iterations to match, time to loss, epochs ------------------------------------

def test_iterations_to_reach_interpolates_the_first_crossing():
    """On the straight segments between a reference's validation points: loss 5.5 lies
    between (100, 6.0) and (200, 5.0), at 100 + (6.0 - 5.5) / (6.0 - 5.0) x 100 = 150."""
    convergence = _tool("convergence")
    curve = [(50, 8.0), (100, 6.0), (200, 5.0), (300, 4.5)]
    assert convergence.iterations_to_reach(curve, 5.5) == pytest.approx(150.0)
    assert convergence.iterations_to_reach(curve, 5.0) == pytest.approx(200.0)
    assert convergence.iterations_to_reach(curve, 4.75) == pytest.approx(250.0)
    assert convergence.iterations_to_reach(curve, 9.0) == 50.0  # below it from the start
    assert convergence.iterations_to_reach(curve, 4.4) is None  # never reached
    # a curve that rises again: its first descent counts, 50 + (8 - 5.2) / (8 - 5) x 50
    bumpy = [(50, 8.0), (100, 5.0), (200, 5.5), (300, 4.0)]
    assert convergence.iterations_to_reach(bumpy, 5.2) == pytest.approx(50 + 2.8 / 3 * 50)


def test_matches_recover_a_known_iteration_ratio_and_time_to_loss():
    """A schedule whose loss at t is the reference's at 0.8 t (the paper's 20%) on any falling
    curve f: the reference needs 0.8 t iterations for it at every checkpoint (t = 250, 500,
    750, 1000 of 1000), and at 100 ms/iteration against the reference's 150 the reference's
    time over the schedule's is 0.8 x 150 / 100 = 1.2."""
    import math

    convergence = _tool("convergence")

    def f(i):
        return 3.0 + 5.0 * math.exp(-i / 400)

    reference = [(i, f(i)) for i in range(50, 1001, 50)]
    schedule = [(t, f(0.8 * t)) for t in range(125, 1001, 125)]  # 0.8 t: reference's points
    matches = convergence.match_losses("2bw", schedule, 100.0, reference, 150.0)
    assert [m.iteration for m in matches] == [250, 500, 750, 1000]
    for m in matches:
        assert m.reference_iterations == pytest.approx(0.8 * m.iteration)
        assert m.iteration_ratio == pytest.approx(0.8)
        assert m.seconds == pytest.approx(m.iteration * 0.1)
        assert m.time_ratio == pytest.approx(1.2)
        assert not m.reference_bound
    slower = convergence.match_losses("2bw", [(1000, 2.9)], 100.0, reference, 150.0)
    assert slower[0].reference_iterations is None and slower[0].time_ratio is None
    table = convergence.format_matches(matches + slower, "flush", {"2bw": 100.0})
    assert "not reached" in table and " 0.80 " in table and " 1.20" in table


def test_checkpoints_and_median_time_per_iteration():
    convergence = _tool("convergence")
    # quarters of 600: the first validations at or after 150, 300, 450, 600
    assert convergence.checkpoints(list(range(60, 601, 60))) == [180, 300, 480, 600]
    records = [IterationRecord(10 * k, 50, ms, 5.0) for k, ms in
               enumerate((900.0, 100.0, 120.0, 110.0, 500.0), 1)]
    # the first (start-up) and last (drain) intervals are left out: median(100, 120, 110)
    assert convergence.ms_per_iteration(ParsedLog(iterations=records)) == 110.0


def test_epochs_count_the_training_split_as_megatron_core_cuts_it(tmp_path):
    """20 documents of 10 + k tokens, --split 90,10,0: the training split holds documents
    0..17 (round(0.9 x 20) = 18), sum(10 + k for k < 18) = 333 tokens; 3 iterations of 4
    sequences of 37 tokens read 444 of them: 444 / 333 epochs."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    convergence = _tool("convergence")
    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for k in range(20):
        builder.add_document(numpy.arange(10 + k, dtype=numpy.int32), [10 + k])
    builder.finalize(prefix + ".idx")
    tokens = convergence.train_split_tokens(prefix, "90,10,0")
    assert tokens == sum(10 + k for k in range(18)) == 333
    assert convergence.epochs_covered(3, 4, 37, tokens) == pytest.approx(444 / 333)


def test_markdown_rows_mark_a_run_that_ends_below_the_reference():
    """The markdown row of a run whose last loss the reference never reaches says "> 1" (it
    beat the reference), not "-", which stands for the reference itself; a reached loss gives
    its ratio, 0.8 by the construction of the test above."""
    import math

    convergence = _tool("convergence")

    def f(i):
        return 3.0 + 5.0 * math.exp(-i / 400)

    reference = [(i, f(i)) for i in range(50, 1001, 50)]
    behind = convergence.match_losses("2bw", [(1000, f(800))], 100.0, reference, 150.0)
    ahead = convergence.match_losses("2bw-ef", [(1000, 2.9)], 100.0, reference, 150.0)
    finals = {"flush": {"valid": f(1000)}, "2bw": {"valid": f(800)}, "2bw-ef": {"valid": 2.9}}
    rows = convergence.markdown_rows(finals, behind + ahead, behind + ahead)
    assert rows[0].startswith("| flush | ") and rows[0].endswith("| - | - | - | - |")
    assert "| 0.80 | 1.20 | 0.80 | 1.20 |" in rows[1]
    assert rows[2] == "| 2bw-ef | 2.900 | > 1 | - | > 1 | - |"


def test_speedups_given_leave_an_unmeasured_run_without_a_time_ratio():
    """With --speedup, a run's time is the reference's logged ms over its speed; a run with no
    speed given gets no time ratio (its own logged ms would mix two measurements)."""
    convergence = _tool("convergence")
    ms = convergence._with_speedups({"flush": 200.0, "2bw": 150.0, "2bw-dc": 120.0},
                                    {"2bw": 1.25}, "flush")
    assert ms["flush"] == 200.0 and ms["2bw"] == 160.0
    reference = [(i, 10.0 - i / 100) for i in range(100, 1001, 100)]
    (unmeasured,) = convergence.match_losses("2bw-dc", [(1000, 5.0)], ms["2bw-dc"], reference,
                                             ms["flush"], fractions=(1.0,))
    assert unmeasured.iteration_ratio == 0.5 and unmeasured.time_ratio is None
    (measured,) = convergence.match_losses("2bw", [(1000, 5.0)], ms["2bw"], reference,
                                           ms["flush"], fractions=(1.0,))
    assert measured.time_ratio == pytest.approx(0.5 * 1.25)
    rows = convergence.markdown_rows({"2bw-dc": {"valid": 5.0}}, [unmeasured], [])
    assert rows == ["| 2bw-dc | 5.000 | 0.50 | - | - | - |"]
    row = next(line for line in convergence.format_matches([unmeasured], "flush", ms).splitlines()
               if line.startswith("2bw-dc"))
    assert row.split()[1] == "-" and row.split()[-1] == "-", row
