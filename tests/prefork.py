"""A process that has imported torch, megatron-core and megatron_2bw once and forks the tests'
launches of the entry scripts from there (``tests/dist.py``'s ``torchrun`` and ``python``,
``tests/bin/torchrun`` for launch scripts).

    python -m tests.prefork SOCKET    # serves launches, each in a handler, until its parent ends

Invariants: a forked launch keeps what the launch it replaces would have: each rank its own
process and session with torchrun's environment and signal dispositions, the script as
``__main__`` with its argv, path and exit code, strict NCCL mode, torchrun's reaction to a
failed rank, the ranks' output interleaved; nothing runs here that a run's own start would do.
Launches that change the interpreter's start run the ordinary way (refused here, or not asked
for); a launch whose requester is gone is killed; off with ``MEGATRON_2BW_TEST_PREFORK=0``.

The request and answer formats and what is kept, item by item: docs/testing.md, "Launching".
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys
import time

__all__ = ["serve"]

GRACE_S = 30.0
"""torchrun's wait between SIGTERM and SIGKILL for the ranks left after one failed."""
_START_ENV: dict[str, str] = {}
"""The variables read at a process's start, as this process started with them (a forked
launch must read the same)."""


def _preload() -> None:
    import megatron_2bw  # noqa: F401  (first: its import hook picks megatron-core's fuser)
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (torch.optim imports it at the first optimizer)
    import torch.distributed.checkpoint  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.bert.bert_model  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401

    import megatron_2bw.data.bert  # noqa: F401
    import megatron_2bw.data.gpt  # noqa: F401
    import megatron_2bw.data.tokenizer  # noqa: F401  (megatron-core's imports transformers)
    import megatron_2bw.entry  # noqa: F401
    import megatron_2bw.training.loop  # noqa: F401


def _rank_env(request: dict, rank: int) -> dict[str, str]:
    """The launch's environment, plus torchrun's variables for ``rank`` (none for a plain
    process)."""
    env = dict(request["env"])
    nproc = request["nproc"]
    if nproc:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                   ROLE_NAME="default", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(request["port"]), TORCHELASTIC_RESTART_COUNT="0",
                   TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none")
    return env


def _exit_code(code) -> int:
    """The interpreter's exit status for ``SystemExit(code)`` (a text is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _call(request: dict, rank: int) -> None:
    """``tests.dist.spawn``'s worker body: ``fn(rank, world, *args)``, its result saved."""
    import importlib
    import pickle

    from tests import dist

    call = request["call"]
    fn = importlib.import_module(call["module"])
    for name in call["name"].split("."):
        fn = getattr(fn, name)
    with open(call["args"], "rb") as f:
        args = pickle.load(f)
    dist._worker(rank, fn, request["nproc"], request["port"], call["out_dir"], args)


def _torchrun_dispositions() -> None:
    """The signal dispositions a torchrun rank starts with: torchrun handles SIGTERM, SIGINT,
    SIGHUP and SIGQUIT itself, so a rank it starts has each at its default (SIGINT: Python's
    KeyboardInterrupt), even where torchrun was started with one ignored."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _run_rank(request: dict, rank: int, out_fd: int) -> None:
    """In a forked process: become ``python SCRIPT ARGS`` of ``rank`` (or a spawned worker of
    ``tests.dist.spawn``); never returns."""
    import atexit
    import runpy
    import threading

    code = 1
    try:
        os.setsid()
        if request["nproc"] and "call" not in request:
            _torchrun_dispositions()
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        os.environ.clear()
        os.environ.update(_rank_env(request, rank) if "call" not in request else request["env"])
        os.chdir(request["cwd"])
        try:
            if "call" in request:
                _call(request, rank)
            else:
                script = request["argv"][0]
                sys.argv = list(request["argv"])
                sys.path[0] = os.path.dirname(os.path.abspath(script))
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = _exit_code(stop.code)
        except BaseException:  # noqa: BLE001 -- the interpreter's report of an uncaught one
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # what the interpreter does at exit: non-daemon threads, atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _alive(pid: int, codes: dict) -> bool:
    if pid in codes:
        return False
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        codes[pid] = os.waitstatus_to_exitcode(status)
    return not done


def _signal_sessions(pids: list[int], codes: dict, sig: int) -> None:
    for pid in pids:
        if _alive(pid, codes):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass


def _gone(connection: socket.socket) -> bool:
    """The requester closed its end (it ended, or was killed at its own deadline)."""
    if not select.select([connection], [], [], 0)[0]:
        return False
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _launch(request: dict, connection: socket.socket) -> dict:
    """Fork the launch's processes; wait for them as torchrun (or the plain process's parent)
    would; kill every session at the deadline or once the requester is gone."""
    out_fd = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(max(request["nproc"], 1)):
        pid = os.fork()
        if pid == 0:
            connection.close()
            _run_rank(request, rank, out_fd)
        pids.append(pid)
    os.close(out_fd)
    deadline = time.monotonic() + request["timeout_s"]
    codes: dict[int, int] = {}
    kill_at = None
    while any(_alive(pid, codes) for pid in pids):
        now = time.monotonic()
        if now > deadline or _gone(connection):
            _signal_sessions(pids, codes, signal.SIGKILL)
            for pid in pids:
                if pid not in codes:
                    codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            return {"returncode": -9, "exit_codes": [codes[pid] for pid in pids],
                    "timed_out": True}
        if request["nproc"] and kill_at is None and any(c != 0 for c in codes.values()):
            _signal_sessions(pids, codes, signal.SIGTERM)  # torchrun (and spawn) stop the rest
            kill_at = now + GRACE_S
        if kill_at is not None and now > kill_at:
            _signal_sessions(pids, codes, signal.SIGKILL)
        time.sleep(0.02)
    exit_codes = [codes[pid] for pid in pids]
    if not request["nproc"]:
        return {"returncode": exit_codes[0], "exit_codes": exit_codes, "timed_out": False}
    return {"returncode": int(any(exit_codes)), "exit_codes": exit_codes, "timed_out": False}


def _parent_gone(parent: int) -> bool:
    return os.getppid() != parent


def _refusal(request: dict) -> str:
    """Why this process cannot fork ``request``'s launch ('' where it can): the variables a
    process reads at its start differ from the ones this process started with."""
    from tests import dist

    if dist._start_env(request["env"]) != _START_ENV:
        return "its environment differs from the session's in a variable read at start"
    return ""


def _serve_one(connection: socket.socket) -> None:
    """In a forked handler: read one request, launch it (unless refused), answer."""
    with connection:
        connection.settimeout(None)
        request = json.loads(connection.makefile("r").readline())
        refused = _refusal(request)
        answer = {"refused": refused} if refused else _launch(request, connection)
        connection.sendall((json.dumps(answer) + "\n").encode())


def _reap() -> None:
    """Collect the handlers that ended."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def serve(path: str) -> None:
    """Preload, say "ready" on stdout, then serve each request in a forked handler (launches
    may overlap or nest: a launched tool asking for its own workers) until the process that
    started this one ends."""
    global _START_ENV
    parent = os.getppid()
    started_with = dict(os.environ)
    _preload()
    from tests import dist  # after megatron_2bw (_preload): it imports torch first

    _START_ENV = dist._start_env(started_with)
    gc.freeze()  # the preloaded modules' objects: never scanned again by a fork's collections
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    listener.settimeout(1.0)
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    while not _parent_gone(parent):
        _reap()
        try:
            connection, _ = listener.accept()
        except socket.timeout:
            continue
        if os.fork() == 0:
            listener.close()
            try:
                _serve_one(connection)
            finally:
                os._exit(0)
        connection.close()


if __name__ == "__main__":
    serve(sys.argv[1])
