"""Observability as Megatron-LM has it: TensorBoard scalars, megatron-core timers, the log line.

Two tiny GPT runs on 2 CPU processes (PP=2) write TensorBoard event files, read back with
tensorboard's ``EventAccumulator``. References written in this file from Megatron-LM
core_v0.16.1: the tag names and timers of ``training_log()`` / ``evaluate_and_print_results()``,
the text log line as a regex, 'lm loss' equal to the text log's losses, and the learning rate
derived from the flags. Guards: tools reading Megatron-LM's logs read ours. Where each reference
comes from: docs/testing.md, "What each test module checks", test_observability.py.
"""

from __future__ import annotations

import importlib.util
import math
import re

import pytest

from megatron_2bw.logparse import parse_iteration, parse_log, parse_validation
from tests import dist as launch

# ---- Megatron-LM's tags (training.py, training_log, core_v0.16.1) --------------------------
# every --tensorboard-log-interval iterations, in the order training_log writes them:
TAGS_EVERY_ITERATION = [
    "learning-rate", "learning-rate vs samples",          # learning_rate is not None
    "batch-size", "batch-size vs samples",
    "lm loss", "lm loss vs samples",                      # for key in loss_dict
    "loss-scale", "loss-scale vs samples",                # args.log_loss_scale_to_tensorboard
    "world-size", "world-size vs samples",                # --log-world-size-to-tensorboard
    "grad-norm", "grad-norm vs samples",                  # grad_norm is not None
    "num-zeros", "num-zeros vs samples",                  # --log-num-zeros-in-grad
    "params-norm", "params-norm vs samples",              # --log-params-norm
]
# --log-memory-to-tensorboard: four torch.cuda.memory_stats() tags; a CPU process has only the
# current and the peak resident set (logs.memory_scalars), so the CPU runs write these two:
MEMORY_TAGS_CUDA = ["mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes",
                    "mem-allocated-count"]
MEMORY_TAGS_CPU = ["mem-allocated-bytes", "mem-max-allocated-bytes"]
# every --log-interval iterations, with --log-timers-to-tensorboard:
TAGS_EVERY_LOG_LINE = ["iteration-time",
                       "throughput"]                      # and --log-throughput
# evaluate_and_print_results: '{key} validation{suffix}' (+ ppl with
# --log-validation-ppl-to-tensorboard), each also 'vs samples'
VALIDATION_TAGS = ["lm loss validation", "lm loss validation vs samples",
                   "lm loss validation ppl", "lm loss validation ppl vs samples"]
TIMERS_LEVEL_1 = ["forward-backward", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
                  "all-grads-sync", "params-all-gather", "optimizer-copy-to-main-grad",
                  "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
                  "optimizer-count-zeros", "optimizer-inner-step",
                  "optimizer-copy-main-to-model-params", "optimizer"]
TIMERS_LEVEL_2 = ["batch-generator", "forward-compute", "backward-compute", "forward-recv",
                  "forward-send", "backward-recv", "backward-send", "forward-send-forward-recv",
                  "forward-send-backward-recv", "backward-send-forward-recv",
                  "backward-send-backward-recv", "forward-backward-send-forward-backward-recv"]
OUR_SCHEDULE_TAGS = ["pipeline-bubble-fraction", "weight-versions"]

# training_log's log_string, field by field (optional fields as training_log's `if`s), then ours
_E = r"-?\d\.\d{6}E[-+]\d\d"
MEGATRON_LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\]"
    r" iteration (?P<it>[ \d]{8})/(?P<iters>[ \d]{8}) \|"
    r" consumed samples: (?P<samples>[ \d]{12}) \|"
    r" elapsed time per iteration \(ms\): (?P<ms>\d+\.\d) \|"
    r"(?: throughput per GPU \(TFLOP/s/GPU\): (?P<tflops>\d+\.\d) \|)?"
    rf" learning rate: (?P<lr>{_E}) \|"
    r" global batch size: (?P<batch>[ \d]{5}) \|"
    rf" lm loss: (?P<loss>{_E}) \|"
    r" loss scale: (?P<scale>\d+\.\d) \|"
    r"(?: grad norm: (?P<grad>\d+\.\d{3}) \|)?"
    r"(?: num zeros: (?P<zeros>[\d.]+) \|)?"
    r"(?: params norm: (?P<params>\d+\.\d{3}) \|)?"
    r" number of skipped iterations: (?P<skipped>[ \d]{3}) \|"
    r" number of nan iterations: (?P<nan>[ \d]{3}) \|"
    # ours, after Megatron-LM's fields:
    r" samples/s: [\d.]+ \| tokens/s: \d+ \| TFLOP/s per device: [\d.]+ \|"
    r" peak memory \(MiB\): \d+ \| ETA: \d+h\d\dm\d\ds \|$")

LR, MIN_LR, WARMUP, DECAY_ITERS, TRAIN_ITERS, BATCH = 1e-3, 1e-4, 2, 8, 6, 16


def _lr(step: int) -> float:
    """Warm-up: lr * step / warmup; then cosine: min + (max - min) * (1 + cos(pi * r)) / 2 with
    r = (step - warmup) / (decay - warmup)."""
    if step <= WARMUP:
        return LR * step / WARMUP
    ratio = (step - WARMUP) / (DECAY_ITERS - WARMUP)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1.0 + math.cos(math.pi * ratio))


def _flags(tmp, schedule: str, *extra: str) -> list[str]:
    return ["pretrain_gpt_2bw.py", "--cpu", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
            "--micro-batch-size", "4",
            "--global-batch-size", str(BATCH), "--mock-data", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--seed", "1234", "--train-iters", str(TRAIN_ITERS),
            "--lr", str(LR), "--min-lr", str(MIN_LR), "--lr-warmup-iters", str(WARMUP),
            "--lr-decay-iters", str(DECAY_ITERS), "--lr-decay-style", "cosine",
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
            "--distributed-timeout-minutes", "2", "--tensorboard-dir", str(tmp / "tb"),
            "--log-timers-to-tensorboard", *extra]


class Run:
    def __init__(self, result: launch.Launch, tb_dir):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        assert result.returncode == 0, result.tail(60)
        self.output = result.output
        events = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
        events.Reload()
        self.scalars = {tag: {e.step: e.value for e in events.Scalars(tag)}
                        for tag in events.Tags()["scalars"]}
        self.lines = [line for line in self.output.splitlines() if parse_iteration(line)]
        self.log = parse_log(self.output)


@pytest.fixture(scope="module")
def run_2bw(tmp_path_factory) -> Run:
    """2BW with its deferred step; everything on; a line every 2 iterations, a validation at 3
    and 6 (the end)."""
    tmp = tmp_path_factory.mktemp("obs2bw")
    flags = _flags(tmp, "2bw", "--log-interval", "2", "--eval-interval", "3", "--eval-iters", "1",
                   "--timing-log-level", "2", "--log-throughput", "--log-params-norm",
                   "--log-num-zeros-in-grad", "--log-memory-to-tensorboard",
                   "--log-world-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
                   "--wandb-project", "obs-test", "--wandb-exp-name", "tiny",
                   "--wandb-save-dir", str(tmp / "wandb"))
    return Run(launch.torchrun(flags, nproc=2, timeout=240, WANDB_MODE="offline"), tmp / "tb")


@pytest.fixture(scope="module")
def run_megatron(tmp_path_factory) -> Run:
    """megatron-core's own schedule (it starts 'forward-backward' itself), the step in place:
    zeros counted; scalars every 2 iterations, a line every 3, timers of level 1 only."""
    tmp = tmp_path_factory.mktemp("obsmegatron")
    flags = _flags(tmp, "megatron", "--log-interval", "3", "--tensorboard-log-interval", "2",
                   "--eval-iters", "0", "--timing-log-level", "1", "--log-num-zeros-in-grad")
    return Run(launch.torchrun(flags, nproc=2, timeout=240), tmp / "tb")


def _timer_tags(run: Run) -> set[str]:
    return {tag for tag in run.scalars if tag.endswith("-time") and tag != "iteration-time"}


# ---- tag names -----------------------------------------------------------------------------------

def test_2bw_run_writes_megatron_lms_tags(run_2bw):
    deferred = [t for t in TAGS_EVERY_ITERATION if not t.startswith("num-zeros")]
    expected = {*deferred, *MEMORY_TAGS_CPU, *TAGS_EVERY_LOG_LINE, *VALIDATION_TAGS,
                *OUR_SCHEDULE_TAGS}
    timers = _timer_tags(run_2bw)
    assert set(run_2bw.scalars) - timers == expected
    # Timers.write's '<name>-time' for timers of levels 1-2 that ran on some rank
    assert timers <= {f"{name}-time" for name in TIMERS_LEVEL_1 + TIMERS_LEVEL_2}
    assert {"forward-backward-time", "optimizer-time", "forward-compute-time",
            "backward-compute-time"} <= timers
    # the deferred 2BW step counts no zeros, and says so once at the start
    assert "--log-num-zeros-in-grad: not counted where the optimizer step is deferred" \
        in run_2bw.output


def test_megatron_schedule_writes_num_zeros_and_level_1_timers_only(run_megatron):
    expected = {t for t in TAGS_EVERY_ITERATION
                if not t.startswith(("world-size", "params-norm"))} | {"iteration-time"}
    timers = _timer_tags(run_megatron)
    assert set(run_megatron.scalars) - timers == expected
    assert {"forward-backward-time", "optimizer-time", "optimizer-count-zeros-time"} <= timers
    assert timers <= {f"{name}-time" for name in TIMERS_LEVEL_1}
    # per-iteration scalars every --tensorboard-log-interval, timers every --log-interval
    assert sorted(run_megatron.scalars["num-zeros"]) == [2, 4, 6]
    assert sorted(run_megatron.scalars["learning-rate"]) == [2, 4, 6]
    assert sorted(run_megatron.scalars["iteration-time"]) == [3, 6]
    assert sorted(run_megatron.scalars["forward-backward-time"]) == [3, 6]


# ---- values --------------------------------------------------------------------------------------

def test_lm_loss_scalars_average_to_the_text_log(run_2bw):
    tb = run_2bw.scalars["lm loss"]
    assert sorted(tb) == list(range(1, TRAIN_ITERS + 1))
    records = {r.iteration: r for r in run_2bw.log.iterations}
    assert sorted(records) == [2, 4, 6]
    for it, record in records.items():
        assert record.loss == pytest.approx((tb[it - 1] + tb[it]) / 2, rel=2e-6)
    vs_samples = run_2bw.scalars["lm loss vs samples"]
    assert vs_samples == {BATCH * it: loss for it, loss in tb.items()}


def test_learning_rate_follows_warmup_then_cosine(run_2bw):
    lr = run_2bw.scalars["learning-rate"]
    for step in range(1, TRAIN_ITERS + 1):
        assert lr[step] == pytest.approx(_lr(step), rel=1e-6), step
    assert run_2bw.scalars["learning-rate vs samples"][BATCH * 4] == pytest.approx(_lr(4))
    for record in run_2bw.log.iterations:  # the line prints the same value (7 digits)
        assert record.learning_rate == pytest.approx(_lr(record.iteration), rel=1e-6)


def test_interval_scalars_match_the_text_log(run_2bw):
    s = run_2bw.scalars
    for record in run_2bw.log.iterations:
        it = record.iteration
        assert s["iteration-time"][it] * 1000 == pytest.approx(record.ms_per_iteration, abs=0.051)
        assert s["grad-norm"][it] == pytest.approx(record.grad_norm, abs=6e-4)
        assert s["throughput"][it] == pytest.approx(record.tflops_per_device, rel=1e-3, abs=1e-4)
        assert s["batch-size"][it] == BATCH and s["world-size"][it] == 2
    # 2bw: version 0 and the first step's version 1 are alive from the first step on
    assert set(s["weight-versions"].values()) == {2.0}
    assert all(0.0 <= f < 1.0 for f in s["pipeline-bubble-fraction"].values())
    # megatron-core timers, seconds per iteration (normalizer --log-interval): compute is part
    # of forward-backward, forward-backward part of the iteration (the max over ranks of it
    # against the logging rank's iteration, summed over the intervals after the first: a
    # scheduling hiccup at an interval's edge skews one interval by up to a third on a loaded
    # machine; a wrong normalizer would be off by the interval's 2x)
    for it in (2, 4, 6):
        assert 0 < s["forward-compute-time"][it] < s["forward-backward-time"][it]
    forward_backward = sum(s["forward-backward-time"][it] for it in (4, 6))
    assert forward_backward < sum(s["iteration-time"][it] for it in (4, 6)) * 1.5


def test_validation_scalars_match_the_text_log(run_2bw):
    validations = {v.iteration: v.loss for v in run_2bw.log.valid()}
    assert sorted(validations) == [3, 6]
    tb, ppl = run_2bw.scalars["lm loss validation"], run_2bw.scalars["lm loss validation ppl"]
    for it, loss in validations.items():
        assert tb[it] == pytest.approx(loss, rel=2e-6)
        assert ppl[it] == pytest.approx(math.exp(loss), rel=1e-5)
        assert run_2bw.scalars["lm loss validation vs samples"][BATCH * it] == tb[it]


def test_num_zeros_in_the_line_and_the_scalars(run_megatron):
    zeros = {r.iteration: float(MEGATRON_LINE.match(line).group("zeros"))
             for r, line in zip(run_megatron.log.iterations, run_megatron.lines)}
    assert sorted(zeros) == [3, 6]
    assert zeros[6] == run_megatron.scalars["num-zeros"][6]


# ---- the line ------------------------------------------------------------------------------------

def test_log_lines_have_megatron_lms_fields_in_its_order(run_2bw, run_megatron):
    for run in (run_2bw, run_megatron):
        assert len(run.lines) == (2 if run is run_megatron else 3)
        for line, record in zip(run.lines, run.log.iterations):
            match = MEGATRON_LINE.match(line)
            assert match, f"not training_log's format:\n{line}"
            assert int(match["it"]) == record.iteration and int(match["iters"]) == TRAIN_ITERS
            assert int(match["samples"]) == BATCH * record.iteration
            assert int(match["batch"]) == BATCH and int(match["skipped"]) == 0
    assert all(MEGATRON_LINE.match(line)["tflops"] for line in run_2bw.lines)  # --log-throughput
    assert all(MEGATRON_LINE.match(line)["params"] for line in run_2bw.lines)  # --log-params-norm
    assert not any(MEGATRON_LINE.match(line)["tflops"] for line in run_megatron.lines)
    # the timers' block (training_log's timers.log) after each line
    assert run_megatron.output.count("(min, max) time across ranks (ms):") == 2
    assert "forward-compute ..." in run_2bw.output and "forward-compute" not in \
        run_megatron.output


def test_wandb_without_the_package_is_one_line(run_2bw):
    if importlib.util.find_spec("wandb") is None:
        assert run_2bw.output.count("--wandb-project obs-test given but the wandb package is not "
                                    "installed") == 1


def test_parser_reads_megatron_lms_own_lines():
    """Lines as training_log and evaluate_and_print_results print them (their format strings,
    filled in by hand): no samples/s, so it comes from the batch and the time."""
    line = (" [2026-01-01 10:00:00.123456] iteration      100/    1000 | consumed samples:"
            "         3200 | elapsed time per iteration (ms): 400.0 | throughput per GPU"
            " (TFLOP/s/GPU): 123.4 | learning rate: 2.500000E-04 | global batch size:    32 |"
            " lm loss: 4.250000E+00 | loss scale: 65536.0 | grad norm: 1.125 |"
            " number of skipped iterations:   1 | number of nan iterations:   0 |")
    r = parse_iteration(line)
    assert (r.iteration, r.train_iters, r.ms_per_iteration, r.loss) == (100, 1000, 400.0, 4.25)
    assert (r.samples_per_s, r.tflops_per_device, r.skipped) == (80.0, 123.4, 1)
    assert (r.learning_rate, r.grad_norm, r.loss_scale, r.eta_s) == (2.5e-4, 1.125, 65536.0, None)
    test = parse_validation(" validation loss at iteration 1000 on test set | lm loss value:"
                            " 4.000000E+00 | lm loss PPL: 5.459815E+01 | ")
    assert (test.split, test.iteration, test.loss) == ("test", 1000, 4.0)


def test_eta_is_the_remaining_iterations_at_this_pace():
    from megatron_2bw.training.logs import IterationLog

    line = IterationLog(iteration=30, train_iters=2000, seconds_per_iteration=1.6, lr=3e-4,
                        loss=5.25, grad_norm=None, consumed_samples=960, global_batch_size=32,
                        seq_length=128, flops_per_iteration=1e12, world_size=2,
                        peak_mem_mib=700.0).line()
    assert MEGATRON_LINE.match(line)
    assert " ETA: 0h52m32s |" in line  # 1970 x 1.6 s = 3152 s
    assert parse_iteration(line).eta_s == 3152.0


def test_every_loss_of_the_loss_dict_is_printed_and_written(tmp_path, capsys):
    """BERT's loss dict {"lm loss", "sop loss"}: training_log prints ' {key}: {avg:.6E} |' for
    each key in the dict's order, between the batch size and the loss scale, and writes each key
    (+ ' vs samples'); evaluate_and_print_results prints '{key} value: {:.6E} | {key} PPL:
    {:.6E} | ' for each and writes '{key} validation' (+ ' vs samples'). The values below are
    written out by hand in those formats."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_2bw.training.logs import IterationLog, Logger, LogFlags, StepStats

    line = IterationLog(iteration=30, train_iters=100, seconds_per_iteration=1.6, lr=3e-4,
                        loss=5.25, grad_norm=None, consumed_samples=960, global_batch_size=32,
                        seq_length=128, flops_per_iteration=1e12, world_size=2,
                        peak_mem_mib=700.0, losses={"lm loss": 5.25, "sop loss": 0.6875}).line()
    assert " global batch size:    32 | lm loss: 5.250000E+00 | sop loss: 6.875000E-01 |" \
           " loss scale: 1.0 |" in line
    assert parse_iteration(line).loss == 5.25
    logger = Logger(True, str(tmp_path), LogFlags())
    logger.step(StepStats(30, 960, 3e-4, 32, {"lm loss": 5.25, "sop loss": 0.6875}, 1.0, 2))
    logger.validation(30, {"lm loss": 4.0, "sop loss": 0.5}, consumed_samples=960)
    logger.close()
    printed = capsys.readouterr().out.splitlines()
    text = (" validation loss at iteration 30 | lm loss value: 4.000000E+00 | lm loss PPL: "
            "5.459815E+01 | sop loss value: 5.000000E-01 | sop loss PPL: 1.648721E+00 | ")
    assert printed[-3:] == ["-" * (len(text) + 1), text, "-" * (len(text) + 1)]
    assert parse_validation(text).loss == 4.0
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)}
               for tag in events.Tags()["scalars"]}
    assert scalars["sop loss"] == {30: 0.6875} and scalars["sop loss vs samples"] == {960: 0.6875}
    assert scalars["sop loss validation"] == {30: 0.5}
    assert scalars["sop loss validation vs samples"] == {960: 0.5}
    assert scalars["lm loss validation"] == {30: 4.0}
