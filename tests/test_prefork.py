"""The suite's launches fork from the pre-imported process (tests/prefork.py).

A launch forks only while what a process reads at its start is the session's (tests/dist.py's
``_prefork_server``). pytest imports every test module before the first test runs, so a
module whose imports change such a variable would silently start every launch of the session
afresh (about 8 s of CPU per process on CI's machine).
"""

from __future__ import annotations

import importlib
import os

from tests import dist


def test_a_launch_forks_once_every_test_module_is_imported(tmp_path):
    for path in sorted((dist.REPO / "tests").glob("test_*.py")):
        importlib.import_module(f"tests.{path.stem}")
    forks = os.environ.get("MEGATRON_2BW_TEST_PREFORK", "1") != "0"
    session, now = dist._SESSION_ENV, dist._start_env(dist.subprocess_env())
    changed = {k: (session.get(k), now.get(k)) for k in {*session, *now}
               if session.get(k) != now.get(k)}
    assert (dist._prefork_server(dist.subprocess_env()) is not None) == forks, changed
    script = tmp_path / "preloaded.py"
    script.write_text("import sys\n"
                      "print('preloaded:', 'megatron.core.models.gpt' in sys.modules)\n")
    done = dist.python([str(script)], timeout=60)
    assert done.returncode == 0, done.tail()
    assert f"preloaded: {forks}" in done.output, done.tail()


def test_a_forked_rank_starts_with_torchrun_s_signal_dispositions(tmp_path):
    """Whatever this session inherited (nohup ignores SIGHUP, a CI runner may ignore SIGINT),
    a forked torchrun rank starts with the signal dispositions a rank of torchrun itself has
    (a launcher flag makes the second launch a real torchrun)."""
    script = tmp_path / "dispositions.py"
    script.write_text("import signal\n"
                      "names = ('SIGHUP', 'SIGINT', 'SIGTERM', 'SIGQUIT')\n"
                      "handlers = [signal.getsignal(getattr(signal, n)) for n in names]\n"
                      "print('dispositions:', [getattr(h, 'name', getattr(h, '__name__', h))"
                      " for h in handlers])\n")
    forked = dist.torchrun([str(script)], 1, timeout=120)
    real = dist.torchrun([str(script)], 1, timeout=120, launcher_args=("--max-restarts", "0"))
    lines = [[line for line in launch.output.splitlines() if line.startswith("dispositions:")]
             for launch in (forked, real)]
    assert lines[0] and lines[0] == lines[1], (forked.tail(), real.tail())
