"""The one way megatron-2bw picks a TCP port for a process group it starts itself."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it). Another process may take it before
    it is bound again; launchers that start several ranks pass it to all of them at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
