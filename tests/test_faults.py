"""Divergence and pre-emption end a run cleanly (``megatron_2bw/training/guard.py``).

References:
  * the divergence rules as a table (fp32/bf16: a non-finite loss or gradient norm; fp16 with
    dynamic loss scaling: only --loss-scale-window consecutive skipped steps);
  * a real 2-stage 2BW run with --lr 1e30 reaches a NaN loss: every rank ends with exit code 1
    and one line naming the first non-finite iteration K, and no checkpoint at or after K is
    written (--save-interval 2), the tracker still names the last good one;
  * a SIGTERM to one rank of a long run (the other learns it through the per-iteration flag):
    the run saves a checkpoint within two iterations of the signal and exits 0, saying where.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time

import pytest

from megatron_2bw.training.guard import local_divergence
from tests import dist as launch

NAN, INF = math.nan, math.inf
LOSS, GRAD, SKIPS = 1, 2, 3  # guard's flag indices

TINY = ["--cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "4", "--global-batch-size", "16",
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


def test_a_diverging_run_stops_without_saving(tmp_path):
    save = tmp_path / "checkpoints"
    result = launch.torchrun(["pretrain_gpt_2bw.py", *TINY, "--train-iters", "20",
                              "--lr", "1e30", "--save", str(save), "--save-interval", "2"],
                             2, timeout=240)
    assert result.returncode != 0, result.tail()
    errors = re.findall(r"^error: iteration (\d+): the (loss|gradient norm) is not finite "
                        r"\(NaN or inf\); training stopped without saving", result.output,
                        re.MULTILINE)
    assert len(errors) == 2 and errors[0] == errors[1], result.tail()  # one line per rank
    diverged = int(errors[0][0])
    logged = {int(i): loss for i, loss in
              re.findall(r"iteration +(\d+)/ +\d+ .*?lm loss: (\S+)", result.output)}
    first_nan = min(i for i, loss in logged.items() if loss.lower() in ("nan", "inf"))
    assert diverged == first_nan, (diverged, logged)
    saved = sorted(int(p.name[len("iter_"):]) for p in save.glob("iter_*"))
    assert saved and max(saved) < diverged, (saved, diverged)
    assert int((save / "latest_checkpointed_iteration.txt").read_text()) == max(saved)
    assert not list(save.glob("*tmp*")), list(save.iterdir())


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_sigterm_saves_within_two_iterations_and_exits_zero(tmp_path):
    save = tmp_path / "checkpoints"
    command = [launch.TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(launch.free_port()), "pretrain_gpt_2bw.py",
               *TINY, "--train-iters", "100000", "--lr", "1e-4", "--save", str(save),
               "--save-interval", "100000"]
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=launch.REPO, env=launch.subprocess_env(),
                                   stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "iteration      5/" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        workers = _children(process.pid)
        assert len(workers) == 2, workers
        signalled_at = max(int(i) for i in re.findall(r"iteration +(\d+)/", log.read_text()))
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
    # the signal lands in iteration s+1 or later; its flag is read one iteration after that,
    # and the next (drained) iteration is the last: at most s + 3
    assert signalled_at < iteration <= signalled_at + 3, (signalled_at, iteration)
    assert f"saved checkpoint at iteration {iteration} to " in text
    assert int((save / "latest_checkpointed_iteration.txt").read_text()) == iteration
