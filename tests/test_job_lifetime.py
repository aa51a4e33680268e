"""A job killed at random moments resumes exactly; its ranks end with their launcher; a signal
to the whole job saves (``megatron_2bw/runtime/lifetime.py``, ``training/guard.py``).

One seeded chain of runs of a 2-stage 2BW GPT is killed (SIGKILL during a save, SIGTERM to the
job, SIGKILL to the launcher alone) and resumed. Reference: the uninterrupted run with the same
flags, whose losses every run must log iteration by iteration. Guards: no process of a killed
run is left, only complete checkpoints remain, exit codes and stop lines are those of
docs/checkpoints_and_faults.md; also the parent-death binding of a process, without torchrun.
The chain and the signal cases: docs/testing.md, "What each test module checks",
test_job_lifetime.py.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import dist as launch
from tests.test_training import model_flags, train

SEED = int(os.environ.get("MEGATRON_2BW_CHAOS_SEED", "0"))
SAVE_INTERVAL = 3
RTOL = 1e-5


@dataclass
class Part:
    """One run of the chain: its output, the exit codes its ranks wrote (tests/fault_entry.py),
    processes of it still alive after the kill, and what else the step noted."""

    output: str
    exit_codes: dict[int, str]
    strays: list[int]
    notes: dict = field(default_factory=dict)


def _tracker(root: Path) -> int | None:
    path = root / "latest_checkpointed_iteration.txt"
    return int(path.read_text()) if path.exists() else None


def _logged(log: Path, iteration: int) -> bool:
    return re.search(rf"iteration +{iteration}/", log.read_text()) is not None


class Run:
    """A tagged torchrun of the chain's flags in a session of its own."""

    def __init__(self, tmp: Path, name: str, flags: list[str], **env: str):
        self.dir = tmp / name
        self.dir.mkdir()
        self.log = self.dir / "run.log"
        self.tag = str(self.log)
        command = [launch.TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", str(launch.free_port()),
                   "tests/fault_entry.py", "pretrain_gpt_2bw.py", *flags]
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(
                command, cwd=launch.REPO, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, env=launch.subprocess_env(
                    MEGATRON_2BW_TEST_TAG=self.tag, MEGATRON_2BW_TEST_EXIT_DIR=str(self.dir),
                    **env))

    def wait_until(self, ready, limit: float = 150.0, poll: float = 0.05) -> None:
        deadline = time.monotonic() + limit
        while not ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill_all(signal.SIGKILL)
                raise AssertionError(f"{self.dir.name}: not ready\n{self.log.read_text()[-3000:]}")
            time.sleep(poll)

    def kill_all(self, sig: int, pids: list[int] | None = None) -> None:
        """``sig`` to every process of the job (``pids``: those found beforehand)."""
        for pid in pids if pids is not None else launch.tagged_processes(self.tag):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def finish(self, limit: float, **notes) -> Part:
        """Wait up to ``limit`` s for every process of the job to end; kill what is left."""
        deadline = time.monotonic() + limit
        while launch.tagged_processes(self.tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        strays = launch.tagged_processes(self.tag)
        self.kill_all(signal.SIGKILL, strays)
        self.process.wait(timeout=30)
        codes = {int(p.name[4:]): p.read_text() for p in self.dir.glob("rank[0-9]")}
        return Part(self.log.read_text(), codes, strays, notes)


@pytest.fixture(scope="module")
def chain(tiny_gpt_data, tmp_path_factory):
    """Runs A, C, B, D of the module docstring; returns (uninterrupted run's losses, the checkpoint
    directory, {step: Part}). A step that cannot start (the run before left nothing to
    resume, or a run never reached its moment) ends the chain: the steps from it on are
    missing, with the reason under "broken"."""
    rng = random.Random(SEED)
    tmp = tmp_path_factory.mktemp("chain")
    root = tmp / "checkpoints"
    flags = model_flags(tiny_gpt_data, tp=1, pp=2, schedule="2bw")
    reference = train(flags)  # the uninterrupted run (test_training's, shared)
    reference.check_succeeded()
    flags = [*flags, "--save", str(root), "--save-interval", str(SAVE_INTERVAL),
             "--load", str(root)]
    parts: dict = {}
    try:
        for step in (_kill_during_a_save, _terminate_the_job, _kill_the_launcher, _to_the_end):
            step(tmp, root, flags, rng, parts)
    except _Broken as broken:
        parts["broken"] = str(broken)
    return reference.losses, root, parts


class _Broken(Exception):
    """The chain cannot go on (the message says why)."""


def _resume_point(root: Path, parts: dict, before: int) -> int:
    """The tracker's iteration, which must leave a few iterations to run before ``before``."""
    resumed = _tracker(root)
    if resumed is None or resumed > before:
        raise _Broken(f"after {sorted(parts)} the tracker names {resumed}: nothing left to "
                      f"interrupt ({sorted(p.name for p in root.iterdir())})")
    return resumed


def _start(run: Run, ready) -> None:
    try:
        run.wait_until(ready)
    except AssertionError as error:
        raise _Broken(str(error)) from None


def _kill_during_a_save(tmp: Path, root: Path, flags: list[str], rng, parts: dict) -> None:
    """A: SIGKILL to every process of the job while the ranks write the checkpoint of
    iteration 6 or 9 (the processes found beforehand, so the kill lands inside it)."""
    saving = rng.choice([2 * SAVE_INTERVAL, 3 * SAVE_INTERVAL])
    run = Run(tmp, "A", flags)
    _start(run, lambda: _logged(run.log, saving - 1))
    pids = launch.tagged_processes(run.tag)
    partial, final = root / f"iter_{saving:07d}.tmp", root / f"iter_{saving:07d}"
    run.wait_until(partial.exists, poll=0.002)
    time.sleep(rng.uniform(0.0, 0.01))
    run.kill_all(signal.SIGKILL, pids)
    run.kill_all(signal.SIGKILL)
    parts["A"] = run.finish(10, during_save=partial.exists() and not final.exists(),
                            saving=saving, tracker=_tracker(root))


def _kill_the_launcher(tmp: Path, root: Path, flags: list[str], rng, parts: dict) -> None:
    """B: SIGKILL to the launcher's process group (torchrun alone) a few iterations in. Strict
    mode off: its rendezvous tokens go through the store torchrun hosts (NCCL's p2p does not
    use it once the communicators exist)."""
    resumed = _resume_point(root, parts, 16)
    run = Run(tmp, "B", flags, MEGATRON_2BW_STRICT="0")
    killed_at = resumed + rng.randint(2, 4)
    _start(run, lambda: _logged(run.log, killed_at))
    os.killpg(run.process.pid, signal.SIGKILL)
    parts["B"] = run.finish(15, resumed=resumed, killed_at=killed_at)
    parts["B"].notes["tracker"] = _tracker(root)


def _terminate_the_job(tmp: Path, root: Path, flags: list[str], rng, parts: dict) -> None:
    """C: SIGTERM to every process of the job (what scancel sends), a few iterations in."""
    resumed = _resume_point(root, parts, 12)
    run = Run(tmp, "C", flags)
    signalled_at = resumed + rng.randint(2, 4)
    _start(run, lambda: _logged(run.log, signalled_at))
    run.kill_all(signal.SIGTERM)
    parts["C"] = run.finish(60, resumed=resumed, signalled_at=signalled_at)
    parts["C"].notes["tracker"] = _tracker(root)


def _to_the_end(tmp: Path, root: Path, flags: list[str], rng, parts: dict) -> None:
    """D: resumed, to the end."""
    resumed = _resume_point(root, parts, 23)
    run = Run(tmp, "D", flags)
    run.process.wait(timeout=240)
    parts["D"] = run.finish(10, resumed=resumed, returncode=run.process.returncode)


def _step(parts: dict, name: str) -> Part:
    assert name in parts, f"run {name} never started: {parts.get('broken')}"
    return parts[name]


def _losses(output: str) -> dict[int, float]:
    return {int(i): float(loss) for i, loss in
            re.findall(r"iteration +(\d+)/ +\d+ \|.*?lm loss: (\S+) \|", output)}


def _stop(output: str, why: str = r"[^)]*") -> tuple[int, int] | None:
    """(the first iteration s at whose end a rank said it received a stop signal, the iteration
    the run stopped at), or None without both lines. The flag posted at the end of s is read
    one iteration later, and the next, drained, iteration is the last: at most s + 2 (s itself
    where the loop pauses after s anyway, for a checkpoint: it reads every flag there)."""
    requested = re.findall(rf"stop requested \({why}\) on rank \d by the end of iteration "
                           rf"(\d+)", output)
    stopped = re.search(r"stopping at iteration (\d+) \(", output)
    if not requested or stopped is None:
        return None
    return min(int(i) for i in requested), int(stopped.group(1))


def _stopped_in_time(run, why: str, sent: str) -> int:
    """The iteration `run` stopped at, for the reason `why` (or another rank's stop signal),
    checked: the stop was requested at or after the signal went out (the note `sent`) and the
    run stopped within two iterations of it."""
    stopped = re.search(rf"stopping at iteration (\d+) \(({why}|a stop signal on another "
                        rf"rank)\)", run.output)
    assert stopped, run.output[-3000:]
    iteration = int(stopped.group(1))
    requested_at, _ = _stop(run.output, why)
    assert run.notes[sent] <= requested_at <= iteration <= requested_at + 2, \
        (requested_at, iteration, run.notes)
    return iteration


def _no_rank_traceback(output: str) -> bool:
    return not re.search(r'File ".*(megatron_2bw|pretrain_gpt_2bw)', output)


def test_a_job_killed_at_random_moments_resumes_exactly(chain):
    """No process of a killed run is left; every run logs the uninterrupted run's losses; the
    last one trains to the end from where the one before stopped; only complete checkpoints
    remain, the tracker naming the last."""
    reference, root, parts = chain
    a = _step(parts, "A")
    assert a.notes["during_save"], a.notes  # the kill interrupted the save it was meant to
    assert a.notes["tracker"] == a.notes["saving"] - SAVE_INTERVAL, a.notes
    b = _step(parts, "B")
    trained_on, stopped = max(_losses(b.output)), _stop(b.output)
    assert stopped is not None and trained_on == stopped[1], \
        f"run B trained on to iteration {trained_on} after its launcher was killed at " \
        f"iteration {b.notes['killed_at']}, stop lines: {stopped}"
    for step in "ACBD":
        part = _step(parts, step)
        assert part.strays == [], (step, part.strays, part.output[-3000:])
        logged = _losses(part.output)
        assert logged, (step, part.output[-3000:])
        for iteration, loss in logged.items():
            assert loss == pytest.approx(reference[iteration], rel=RTOL), (step, iteration)
    d = _step(parts, "D")
    assert d.notes["returncode"] == 0, d.output[-3000:]
    assert sorted(_losses(d.output)) == list(range(d.notes["resumed"] + 1, 25)), d.output[-3000:]
    assert _tracker(root) == 24
    names = sorted(p.name for p in root.iterdir())
    assert all(re.fullmatch(r"iter_\d{7}", n) for n in names if n.startswith("iter_")), names
    for path in root.glob("iter_*"):
        assert (path / "metadata.json").is_file() and (path / ".metadata").is_file(), path


def test_ranks_end_with_their_launcher(chain):
    """Run B: torchrun killed with SIGKILL alone; its ranks, still reaching each other, stop
    within two iterations with a checkpoint, say why in one line, exit 0, and none of the job's
    processes (ranks, data-loader workers) is left within 15 s."""
    _, _, parts = chain
    b = _step(parts, "B")
    assert b.strays == [], (b.strays, b.output[-3000:])
    iteration = _stopped_in_time(b, "SIGTERM: the launcher of this rank ended", "killed_at")
    assert f"saved checkpoint at iteration {iteration} to " in b.output
    assert b.notes["tracker"] == iteration
    assert b.exit_codes == {0: "0", 1: "0"}, b.exit_codes
    assert _no_rank_traceback(b.output), b.output[-3000:]


def test_a_signal_to_the_whole_job_saves_and_exits_zero(chain):
    """Run C: SIGTERM to every process of the job, data-loader workers included (they ignore
    it and end with their rank): every rank stops within two iterations, saves, and exits 0;
    the next run resumes from that checkpoint (and logs the uninterrupted run's losses, see
    the test above)."""
    _, _, parts = chain
    c = _step(parts, "C")
    assert c.strays == [], c.strays
    iteration = _stopped_in_time(c, "SIGTERM", "signalled_at")
    assert c.exit_codes == {0: "0", 1: "0"}, (c.exit_codes, c.output[-3000:])
    assert not re.search(r"^error:", c.output, re.MULTILINE), c.output[-3000:]
    assert _no_rank_traceback(c.output), c.output[-3000:]
    assert c.notes["tracker"] == iteration
    assert _step(parts, "B").notes["resumed"] == iteration  # the next run resumed there


_ORPHAN = """
import os, sys, time
from megatron_2bw.runtime import lifetime
from megatron_2bw.training import guard
lifetime.remember_launcher()
guard.catch_stop_signals()
when, out = sys.argv[1], sys.argv[2]
bound = None
if when == "before":
    bound = lifetime.bind_to_launcher()
print("ready", flush=True)
deadline = time.monotonic() + 30
while not lifetime.launcher_gone() and time.monotonic() < deadline:
    time.sleep(0.01)
if when == "after":
    bound = lifetime.bind_to_launcher()
time.sleep(0.5)
with open(out, "w") as f:
    f.write(f"{bound}\\n{guard._received_stop()}")
"""

_LAUNCHER = """
import signal, subprocess, sys
launcher, rank = (getattr(signal, name) for name in sys.argv[1:3])
signal.signal(signal.SIGHUP, launcher)
child = subprocess.Popen([sys.executable, "-c", *sys.argv[3:]], stdout=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, rank))
assert child.stdout.readline() == "ready\\n"
"""  # and ends at once, its child still running


def _orphan(tmp_path: Path, launcher_hangup: str, rank_hangup: str, when: str) -> list[str]:
    """Start a launcher with SIGHUP set to ``launcher_hangup`` that starts a process with
    ``rank_hangup`` and ends once the process is up; the process binds itself to the launcher
    ``when`` ("before" or "after" it ended). Returns [whether bind_to_launcher bound it, the
    stop signal it recorded half a second after the launcher's end]. The dispositions are
    set here, whatever this test process inherited (nohup, a CI runner)."""
    out = tmp_path / "received"
    result = launch.python(["-c", _LAUNCHER, launcher_hangup, rank_hangup, _ORPHAN, when,
                            str(out)], timeout=60)
    assert result.returncode == 0, result.tail()
    deadline = time.monotonic() + 45
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return out.read_text().splitlines()


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("hangup", ["SIG_DFL", "SIG_IGN"])
def test_a_rank_bound_before_or_after_its_launcher_died_gets_sigterm(tmp_path, hangup, when):
    """A process binds itself to the one that started it (runtime.lifetime), which then ends;
    bound while it lived, the kernel sends SIGTERM; bound after it ended, the process sends it
    to itself. Either way the stop handler records it as the launcher's end. SIGHUP ignored
    in both (``nohup python launcher.py``: the launcher outlives the terminal) binds as the
    default does."""
    assert _orphan(tmp_path, hangup, hangup, when) == \
        ["True", "SIGTERM: the launcher of this rank ended"]


def test_a_rank_started_under_nohup_by_a_shell_outlives_it(tmp_path):
    """``nohup python rank.py &`` from a shell: SIGHUP ignored in the process, not in the
    launcher (which ends with the terminal): the process is not bound and receives nothing
    when the launcher ends."""
    assert _orphan(tmp_path, "SIG_DFL", "SIG_IGN", "before") == ["False", "None"]
