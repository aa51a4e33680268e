"""Launch multi-process runs for tests: spawned gloo workers and torchrun.

    spawn(fn, world_size, *args, out_dir=..., timeout=...) -> [fn's return value on each rank]
    torchrun(script_args, nproc, ...) -> Launch
    python(script_args, ...) -> Launch          # one plain process
    tagged_processes(tag) -> [pid]

Invariant: every launch has a wall-clock limit, so a hung collective fails the test instead of
hanging CI. ``spawn``, ``torchrun`` and ``python`` fork their processes from tests/prefork.py,
which has imported torch and megatron-core once per session, unless the launch changes what a
process reads at its start (``_forkable``, ``_prefork_server``).

The functions in full: docs/testing.md, "Launching".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from megatron_2bw.runtime.ports import free_port

__all__ = ["REPO", "free_port", "spawn", "torchrun", "python", "Launch", "subprocess_env",
           "script_env", "torchrun_env", "tiny_training_flags", "tagged_processes"]

REPO = Path(__file__).resolve().parents[1]
STRICT = REPO / "tests" / "strict"
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SHIMS = REPO / "tests" / "bin"
_SOCKET = "MEGATRON_2BW_TEST_PREFORK_SOCKET"


def _strict(env) -> bool:
    """Strict NCCL mode (tests/strict) for the children of a process with environment ``env``:
    on unless MEGATRON_2BW_STRICT=0, and only where its records have a directory."""
    return env.get("MEGATRON_2BW_STRICT", "1") != "0" and bool(env.get("MEGATRON_2BW_STRICT_DIR"))


def subprocess_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child: one thread per process (2-core CI), the repo
    importable, strict NCCL mode's sitecustomize first on the path when it is on, plus
    ``extra``."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    env.update(extra)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    strict = [str(STRICT)] if _strict(env) and str(STRICT) not in path else []
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *strict, *path])
    return env


# ---- spawned workers ------------------------------------------------------------------------

def _worker(rank: int, fn, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    from megatron_2bw.runtime import lifetime

    lifetime.bind_to_launcher()  # a killed pytest takes its workers with it
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    if _strict(os.environ):  # sitecustomize installed it already where tests/strict is on the path
        from tests.strict import strict_comm

        strict_comm.install()
    torch.set_num_threads(1)
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def spawn(fn, world_size: int, *args, out_dir: str | os.PathLike, timeout: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes (forked from the
    pre-imported process, tests/prefork.py, where the environment is the one it started
    with); return the results by rank. An exception on any rank is re-raised here with that
    rank's traceback; past ``timeout`` seconds all workers are killed and TimeoutError is
    raised."""
    os.makedirs(out_dir, exist_ok=True)
    if _prefork_server(subprocess_env()) is not None:
        return _forked_spawn(fn, world_size, args, str(out_dir), timeout)
    context = mp.start_processes(_worker, args=(fn, world_size, free_port(), str(out_dir), args),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):  # raises ProcessRaisedException if a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{fn.__name__} on {world_size} processes ran past {timeout:.0f} s")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)]


# ---- command-line launches ------------------------------------------------------------------

@dataclass
class Launch:
    """A finished command: its exit code and its stdout and stderr interleaved."""

    command: list[str]
    returncode: int
    output: str

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def _run(command: list[str], env: dict[str, str], timeout: float) -> Launch:
    """Run ``command`` in its own process group; past ``timeout`` kill that group (torchrun and
    its workers) and raise TimeoutError with the last output."""
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise TimeoutError(f"{' '.join(command)} ran past {timeout:.0f} s; last output:\n"
                           + "\n".join(output.splitlines()[-40:])) from None
    return Launch(command, process.returncode, output)


def torchrun(script_args: list[str], nproc: int, timeout: float = 180.0,
             launcher_args: tuple[str, ...] = (), **env: str) -> Launch:
    """``torchrun --nproc-per-node nproc`` on a free port, from the repository root (forked
    from the pre-imported process, tests/prefork.py, where no launcher flag and no variable
    read at a process's start is asked for)."""
    command = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               *launcher_args, *script_args]
    if not launcher_args and set(env) <= set(_READ_AFTER_START) and _forkable(script_args):
        return _forked(command, script_args, nproc, subprocess_env(**env), timeout)
    return _run(command, subprocess_env(**env), timeout)


def torchrun_env() -> dict[str, str]:
    """Variables for a tool or launch script whose torchrun is not what a test checks:
    tests/bin's torchrun (as TORCHRUN and first on PATH) forks its ranks from the prefork
    server; the real one, next on PATH, runs where the server is off or refuses."""
    env = {"TORCHRUN": str(SHIMS / "torchrun"), "PATH": os.pathsep.join(
        [str(SHIMS), str(Path(PYTHON).parent), os.environ.get("PATH", "")])}
    server = _prefork_server(subprocess_env())
    return {**env, _SOCKET: server} if server else env


def script_env(**extra: str) -> dict[str, str]:
    """``subprocess_env`` with ``torchrun_env`` for ``bash SCRIPT``."""
    return subprocess_env(**torchrun_env(), **extra)


def python(script_args: list[str], timeout: float = 120.0, **env: str) -> Launch:
    """One plain Python process, from the repository root (forked as in ``torchrun``)."""
    if set(env) <= set(_READ_AFTER_START) and _forkable(script_args):
        return _forked([PYTHON, *script_args], script_args, 0, subprocess_env(**env), timeout)
    return _run([PYTHON, *script_args], subprocess_env(**env), timeout)


# ---- launches forked from a pre-imported process (tests/prefork.py) --------------------------

_server: subprocess.Popen | None = None
_socket_path = ""
_starting = threading.Lock()
_READ_AFTER_START = ("WORLD_SIZE", "WANDB_MODE", "PATH", "TORCHRUN", _SOCKET)
"""Variables nothing reads before the script runs: a launch may set its own."""
_READ_AT_START = ("PYTHON", "MEGATRON_2BW_", "TORCH", "OMP_", "MKL_", "KMP_", "NVTE_", "CUDA",
                  "LD_", "GLOO_", "NCCL_")
"""Prefixes of the variables the interpreter, strict mode's sitecustomize or an import may
read: a launch whose values differ from the session's starts the ordinary way (a test's
MEGATRON_2BW_TEST_TAG must be in the process's own environment, for one)."""


def _forkable(script_args: list[str]) -> bool:
    """``python SCRIPT.py ...`` (not ``-c``/``-m``), with the prefork server on."""
    return (os.environ.get("MEGATRON_2BW_TEST_PREFORK", "1") != "0" and bool(script_args)
            and script_args[0].endswith(".py"))


_NOT_READ_AT_START = ("TORCHINDUCTOR_CACHE_DIR", "CUDA_DEVICE_MAX_CONNECTIONS", "TORCHRUN",
                      _SOCKET)
"""Variables with those prefixes that do not keep a launch from forking: torch's own imports
put inductor's cache directory into ``os.environ`` (torch.distributed.pipelining, which
tests/test_vshape.py imports at collection), the CUDA driver reads its connection count
(Megatron-LM's scripts export it) at a context's creation, which a CPU rank never makes, and
only launchers read the last two (``torchrun_env``)."""


def _start_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if k.startswith(_READ_AT_START) and k not in _NOT_READ_AT_START}


_SESSION_ENV = _start_env(subprocess_env())
"""What a child reads at its start, as the session set it up (tests/conftest.py runs first):
the server starts with it, and serves launches that read the same (in-process tests set
MASTER_PORT and the like, which a launch's own values replace)."""


def _prefork_server(env: dict[str, str]) -> str | None:
    """The server's socket path, starting it at the first call; None where it is off, cannot
    start, or ``env`` is not the session's (a test's own strict-mode variables, say: read at
    a process's start, so such a launch starts the ordinary way)."""
    if os.environ.get("MEGATRON_2BW_TEST_PREFORK", "1") == "0" \
            or _start_env(env) != _SESSION_ENV:
        return None
    with _starting:  # launches from threads (test_batch_rampup): one server
        _start_server()
    return _socket_path if _server.poll() is None else None


def _start_server() -> None:
    """Start the server with the session's environment (once), and wait until it is ready."""
    global _server, _socket_path
    if _server is None:
        import atexit
        import tempfile

        directory = tempfile.mkdtemp(prefix="megatron-2bw-prefork-")
        _socket_path = os.path.join(directory, "socket")
        with open(os.path.join(directory, "server.log"), "w") as log:
            _server = subprocess.Popen([PYTHON, "-m", "tests.prefork", _socket_path], cwd=REPO,
                                       env=subprocess_env(), stdout=subprocess.PIPE, stderr=log,
                                       text=True)
        atexit.register(_stop_server, _server)
        if _server.stdout.readline().strip() != "ready":
            _server.kill()


def _ask(request: dict, timeout: float) -> dict:
    """Send ``request`` to the server; its answer once the launch ended."""
    import json
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(_socket_path)
        connection.settimeout(timeout + 120)
        connection.sendall((json.dumps(request) + "\n").encode())
        return json.loads(connection.makefile("r").readline())


def _forked(command: list[str], script_args: list[str], nproc: int, env: dict[str, str],
            timeout: float) -> Launch:
    """``command``'s launch, forked by the prefork server (ordinary, where it is not up)."""
    import tempfile

    if _prefork_server(env) is None:
        return _run(command, env, timeout)
    with tempfile.NamedTemporaryFile("r", prefix="launch-", suffix=".log") as out:
        answer = _ask({"argv": script_args, "nproc": nproc, "env": env, "cwd": str(REPO),
                       "port": free_port(), "out": out.name, "timeout_s": timeout}, timeout)
        output = open(out.name, errors="replace").read()
    if answer.get("refused"):
        return _run(command, env, timeout)
    if answer["timed_out"]:
        raise TimeoutError(f"{' '.join(command)} ran past {timeout:.0f} s; last output:\n"
                           + "\n".join(output.splitlines()[-40:]))
    return Launch(command, answer["returncode"], output)


def _forked_spawn(fn, world_size: int, args: tuple, out_dir: str, timeout: float) -> list:
    """``spawn``'s run, forked by the prefork server."""
    import pickle
    import tempfile

    scratch = tempfile.mkdtemp(prefix="megatron-2bw-spawn-")
    with open(os.path.join(scratch, "args.pickle"), "wb") as f:
        pickle.dump(args, f)
    log = os.path.join(scratch, "ranks.log")
    answer = _ask({"call": {"module": fn.__module__, "name": fn.__qualname__,
                            "args": f.name, "out_dir": out_dir},
                   "nproc": world_size, "env": subprocess_env(), "cwd": str(REPO),
                   "port": free_port(), "out": log, "timeout_s": timeout}, timeout)
    if answer["timed_out"]:
        raise TimeoutError(f"{fn.__name__} on {world_size} processes ran past {timeout:.0f} s")
    if any(answer["exit_codes"]):
        with open(log, errors="replace") as f:
            raise RuntimeError(f"{fn.__name__} failed, exit codes {answer['exit_codes']}:\n"
                               + f.read()[-6000:])
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)]


def _stop_server(server: subprocess.Popen) -> None:
    import shutil

    server.kill()
    server.wait()
    shutil.rmtree(os.path.dirname(_socket_path), ignore_errors=True)


def tagged_processes(tag: str) -> list[int]:
    """Live processes (not zombies) whose environment holds MEGATRON_2BW_TEST_TAG=tag: the
    launcher, the workers, and whatever they started (sessions of their own included)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/environ", "rb") as f:
                tagged = f"MEGATRON_2BW_TEST_TAG={tag}".encode() in f.read().split(b"\0")
        except OSError:
            continue
        if tagged and state != "Z":
            found.append(int(pid))
    return found


def tiny_training_flags(*, seq_length: int, train_iters: int) -> list[str]:
    """A 2-layer model, hidden 32, 16 samples per batch in microbatches of 4, cosine
    learning rate, a log line per iteration and a validation at the end, on CPU processes."""
    return [
        "--cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
        "--make-vocab-size-divisible-by", "16",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--micro-batch-size", "4", "--global-batch-size", "16",
        "--train-iters", str(train_iters), "--lr", "5e-3", "--lr-warmup-iters", "2",
        "--lr-decay-style", "cosine", "--min-lr", "5e-4", "--seed", "1234",
        "--log-interval", "1", "--eval-interval", str(train_iters), "--eval-iters", "2",
        "--split", "90,10,0", "--distributed-timeout-minutes", "2",
    ]


def tear_down_groups() -> None:
    """megatron-core's model-parallel state reset, and every process group but the default one
    and the trainer's control group destroyed: megatron-core's reset only forgets its groups,
    and each gloo group keeps its threads (a process running 40 trainings in a row held ~2,000
    and slowed to a crawl). For processes that run one training after another."""
    import gc

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.distributed import distributed_c10d as c10d

    from megatron_2bw.training import loop

    ps.destroy_model_parallel()
    kept = (c10d.GroupMember.WORLD, loop._CPU_GROUP)  # the trainer's gloo group lives on
    for group in [g for g in list(c10d._world.pg_map) if g not in kept]:
        dist.destroy_process_group(group)
    gc.collect()  # the run's objects that hold groups lie in reference cycles
