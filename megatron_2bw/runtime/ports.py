"""The one way megatron-2bw picks TCP ports for process groups it starts itself.

``MEGATRON_2BW_PORT_RANGE=LO-HI`` confines the picks to that range (a host whose firewall opens
only some ports; launchers side by side on one host, each with a range of its own, which the
OS's ephemeral picks cannot hand out twice); unset, the OS picks.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket

__all__ = ["free_port", "free_ports", "RANGE_VARIABLE"]

RANGE_VARIABLE = "MEGATRON_2BW_PORT_RANGE"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now. Another process may take it before it is bound
    again; launchers that start several ranks pass it to all of them at once."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports, for process groups started side by side (each port is
    held while the next is picked, so none is handed out twice), from ``RANGE_VARIABLE``'s
    range in random order where it is set."""
    candidates = _candidates()
    with contextlib.ExitStack() as held:
        picked: list[int] = []
        while len(picked) < count:
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                s.bind((host, 0 if candidates is None else next(candidates)))
            except OSError:
                if candidates is None:
                    raise
                continue
            except StopIteration:
                raise RuntimeError(f"{RANGE_VARIABLE}={os.environ[RANGE_VARIABLE]}: fewer than "
                                   f"{count} free ports in it") from None
            picked.append(s.getsockname()[1])
        return picked


def _candidates():
    """The range's ports in random order, or None where the OS picks."""
    text = os.environ.get(RANGE_VARIABLE, "").strip()
    if not text:
        return None
    low, _, high = text.partition("-")
    try:
        low, high = int(low), int(high)
    except ValueError:
        low = high = 0
    if not 1024 <= low <= high <= 65535:
        raise ValueError(f"{RANGE_VARIABLE}={text!r}: expected LO-HI with 1024 <= LO <= HI "
                         "<= 65535")
    ports = list(range(low, high + 1))
    random.shuffle(ports)
    return iter(ports)
