"""The one way megatron-2bw picks TCP ports for process groups it starts itself."""

from __future__ import annotations

import contextlib
import socket

__all__ = ["free_port", "free_ports"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it). Another process may take it before
    it is bound again; launchers that start several ranks pass it to all of them at once."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports, for process groups started side by side (each port is
    held while the next is picked, so the OS cannot hand out one twice)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                   for _ in range(count)]
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
