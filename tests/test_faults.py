"""Divergence and pre-emption end a run cleanly (``megatron_2bw/training/guard.py``).

References: the divergence rules as a table (fp32/bf16 and fp16 with dynamic loss scaling), and
real 2-stage runs made to diverge, signalled with SIGTERM, frozen with SIGSTOP, or given
missing, truncated or garbage checkpoints. Guards: every rank ends with the documented exit code
and one line naming the cause, no checkpoint holds non-finite weights or is left partial, and an
unreadable newest checkpoint falls back to the previous one (never a guess). Each case:
docs/testing.md, "What each test module checks", test_faults.py; the behaviour:
docs/checkpoints_and_faults.md.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time

import pytest

from megatron_2bw.training.guard import NONFINITE_LOSSES, local_divergence
from tests import dist as launch

NAN, INF = math.nan, math.inf
LOSS, GRAD, SKIPS, FP16_LOSSES = 1, 2, 3, 5  # guard's flag indices

TINY = ["--cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--lr", "1e-3",
        "--micro-batch-size", "4", "--global-batch-size", "16",
        "--mock-data", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
        "--log-interval", "1", "--eval-iters", "0", "--distributed-timeout-minutes", "1"]


@pytest.mark.parametrize("loss, grad_norm, skipped, run_of_skips, fp16, expected", [
    (6.9, 0.8, False, 0, False, None),
    (NAN, 0.8, False, 0, False, LOSS),
    (INF, None, False, 0, False, LOSS),
    (None, NAN, False, 0, False, GRAD),      # a stage without the loss sees the norm
    (None, None, False, 0, False, None),
    (NAN, None, True, 3, True, None),        # fp16: overflow skips are normal ...
    (None, None, True, 999, True, None),
    (None, None, True, 1000, True, SKIPS),   # ... until a whole window of them
])
def test_divergence_rules(loss, grad_norm, skipped, run_of_skips, fp16, expected):
    assert local_divergence(loss, grad_norm, skipped, run_of_skips, fp16, 1000) == expected


@pytest.mark.parametrize("losses_in_a_row, expected", [(0, None), (2, None), (3, FP16_LOSSES)])
def test_fp16_ends_after_three_non_finite_losses_in_a_row(losses_in_a_row, expected):
    """The loss scale acts on the backward only: a forward that overflows three times running
    cannot be brought back by it."""
    assert NONFINITE_LOSSES == 3
    assert local_divergence(NAN, None, True, 3, True, 1000, losses_in_a_row) == expected


def _divergence(result: launch.Launch) -> tuple[int, str, dict[int, str]]:
    """(the iteration, what was not finite) of the run's divergence line, which every rank
    that got to print says alike (torchrun stops the others once one exits), and the logged
    losses by iteration."""
    errors = re.findall(r"^error: iteration (\d+): the (loss|gradient norm|weights) (?:is|are) "
                        r"not finite \(NaN or inf\)[^\n]*; training stopped without saving",
                        result.output, re.MULTILINE)
    assert errors and len(set(errors)) == 1, result.tail()
    logged = {int(i): loss.lower() for i, loss in
              re.findall(r"iteration +(\d+)/ +\d+ .*?lm loss: (\S+)", result.output)}
    return int(errors[0][0]), errors[0][1], logged


def test_nonfinite_weights_flag():
    """1 where any tensor holds a NaN or inf, across dtypes; a large finite fp16 tensor (whose
    sum of squares would overflow) is finite. The flag comes back through LateFlags."""
    import torch

    from megatron_2bw.training.guard import LateFlags, nonfinite

    finite = [torch.full((64,), 6e4, dtype=torch.float16), torch.randn(3, 5)]
    cases = {"finite": (finite, 0.0),
             "nan": ([*finite, torch.tensor([1.0, NAN])], 1.0),
             "inf fp16": ([finite[1], torch.tensor([INF], dtype=torch.float16)], 1.0),
             "-inf": ([torch.tensor([-INF, 0.0])], 1.0)}
    late = LateFlags()
    for name, (tensors, expected) in cases.items():
        late.record(7, nonfinite(tensors))
        assert late.take() == (7, torch.tensor(expected)), name
        assert late.take() is None


def test_a_diverging_run_stops_without_saving(tmp_path):
    """--lr 1e30: the weights of step 2 are not finite (2BW applies a step when the next
    batch reads it, or before a save): no checkpoint holds them."""
    save = tmp_path / "checkpoints"
    result = launch.torchrun(["pretrain_gpt_2bw.py", *TINY, "--train-iters", "20",
                              "--lr", "1e30", "--save", str(save), "--save-interval", "1"],
                             2, timeout=240)
    assert result.returncode != 0, result.tail()
    diverged, what, logged = _divergence(result)
    nonfinite = [i for i, loss in logged.items() if loss in ("nan", "inf")]
    if what == "weights":  # made by step `diverged`: the losses up to it are finite
        assert all(i > diverged for i in nonfinite), (diverged, logged)
    else:
        assert diverged == min(nonfinite), (diverged, logged)
    saved = sorted(int(p.name[len("iter_"):]) for p in save.glob("iter_*"))
    assert saved and max(saved) < diverged, (saved, diverged)
    assert int((save / "latest_checkpointed_iteration.txt").read_text()) == max(saved)
    assert not list(save.glob("*tmp*")), list(save.iterdir())
    _assert_finite_checkpoint(save, max(saved))


def test_fp16_that_cannot_recover_stops_without_saving(tmp_path):
    """--fp16 --lr 100 (dynamic loss scaling from 2^32): overflowing gradients skip the first
    steps, two steps succeed, and from then on the forward overflows (the weights are finite
    but huge) and every step is skipped. The run ends with exit 1 and one line on the third
    non-finite loss in a row; the checkpoints before the first are kept (every 5
    iterations), none is written after it."""
    save = tmp_path / "checkpoints"
    result = launch.torchrun(["pretrain_gpt_2bw.py", *TINY, "--pipeline-schedule", "megatron",
                              "--fp16", "--lr", "100", "--train-iters", "40", "--save",
                              str(save), "--save-interval", "5"], 2, timeout=240)
    assert result.returncode == 1, result.tail()
    diverged, what, logged = _divergence(result)
    first_nan = min(i for i, loss in logged.items() if loss in ("nan", "inf"))
    assert what == "loss" and diverged == first_nan + NONFINITE_LOSSES - 1, (diverged, logged)
    assert f"in {NONFINITE_LOSSES} consecutive iterations" in result.output, result.tail()
    saved = sorted(int(p.name[len("iter_"):]) for p in save.glob("iter_*"))
    assert saved and max(saved) < first_nan, (saved, first_nan)
    _assert_finite_checkpoint(save, max(saved))


def test_fp16_with_a_few_skipped_steps_at_the_start_trains(tmp_path):
    """--fp16 from loss scale 2^22: the first steps overflow and are skipped (another now and
    then), the scale comes to fit and the loss falls; the run ends normally."""
    result = launch.torchrun(["pretrain_gpt_2bw.py", *TINY, "--fp16", "--initial-loss-scale",
                              str(2 ** 22), "--lr", "5e-3", "--train-iters", "12"], 2,
                             timeout=240)
    assert result.returncode == 0, result.tail()
    skipped = [int(i) for i in re.findall(
        r"iteration +(\d+)/ +\d+ .*?number of skipped iterations: +1 ", result.output)]
    logged = {int(i): float(loss) for i, loss in
              re.findall(r"iteration +(\d+)/ +\d+ .*?lm loss: (\S+)", result.output)}
    assert skipped[:2] == [1, 2] and len(skipped) <= 6, skipped  # skips, then mostly steps
    assert sorted(logged) == list(range(1, 13)), result.tail()
    assert all(math.isfinite(loss) for loss in logged.values()), logged
    assert logged[12] < logged[1] - 0.1, logged


def _assert_finite_checkpoint(root, iteration: int) -> None:
    """Every floating-point tensor of the checkpoint (weights, both 2BW versions, optimizer
    state) is finite, read offline."""
    import torch

    from tests.test_training import _saved_tensors

    tensors = _saved_tensors(root, iteration, "")
    broken = [key for key, t in tensors.items() if isinstance(t, torch.Tensor)
              and t.is_floating_point() and not torch.isfinite(t).all()]
    assert not broken, f"iteration {iteration}'s checkpoint holds non-finite {broken[:4]}"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _long_run(tmp_path, *flags: str) -> tuple[subprocess.Popen, "os.PathLike"]:
    """A 2-process torchrun of a run far longer than the test, in its own session, returned
    once it logged iteration 5 (its two workers are the launcher's children). Every process
    of the run inherits MEGATRON_2BW_TEST_TAG=<the log's path>, to find it after its parent
    is gone (see :func:`tests.dist.tagged_processes`)."""
    command = [launch.TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(launch.free_port()), "pretrain_gpt_2bw.py",
               *TINY, "--train-iters", "100000", "--lr", "1e-4", *flags]
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=launch.REPO,
                                   env=launch.subprocess_env(MEGATRON_2BW_TEST_TAG=str(log)),
                                   stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + 180
    while not re.search(r"iteration +5/", log.read_text()):
        if process.poll() is not None or time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError(log.read_text()[-3000:])
        time.sleep(0.2)
    return process, log


def test_sigterm_saves_within_two_iterations_and_exits_zero(tmp_path):
    save = tmp_path / "checkpoints"
    process, log = _long_run(tmp_path, "--save", str(save), "--save-interval", "100000")
    try:
        workers = _children(process.pid)
        assert len(workers) == 2, workers
        os.kill(max(workers), signal.SIGTERM)  # one rank; the other learns it from the flags
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0, text[-3000:]
    stopped = re.search(r"stopping at iteration (\d+) \((SIGTERM|a stop signal on another "
                        r"rank)\)", text)
    assert stopped, text[-3000:]
    iteration = int(stopped.group(1))
    # the rank that got the signal posts its flag at the end of iteration s; the flag is read
    # one iteration later, and the next (drained) iteration is the last: at most s + 2
    received = re.search(r"stop requested \(SIGTERM\) on rank \d by the end of iteration "
                         r"(\d+)", text)
    assert received, text[-3000:]
    signalled_at = int(received.group(1))
    assert signalled_at < iteration <= signalled_at + 2, (signalled_at, iteration)
    assert f"saved checkpoint at iteration {iteration} to " in text
    assert int((save / "latest_checkpointed_iteration.txt").read_text()) == iteration


def test_exit_duration_saves_and_exits_zero(tmp_path):
    """--exit-duration-in-mins 0.1 on a run of 100000 iterations (Megatron-LM's flag): after
    about 6 s every rank stops at the same iteration, saves it and exits 0."""
    save = tmp_path / "checkpoints"
    started = time.monotonic()
    result = launch.torchrun(["pretrain_gpt_2bw.py", *TINY, "--train-iters", "100000",
                              "--exit-duration-in-mins", "0.1", "--save", str(save),
                              "--exit-signal-handler"], 2, timeout=180)
    assert result.returncode == 0, result.tail()
    stopped = re.search(r"stopping at iteration (\d+) \((--exit-duration-in-mins 0.1 reached|a "
                        r"stop signal on another rank)\)", result.output)
    assert stopped, result.tail()
    assert time.monotonic() - started >= 6
    assert int((save / "latest_checkpointed_iteration.txt").read_text()) == int(stopped.group(1))


def test_a_killed_rank_ends_the_run_without_stray_processes(tmp_path):
    """kill -9 of one worker mid-training (saving every 3 iterations, so megatron-core's
    checkpoint writer processes come and go): the launcher exits non-zero within a minute and
    no process of the run (the other worker, checkpoint writers, their queue's server) outlives
    it, wherever it was reparented."""
    process, log = _long_run(tmp_path, "--save", str(tmp_path / "checkpoints"),
                             "--save-interval", "3")
    tag = str(log)
    try:
        workers = _children(process.pid)
        assert len(workers) == 2, workers
        os.kill(min(workers), signal.SIGKILL)
        code = process.wait(timeout=60)
        deadline = time.monotonic() + 30
        while launch.tagged_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        strays = launch.tagged_processes(tag)
    finally:
        for pid in launch.tagged_processes(tag):
            os.kill(pid, signal.SIGKILL)
    assert code != 0, log.read_text()[-3000:]
    assert strays == [], strays
    text = log.read_text()  # the survivor, if it got to say anything, said one line
    assert not re.search(r'File ".*(megatron_2bw|pretrain_gpt_2bw)', text), text[-3000:]
    tracker = tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt"
    if tracker.exists():  # whatever the kill interrupted, the tracker names a whole checkpoint
        named = tmp_path / "checkpoints" / f"iter_{int(tracker.read_text()):07d}"
        assert (named / "metadata.json").is_file() and (named / ".metadata").is_file()


# ---- checkpoints ------------------------------------------------------------------------------

_SAVE_QUEUE_HANDOVER = """
import queue, sys
from megatron_2bw.runtime.lifetime import bind_helpers_to_this_process
from megatron.core.dist_checkpointing.strategies import filesystem_async
bind_helpers_to_this_process()
results = filesystem_async._get_write_results_queue()
late = 0
for i in range(200):
    results.put({0: [i]})
    try:
        got = results.get_nowait()
    except queue.Empty:
        late += 1
        got = results.get(timeout=10)
    assert got == {0: [i]}, got
print("late", late)
"""


def test_the_save_result_queue_hands_over_at_once(tmp_path):
    """A synchronous torch_dist save puts its writers' results into megatron-core's result
    queue and reads them back at once with ``get_nowait`` in the same process; a queue whose put
    lands later (a ``multiprocessing.Queue``'s feeder thread) failed saves under load with
    "results_queue should not be empty". After binding, 200 put/get_nowait pairs never miss."""
    script = tmp_path / "handover.py"  # a script: its launch forks (tests/dist.py)
    script.write_text(_SAVE_QUEUE_HANDOVER)
    result = launch.python([str(script)], timeout=60)
    assert result.returncode == 0, result.tail()
    assert "late 0" in result.output, result.tail()


def test_a_wrong_load_path_does_not_overwrite_another_run(tmp_path):
    """--load names an empty directory while --save holds a run: refused up front, one line,
    exit 2, the other run's tracker untouched; --overwrite-save is the way past it."""
    other = tmp_path / "other-run"
    (other / "iter_0000004").mkdir(parents=True)
    (other / "latest_checkpointed_iteration.txt").write_text("4")
    flags = [*TINY, "--train-iters", "1", "--save", str(other),
             "--load", str(tmp_path / "typo")]
    result = launch.python(["pretrain_gpt_2bw.py", *flags], timeout=60, WORLD_SIZE="2")
    assert result.returncode == 2, result.tail()
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --load: {tmp_path / 'typo'} holds no checkpoint, but --save "
                      f"{other} holds another run's (iteration 4): fix --load, or pass "
                      f"--overwrite-save to start from scratch there"], result.tail()
    assert "Traceback" not in result.output
    assert (other / "latest_checkpointed_iteration.txt").read_text() == "4"


NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A 2-stage 2BW run (TP=1 PP=2 DP=1, no dropout) saved at iterations 2 and 4; its log is
    ``run.log`` beside the checkpoint directory."""
    root = tmp_path_factory.mktemp("two_checkpoints") / "checkpoints"
    result = launch.torchrun(["pretrain_gpt_2bw.py", *TINY, *NO_DROPOUT, "--train-iters", "4",
                              "--lr", "1e-3", "--save", str(root), "--save-interval", "2"], 2,
                             timeout=240)
    assert result.returncode == 0, result.tail()
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    (root.parent / "run.log").write_text(result.output)
    return root


def _losses(output: str) -> dict[int, float]:
    return {int(i): float(loss) for i, loss in
            re.findall(r"iteration +(\d+)/ +\d+ \|.*?lm loss: (\S+) \|", output)}


@pytest.mark.parametrize("layout", [["--pipeline-model-parallel-size", "1"],
                                    ["--pipeline-model-parallel-size", "1",
                                     "--tensor-model-parallel-size", "2"]],
                         ids=["TP1-PP1-DP2", "TP2-PP1-DP1"])
def test_a_checkpoint_resumes_with_another_layout(two_checkpoints, tmp_path, layout):
    """The iteration-2 checkpoint of the PP=2 run, loaded at another layout: model, optimizer
    and 2BW's older weight version are resharded by dist_checkpointing, the RNG state is
    re-seeded with a warning, and iterations 3 and 4 give the uninterrupted PP=2 run's losses
    to fp32 rounding (without dropout, 2BW's losses do not depend on the layout)."""
    import shutil

    root = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints / "iter_0000002", root / "iter_0000002")
    (root / "latest_checkpointed_iteration.txt").write_text("2")
    result = launch.torchrun(["pretrain_gpt_2bw.py", *TINY, *NO_DROPOUT, *layout,
                              "--train-iters", "4", "--lr", "1e-3", "--load", str(root)], 2,
                             timeout=240)
    assert result.returncode == 0, result.tail()
    assert re.search(r"warning: \S+iter_0000002 was saved with TP=1 PP=2 DP=1, this run is "
                     r"TP=\d PP=1 DP=\d: model and optimizer state resharded; RNG state "
                     r"re-seeded", result.output), result.tail()
    reference = _losses((two_checkpoints.parent / "run.log").read_text())
    resumed = _losses(result.output)
    assert sorted(resumed) == [3, 4], result.tail()
    for iteration in (3, 4):
        assert resumed[iteration] == pytest.approx(reference[iteration], rel=1e-5), iteration


def _break_metadata_json(path):
    (path / "metadata.json").unlink()


def _truncate_metadata(path):
    (path / ".metadata").write_bytes(b"")


@pytest.mark.parametrize("damage", [_break_metadata_json, _truncate_metadata])
def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous(two_checkpoints, tmp_path,
                                                                    damage):
    import shutil

    root = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints, root)
    damage(root / "iter_0000004")
    # --train-iters 6 schedules differently from the saved run's 4: the flags' schedule is used
    result = launch.torchrun(["pretrain_gpt_2bw.py", *TINY, "--train-iters", "6", "--lr",
                              "1e-3", "--load", str(root), "--override-opt_param-scheduler"], 2,
                             timeout=240)
    assert result.returncode == 0, result.tail()
    assert re.search(rf"warning: skipped unreadable checkpoint\(s\) {root}/iter_0000004 "
                     rf"\(.+\); loaded {root}/iter_0000002$", result.output, re.MULTILINE), \
        result.tail()
    assert f"resumed from {root} at iteration 2" in result.output
    assert re.search(r"iteration +3/ +6", result.output), result.tail()
    assert "Traceback" not in result.output, result.tail()  # torch's logged read failure


def test_a_tracker_file_of_garbage_is_refused(two_checkpoints, tmp_path):
    """A tracker file that holds neither an iteration number nor 'release': one line naming
    it on every rank that got to print, and nothing trained or loaded (Megatron-LM's
    read_metadata refuses it: "Invalid metadata file"), rather than some other checkpoint."""
    import shutil

    root = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints, root)
    tracker = root / "latest_checkpointed_iteration.txt"
    tracker.write_bytes(b"4\x00\x00garbage")
    result = launch.torchrun(["pretrain_gpt_2bw.py", *TINY, "--train-iters", "4", "--lr",
                              "1e-3", "--load", str(root)], 2, timeout=240)
    assert result.returncode != 0, result.tail()
    errors = set(re.findall(r"^error: --load: invalid tracker file (\S+): it holds .*, not an "
                            r"iteration number or 'release'", result.output, re.MULTILINE))
    assert errors == {str(tracker)}, result.tail()
    assert "resumed from" not in result.output, result.tail()
    assert not re.search(r"iteration +\d+/", result.output), result.tail()


def test_tracker_words():
    """An iteration number or 'release' (Megatron-LM's {root}/release), nothing else."""
    import tempfile

    from megatron_2bw.training.checkpointing import (RELEASE, CheckpointRefused,
                                                     checkpoint_dir, latest_iteration)

    root = tempfile.mkdtemp()
    assert latest_iteration(root) is None
    for text, expected in (("12\n", 12), ("release", RELEASE)):
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(text)
        assert latest_iteration(root) == expected
    assert checkpoint_dir(root, RELEASE) == os.path.join(root, "release")
    for text in ("", "-1", "3.0", "iter_0000003", "\u00b2"):
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(text)
        with pytest.raises(CheckpointRefused, match="invalid tracker file"):
            latest_iteration(root)


def test_a_checkpoint_without_every_version_key_is_refused_by_the_training_class():
    """The executor raises the error the training's loader catches to stop at this checkpoint
    (megatron_2bw.errors, also importable from checkpointing), not an older one tried next."""
    from megatron_2bw.schedules import executor
    from megatron_2bw.training.checkpointing import CheckpointRefused

    saved = {"twobw_older.layer.weight"}
    wanted = {"twobw_older.layer.weight": None, "twobw_older.layer.bias": None}
    with pytest.raises(CheckpointRefused, match=r"only some parameters \(1 key\(s\) missing, "
                                                r"e\.g\. twobw_older\.layer\.bias\)"):
        executor._require(wanted, saved, "ckpt/iter_0000002", "the older weight version")
    executor._require(wanted, saved | {"twobw_older.layer.bias"}, "ckpt", "the older version")


def test_no_readable_checkpoint_is_one_line(two_checkpoints, tmp_path):
    import shutil

    root = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints, root)
    for path in root.glob("iter_*"):
        _break_metadata_json(path)
    result = launch.torchrun(["pretrain_gpt_2bw.py", *TINY, "--train-iters", "6",
                              "--load", str(root)], 2, timeout=240)
    assert result.returncode != 0, result.tail()  # each rank exits 2; torchrun reports 1
    errors = re.findall(r"^error: --load: no readable checkpoint in (\S+): (\S+) ",
                        result.output, re.MULTILINE)
    # every rank that got to print (torchrun stops the others once one exits) says the same
    assert errors and set(errors) == {(str(root), f"{root}/iter_0000004")}, result.tail()


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """Rank 1 finds the disk full while writing the iteration-4 checkpoint (ENOSPC injected at
    the file layer by tests/fault_entry.py): every rank ends with the same line naming the
    failed save and the intact one, the partial directory is gone, the tracker still names
    iteration 2, and iteration 2 resumes."""
    root = tmp_path / "checkpoints"
    result = launch.torchrun(["tests/fault_entry.py", "pretrain_gpt_2bw.py", *TINY,
                              "--train-iters", "4", "--save", str(root), "--save-interval", "2"],
                             2, timeout=240, MEGATRON_2BW_TEST_ENOSPC="iter_0000004.tmp",
                             MEGATRON_2BW_TEST_ENOSPC_RANK="1")
    assert result.returncode != 0, result.tail()
    errors = set(re.findall(r"^error: .*$", result.output, re.MULTILINE))
    prefix = (f"error: --save: could not write the checkpoint of iteration 4 to "
              f"{root}/iter_0000004 (")
    suffix = "); the last complete checkpoint, iteration 2, is intact"
    assert errors and all(e.startswith(prefix) and e.endswith(suffix) for e in errors), errors
    reasons = {e[len(prefix):-len(suffix)] for e in errors}
    assert any("No space left on device" in r for r in reasons), reasons
    assert reasons <= {r for r in reasons if "No space left on device" in r} | {
        "it failed on another rank"}, reasons
    assert not re.search(r'File ".*(megatron_2bw|pretrain_gpt_2bw)', result.output), \
        result.tail()
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002",
                                                      "latest_checkpointed_iteration.txt"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "2"
    resumed = launch.torchrun(["pretrain_gpt_2bw.py", *TINY, "--train-iters", "3",
                               "--load", str(root), "--override-opt_param-scheduler"], 2,
                              timeout=240)
    assert resumed.returncode == 0, resumed.tail()
    assert f"resumed from {root} at iteration 2" in resumed.output


def _state_fails_on_rank_1_worker(rank: int, world: int, root: str) -> dict:
    from megatron_2bw.training.checkpointing import (CheckpointError, TrainState,
                                                     save_checkpoint)
    from tests.test_overlap import _build

    args, _, model, optimizer, scheduler, _, _ = _build(world, "megatron", [])

    def extra(sharded: dict) -> None:  # a schedule's own entries, unavailable on rank 1
        if rank == 1:
            raise RuntimeError("rank 1 has no second weight version")

    started = time.monotonic()
    try:
        save_checkpoint(root, model, optimizer, scheduler, TrainState(iteration=3), args,
                        extra=extra)
    except CheckpointError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    return {"error": None}


def test_a_state_that_fails_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    """Rank 1 cannot build its state dict (before any of dist_checkpointing's collectives, which
    rank 0 would enter and wait in until the process-group timeout): both ranks raise
    CheckpointError within seconds, rank 1 naming its cause and rank 0 "another rank", and
    no directory of the failed save remains."""
    root = tmp_path / "checkpoints"
    results = launch.spawn(_state_fails_on_rank_1_worker, 2, str(root), out_dir=tmp_path / "out",
                           timeout=50)
    prefix = f"--save: could not write the checkpoint of iteration 3 to {root}/iter_0000003 ("
    suffix = "); no earlier checkpoint exists"
    assert results[1]["error"] == f"{prefix}RuntimeError: rank 1 has no second weight version" \
                                  f"{suffix}", results
    assert results[0]["error"] == f"{prefix}it failed on another rank{suffix}", results
    assert all(r["seconds"] < 20 for r in results), results
    assert list(root.iterdir()) == [], list(root.iterdir())


def test_ckpt_keep_keeps_the_newest(tmp_path):
    """--ckpt-keep 2 with a save every iteration: after 4 iterations iterations 3 and 4 remain,
    the tracker names 4."""
    root = tmp_path / "checkpoints"
    result = launch.torchrun(["pretrain_gpt_2bw.py", *TINY, "--train-iters", "4", "--save",
                              str(root), "--save-interval", "1", "--ckpt-keep", "2"], 2,
                             timeout=240)
    assert result.returncode == 0, result.tail()
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000003", "iter_0000004",
                                                      "latest_checkpointed_iteration.txt"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "4"


def test_an_unwritable_save_directory_is_refused_up_front(tmp_path):
    """--save below a regular file cannot be created (as root, a read-only mode would not
    stop the write): one line naming --save before anything starts, exit 2."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    flags = [*TINY, "--train-iters", "1", "--save", str(blocker / "checkpoints")]
    result = launch.python(["pretrain_gpt_2bw.py", *flags], timeout=60, WORLD_SIZE="2")
    assert result.returncode == 2, result.tail()
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --save: {str(blocker)!r} is a file, not a folder, so "
                      f"{str(blocker / 'checkpoints')!r} cannot be written"], result.tail()
    assert "Traceback" not in result.output


# ---- a lost peer ends the others with one line --------------------------------------------------

STALLS = {  # where rank 1 freezes (SIGSTOP) -> the flags; rank 0 then waits there in vain
    "exchange": ("megatron_2bw.schedules.p2p:StageComm.exchange:20", []),
    "checkpoint-save": ("megatron_2bw.training.checkpointing:_state_to_save:1",
                        ["--save", "{tmp}/checkpoints", "--save-interval", "3"]),
    "collective": ("megatron_2bw.training.guard:RunGuard.post:4",
                   ["--pipeline-model-parallel-size", "1"]),  # DP=2: the gradient all-reduce
}


def _until_rank_0_exits(tmp_path, script_args: list[str], **env: str) -> str:
    """torchrun (tagged, in its own session) ``script_args`` under tests/fault_entry.py with
    each rank's output in its own files under ``tmp_path/logs`` and exit code in
    ``tmp_path/rank<N>``; once rank 0 has exited (or after 150 s), kill what is left of the job
    (a frozen rank: torchrun would wait 30 s for it). Returns torchrun's output."""
    log = tmp_path / "run.log"
    command = [launch.TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(launch.free_port()), "--log-dir",
               str(tmp_path / "logs"), "--redirects", "3", "tests/fault_entry.py", *script_args]
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=launch.REPO, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=launch.subprocess_env(
                                       MEGATRON_2BW_TEST_TAG=str(log),
                                       MEGATRON_2BW_TEST_EXIT_DIR=str(tmp_path), **env))
    deadline = time.monotonic() + 150
    while not (tmp_path / "rank0").exists() and time.monotonic() < deadline \
            and process.poll() is None:
        time.sleep(0.2)
    for pid in launch.tagged_processes(str(log)):
        os.kill(pid, signal.SIGKILL)
    process.wait(timeout=30)
    return log.read_text()


@pytest.mark.parametrize("where", list(STALLS))
def test_a_stalled_peer_ends_the_others_with_one_line(tmp_path, where):
    """Rank 1 freezes (SIGSTOP, tests/fault_entry.py) in a pipeline exchange (PP=2), inside a
    checkpoint save (PP=2), or before a data-parallel collective (PP=1, DP=2). Rank 0 waits at
    most --distributed-timeout-minutes (0.1: 6 s), then ends with exit code 1 and an error
    line naming what it waited for, and no Python traceback on its stderr (torchrun's own
    report of the failed rank aside: each rank's stderr is read from its own file)."""
    stall, extra = STALLS[where]
    output = _until_rank_0_exits(
        tmp_path, ["pretrain_gpt_2bw.py", *TINY, "--train-iters", "100000",
                   "--distributed-timeout-minutes", "0.1",
                   *(flag.format(tmp=tmp_path) for flag in extra)],
        MEGATRON_2BW_TEST_STALL=stall, MEGATRON_2BW_TEST_STALL_RANK="1")
    logs = tmp_path / "logs"
    stderr = [path.read_text() for path in sorted(logs.rglob("0/stderr.log"))]
    stdout = "".join(path.read_text() for path in logs.rglob("1/stdout.log"))
    assert len(stderr) == 1 and "stopping in" in stdout, (output[-3000:], stdout[-2000:])
    assert "Traceback" not in stderr[0], stderr[0][-3000:]
    assert (tmp_path / "rank0").read_text() == "1", output[-3000:]
    errors = [line for line in stderr[0].splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[0][-3000:]
    assert re.search(r"rank 1|peer|timed out|Timed out", errors[0]), errors[0]
    assert not list((tmp_path / "checkpoints").glob("*.tmp")), where  # nothing partial
