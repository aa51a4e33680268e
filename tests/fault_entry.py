"""Run an entry script with a fault injected, or its exit code recorded.

    torchrun ... tests/fault_entry.py pretrain_gpt_2bw.py FLAGS...

``MEGATRON_2BW_TEST_ENOSPC=SUBSTRING``: opening for writing a path that contains SUBSTRING
raises ``OSError(ENOSPC)``, as a full file system would. ``MEGATRON_2BW_TEST_STALL=
MODULE:ATTRIBUTE:N``: the process stops itself (SIGSTOP) at the N-th call of that function.
``MEGATRON_2BW_TEST_EXIT_DIR=DIR``: each rank writes its exit code to ``DIR/rank<RANK>``.
``..._RANK`` variables limit a fault to one rank.

Invariant: nothing else changes (reads and other paths are untouched).
The variables in full: docs/testing.md, "Launching".
"""

from __future__ import annotations

import atexit
import builtins
import errno
import io
import os
import pathlib
import runpy
import sys


def _install_full_disk(substring: str) -> None:
    real_open = io.open

    def open_or_full(file, mode="r", *args, **kwargs):
        writing = any(flag in mode for flag in "wax+")
        if writing and isinstance(file, (str, os.PathLike)) and substring in os.fspath(file):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    builtins.open = io.open = open_or_full
    path_open = pathlib.Path.open

    def path_open_or_full(self, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+") and substring in str(self):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return path_open(self, mode, *args, **kwargs)

    pathlib.Path.open = path_open_or_full


def _install_stall(spec: str) -> None:
    import importlib
    import signal

    module_name, attribute, nth = spec.split(":")
    owner = importlib.import_module(module_name)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    original, calls = getattr(owner, name), [0]

    def stalling(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(nth):
            print(f"stopping in {attribute} (call {nth})", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(*args, **kwargs)

    setattr(owner, name, stalling)


def _for_this_rank(variable: str) -> bool:
    only_rank = os.environ.get(variable)
    return only_rank is None or only_rank == os.environ.get("RANK", "0")


def _run(script: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main() -> None:
    exit_dir = os.environ.get("MEGATRON_2BW_TEST_EXIT_DIR")
    code: list[object] = ["exception"]
    if exit_dir:  # registered before torch (multiprocessing's exit hook): it runs last
        atexit.register(_write_exit_code, exit_dir, code)
    substring = os.environ.get("MEGATRON_2BW_TEST_ENOSPC")
    if substring and _for_this_rank("MEGATRON_2BW_TEST_ENOSPC_RANK"):
        _install_full_disk(substring)
    stall = os.environ.get("MEGATRON_2BW_TEST_STALL")
    if stall and _for_this_rank("MEGATRON_2BW_TEST_STALL_RANK"):
        _install_stall(stall)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    try:
        _run(script)
        code[0] = 0
    except SystemExit as stop:
        code[0] = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        raise


def _write_exit_code(exit_dir: str, code: list[object]) -> None:
    with open(os.path.join(exit_dir, f"rank{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(str(code[0]))


if __name__ == "__main__":
    main()
