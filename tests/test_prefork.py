"""The suite's launches fork from the pre-imported process (tests/prefork.py).

A launch forks only while what a process reads at its start is the session's (tests/dist.py's
``_prefork_server``). pytest imports every test module before the first test runs, so a
module whose imports change such a variable would silently start every launch of the session
afresh (about 8 s of CPU per process on CI's machine).
"""

from __future__ import annotations

import importlib
import os

import pytest

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


_PARENT = ("import os, sys, time\n"
           "parent = open(f'/proc/{os.getppid()}/cmdline').read().split('\\0')\n"
           "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'pid', os.getpid(),"
           " 'parent', 'prefork' if 'tests.prefork' in parent else 'torchrun', flush=True)\n"
           "time.sleep(float(sys.argv[1]))\n")


def _script_launch(tmp_path, env: dict, seconds: str) -> tuple[int, str]:
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    done = dist._run(["torchrun", "--nproc_per_node=2", "--master-port", str(dist.free_port()),
                      str(script), seconds], env, timeout=120)
    return done.returncode, done.output


def test_a_launch_script_s_torchrun_forks_unless_the_start_differs(tmp_path):
    """tests/bin/torchrun (``dist.script_env``): two ranks with torchrun's variables, forked
    from the prefork server; a variable read at start that differs from the session's
    (PYTHONHASHSEED, as a script's export would set it) makes the server refuse, the ranks
    then the real torchrun's children."""
    forks = os.environ.get("MEGATRON_2BW_TEST_PREFORK", "1") != "0"
    for env, launcher in [(dist.script_env(), "prefork" if forks else "torchrun"),
                          (dict(dist.script_env(), PYTHONHASHSEED="7"), "torchrun")]:
        code, output = _script_launch(tmp_path, env, "0")
        ranks = sorted(line.split()[1:4:2] + [line.split()[-1]] for line in output.splitlines()
                       if line.startswith("rank "))
        assert code == 0 and ranks == [["0", "2", launcher], ["1", "2", launcher]], output


def test_killing_a_launch_script_s_torchrun_ends_its_forked_ranks(tmp_path):
    """The requester gone (a test's deadline kills the script's process group), the prefork
    server kills the ranks it forked for it instead of serving them to their end."""
    import signal
    import subprocess
    import time

    if os.environ.get("MEGATRON_2BW_TEST_PREFORK", "1") == "0":
        pytest.skip("MEGATRON_2BW_TEST_PREFORK=0: no server, the real torchrun's ranks")
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    shim = subprocess.Popen(["torchrun", "--nproc-per-node", "2", str(script), "600"],
                            env=dist.script_env(), stdout=subprocess.PIPE, text=True)
    pids = [int(shim.stdout.readline().split()[5]) for _ in range(2)]
    shim.kill()
    shim.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert alive == []


def _shim():
    from importlib.machinery import SourceFileLoader
    from importlib.util import module_from_spec, spec_from_loader

    loader = SourceFileLoader("torchrun_shim", str(dist.SHIMS / "torchrun"))
    module = module_from_spec(spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def test_a_launch_script_s_torchrun_forwards_only_one_local_node():
    """The flag spellings Megatron-LM's scripts use (``--nproc_per_node 8``,
    ``--master-port=6000``) are forwarded; several nodes, a remote rendezvous, another
    launcher flag or ``python -m`` go to the real torchrun."""
    shim = _shim()
    parsed = shim._parse(["--nproc_per_node", "8", "--nnodes", "1", "--node_rank", "0",
                          "--master_addr", "localhost", "--master-port=6000", "train.py", "--x"])
    assert parsed == ({"nproc-per-node": "8", "nnodes": "1", "node-rank": "0",
                       "master-addr": "localhost", "master-port": "6000"}, ["train.py", "--x"])
    assert shim._forwardable(*parsed)
    assert shim._forwardable(*shim._parse(["--standalone", "train.py"]))
    for argv in (["--nnodes", "2", "train.py"], ["--node-rank", "1", "train.py"],
                 ["--master-addr", "10.0.0.1", "train.py"], ["--nproc-per-node", "gpu", "t.py"],
                 ["-m", "module"], ["--nproc-per-node", "2", "train.sh"]):
        parsed = shim._parse(argv)
        assert parsed is not None and not shim._forwardable(*parsed), argv
    assert shim._parse(["--rdzv-backend", "c10d", "train.py"]) is None
    assert shim._parse(["--max-restarts", "0", "train.py"]) is None
    assert shim._parse(["--nproc-per-node"]) is None
