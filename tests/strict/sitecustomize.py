"""Installs the strict NCCL mode (``strict_comm``) in every process the tests start: the test
session puts this directory on PYTHONPATH unless ``MEGATRON_2BW_STRICT=0``."""

import os

if os.environ.get("MEGATRON_2BW_STRICT", "1") != "0" and os.environ.get("MEGATRON_2BW_STRICT_DIR"):
    import strict_comm

    strict_comm.install()
