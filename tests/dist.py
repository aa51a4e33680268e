"""Launch multi-process runs for tests: spawned gloo workers and torchrun.

Every launch has a wall-clock limit, so a hung collective fails the test instead of hanging CI.

    spawn(fn, world_size, *args, out_dir=..., timeout=...) -> [fn's return value on each rank]
        runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes with torchrun's
        environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port); ``fn`` must be
        importable (module level) and return something ``torch.save`` can write.
    torchrun(script_args, nproc, ...) -> Launch
        ``torchrun --nproc-per-node N script ...`` with a free port; stdout and stderr together.
    python(script_args, ...) -> Launch
        the same script in one plain process (fast: no launcher, no process group).
    tagged_processes(tag) -> [pid]
        the live processes started with MEGATRON_2BW_TEST_TAG=tag in their environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from megatron_2bw.runtime.ports import free_port

__all__ = ["REPO", "free_port", "spawn", "torchrun", "python", "Launch", "subprocess_env",
           "tiny_training_flags", "tagged_processes"]

REPO = Path(__file__).resolve().parents[1]
STRICT = REPO / "tests" / "strict"
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    if _strict(os.environ):  # sitecustomize installed it already where tests/strict is on the path
        from tests.strict import strict_comm

        strict_comm.install()
    torch.set_num_threads(1)
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def spawn(fn, world_size: int, *args, out_dir: str | os.PathLike, timeout: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return the
    results by rank. An exception on any rank is re-raised here with that rank's traceback;
    past ``timeout`` seconds all workers are killed and TimeoutError is raised."""
    os.makedirs(out_dir, exist_ok=True)
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
    """``torchrun --nproc-per-node nproc`` on a free port, from the repository root."""
    command = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               *launcher_args, *script_args]
    return _run(command, subprocess_env(**env), timeout)


def python(script_args: list[str], timeout: float = 120.0, **env: str) -> Launch:
    """One plain Python process, from the repository root."""
    return _run([PYTHON, *script_args], subprocess_env(**env), timeout)


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
