"""Installs the strict NCCL mode (``strict_comm``) in every process the tests start: the test
session puts this directory on PYTHONPATH unless ``MEGATRON_2BW_STRICT=0``. Installed at
interpreter start, before any module can bind ``torch.distributed``'s functions by name. A
``sitecustomize`` later on the path (the environment's own, if it has one) still runs.
With ``MEGATRON_2BW_COUNT_HOST_SYNCS=1`` it also installs the host-sync counter
(``host_syncs``)."""

import os
import sys


def _chain() -> None:
    """Run the next ``sitecustomize`` on sys.path, which this one shadows."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_chain()

if os.environ.get("MEGATRON_2BW_STRICT", "1") != "0" and os.environ.get("MEGATRON_2BW_STRICT_DIR"):
    import strict_comm

    strict_comm.install()

if os.environ.get("MEGATRON_2BW_COUNT_HOST_SYNCS", "0") == "1":
    import host_syncs

    host_syncs.install()
