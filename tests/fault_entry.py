"""Run an entry script with a full disk injected at the file layer.

    torchrun ... tests/fault_entry.py pretrain_gpt_2bw.py FLAGS...

With ``MEGATRON_2BW_TEST_ENOSPC=SUBSTRING`` (and, optionally, ``MEGATRON_2BW_TEST_ENOSPC_RANK``
naming the only rank it hits), opening for writing any path that contains SUBSTRING raises
``OSError(ENOSPC)``, as a full file system would: ``open``, ``io.open`` and ``pathlib``'s
``Path.open`` (torch.distributed.checkpoint's file writer) all go through it. Reads and other
paths are untouched.
"""

from __future__ import annotations

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


def main() -> None:
    substring = os.environ.get("MEGATRON_2BW_TEST_ENOSPC")
    only_rank = os.environ.get("MEGATRON_2BW_TEST_ENOSPC_RANK")
    if substring and (only_rank is None or only_rank == os.environ.get("RANK", "0")):
        _install_full_disk(substring)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
