"""Strict NCCL mode: NCCL's rules enforced at run time on gloo, for the multi-process tests.

gloo buffers sends and accepts calls from any thread, so a program that hangs on a GPU cluster
passes on CPU processes. Installed in a process (``install()``; the tests do it in every child
through ``tests/strict/sitecustomize.py``), this module wraps ``torch.distributed``'s
communication functions so that:
1. a send completes only once the peer posted the matching receive (a token in the store);
2. every call comes from the main thread;
3. every member of a group issues the same collectives (recorded, compared by :func:`check`);
4. communicators are created lazily, as on NCCL: a group's first use waits for every member.
A breach raises ``StrictModeError`` naming it, or fails the test at the check.

Only the outermost wrapped call counts. ``MEGATRON_2BW_STRICT=0`` turns the mode off.
Each rule in detail: docs/testing.md, "Strict NCCL mode".
"""

from __future__ import annotations

import datetime
import functools
import inspect
import json
import os
import threading
from collections import defaultdict
from pathlib import Path

__all__ = ["StrictModeError", "Records", "install", "installed", "enabled", "check",
           "COLLECTIVES", "P2P"]

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "barrier", "all_to_all",
               "all_to_all_single", "gather", "scatter", "reduce", "all_gather_object",
               "broadcast_object_list", "gather_object", "scatter_object_list",
               "monitored_barrier")
P2P = ("batch_isend_irecv", "isend", "irecv", "send", "recv")
OTHERS = ("new_group", "new_subgroups", "init_process_group", "destroy_process_group")

_SENDS = ("isend", "send")
_END = "__end__"  # recorded by destroy_process_group: this member finished its sequence


class StrictModeError(RuntimeError):
    """A call that breaks one of NCCL's rules (see the module docstring)."""


def enabled() -> bool:
    """Strict mode is on unless ``MEGATRON_2BW_STRICT=0``."""
    return os.environ.get("MEGATRON_2BW_STRICT", "1") != "0"


_state = threading.local()  # depth of wrapped calls on this thread
_originals: dict[str, object] = {}
_sent: dict[tuple, int] = defaultdict(int)      # (group, src, dst) -> sends issued
_received: dict[tuple, int] = defaultdict(int)  # (group, src, dst) -> receives posted
_log = None
_used: set[str] = set()    # groups whose communicator this process created (first use done)
_gloo: set[str] = set()    # groups created with backend="gloo": connected at creation


_MARK = "_megatron_2bw_strict"  # set on every wrapper, whichever copy of this module made it


def installed() -> bool:
    """Whether this process runs in strict mode (installed by this or another copy of this
    module: ``strict_comm`` from sitecustomize, ``tests.strict.strict_comm`` from a test)."""
    import sys

    if _originals:
        return True
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    return c10d is not None and getattr(getattr(c10d, "all_reduce", None), _MARK, False)


def install() -> None:
    """Wrap torch.distributed's communication functions in this process (idempotent, also
    across copies of this module: wrapping twice would run every handshake twice). Call it
    before any other module binds them by name (``from torch.distributed import all_reduce``)."""
    import torch.distributed as dist

    if installed() or not dist.is_available():
        return
    from torch.distributed import distributed_c10d as c10d

    for name in (*COLLECTIVES, *P2P, *OTHERS):
        original = getattr(c10d, name, None)
        if original is None:
            continue
        _originals[name] = original
        wrapped = _wrap(name, original)
        setattr(c10d, name, wrapped)  # c10d's own globals: P2POp checks ``op in (isend, irecv)``
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)


def _wrap(name: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        depth = getattr(_state, "depth", 0)
        if depth:
            return original(*args, **kwargs)
        _require_main_thread(name)
        _state.depth = 1
        try:
            return _outermost(name, original, signature, args, kwargs)
        finally:
            _state.depth = 0

    setattr(wrapper, _MARK, True)
    return wrapper


def _outermost(name: str, original, signature, args, kwargs):
    if name == "batch_isend_irecv":
        if args[0]:
            _first_use(name, args[0][0].group)
        _handshake([(op.op.__name__, op.tensor, _global_peer(op), op.group) for op in args[0]])
    elif name in P2P:
        bound = signature.bind(*args, **kwargs).arguments
        peer = bound.get("dst" if name in _SENDS else "src")
        if peer is None:  # the group-relative form
            peer = _global(bound.get("group"), bound.get("group_dst", bound.get("group_src")))
        if peer is None:
            raise StrictModeError(f"strict NCCL mode: torch.distributed.{name} without a peer "
                                  f"(a receive from any source): NCCL has none")
        _handshake([(name, bound.get("tensor"), peer, bound.get("group"))])
    elif name in COLLECTIVES:
        arguments = signature.bind(*args, **kwargs).arguments
        _first_use(name, arguments.get("group"))
        _record(name, arguments)
    elif name == "new_group":
        group = original(*args, **kwargs)
        if str(signature.bind(*args, **kwargs).arguments.get("backend")).lower() == "gloo":
            _gloo.add(getattr(group, "group_name", None))
        return group
    elif name == "init_process_group":
        result = original(*args, **kwargs)
        _publish_run_key()
        return result
    elif name == "destroy_process_group":
        bound = signature.bind(*args, **kwargs).arguments
        if bound.get("group") is None:
            _write({"op": _END})
            _used.clear()  # a later init_process_group starts over with new communicators
            _gloo.clear()
    return original(*args, **kwargs)


def _require_main_thread(name: str) -> None:
    thread = threading.current_thread()
    if thread is not threading.main_thread():
        raise StrictModeError(
            f"strict NCCL mode: torch.distributed.{name} called from thread {thread.name!r}, "
            f"not the main thread: NCCL needs one issuing thread per communicator set")


# ---- point-to-point: rendezvous through the store -------------------------------------------

def _default_group():
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_group()


def _global(group, group_rank):
    import torch.distributed as dist

    if group_rank is None:
        return None
    return dist.get_global_rank(group or _default_group(), group_rank)


def _global_peer(op) -> int:
    return op.peer if op.peer is not None else _global(op.group, op.group_peer)


def _group_name(group) -> str:
    return (group or _default_group()).group_name


def _timeout(group) -> datetime.timedelta:
    """MEGATRON_2BW_STRICT_TIMEOUT_S, else the group's own timeout (what NCCL would wait)."""
    import torch

    seconds = os.environ.get("MEGATRON_2BW_STRICT_TIMEOUT_S")
    if seconds:
        return datetime.timedelta(seconds=float(seconds))
    try:
        return (group or _default_group())._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return datetime.timedelta(minutes=10)


def _handshake(ops: list[tuple]) -> None:
    """Post a ready token for every receive of one call, then wait for the peer's token of
    every send; raise StrictModeError where a send's receive is not posted in time."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    me = dist.get_rank()
    sends = []
    for kind, _, peer, group in ops:
        if kind in _SENDS:
            sends.append((peer, group))
            continue
        channel = (_group_name(group), peer, me)
        store.set(_token(channel, _received[channel]), b"1")
        _received[channel] += 1
    for peer, group in sends:
        channel = (_group_name(group), me, peer)
        key, bound = _token(channel, _sent[channel]), _timeout(group)
        try:
            store.wait([key], bound)
        except Exception as error:  # the store raises on its timeout
            raise StrictModeError(
                f"strict NCCL mode: rank {me}'s send #{_sent[channel]} to rank {peer} (group "
                f"{channel[0]}) found no matching receive posted by rank {peer} within "
                f"{bound.total_seconds():g} s: under NCCL this send never completes") from error
        store.delete_key(key)
        _sent[channel] += 1


def _token(channel: tuple, n: int) -> str:
    group, src, dst = channel
    return f"strict/{group}/{src}->{dst}/{n}"


# ---- lazy communicator creation: a group's first use is a barrier of its members ------------

def _eager() -> bool:
    """Whether NCCL would create every group's communicator when the group is created: the
    default group is bound to a device (``init_process_group(device_id=...)``)."""
    return getattr(_default_group(), "bound_device_id", None) is not None


def _caller() -> str:
    """file:line (function) of the innermost frame outside torch and this module."""
    import traceback

    for frame in reversed(traceback.extract_stack()[:-1]):
        path = frame.filename.replace(os.sep, "/")
        if "/torch/" not in path and not path.endswith("strict_comm.py"):
            return f"{path}:{frame.lineno} ({frame.name})"
    return "?"


def _first_use(name: str, group) -> None:
    """Model NCCL's lazy creation of ``group``'s communicator at its first use (module
    docstring, rule 4): wait, through the store, until every member reached its own."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    group_name = _group_name(group)
    if group_name in _used or group_name in _gloo:
        return
    _used.add(group_name)
    if _eager():
        return
    store, me = c10d._get_default_store(), dist.get_rank()
    ranks = dist.get_process_group_ranks(group or _default_group())
    where, bound = _caller(), _timeout(group)
    store.set(f"strict/created/{group_name}/{me}", where)
    keys = [f"strict/created/{group_name}/{rank}" for rank in ranks]
    try:
        store.wait(keys, bound)
    except Exception as error:  # the store raises on its timeout
        missing = [rank for rank, key in zip(ranks, keys) if not store.check([key])]
        description = getattr(group or _default_group(), "group_desc", "") or "unnamed"
        raise StrictModeError(
            f"strict NCCL mode: lazy communicator creation would hang on NCCL: group "
            f"{group_name} ({description}, ranks {ranks}) first used by {name} at {where} on "
            f"rank {me}; rank(s) {missing} did not reach their first use of it within "
            f"{bound.total_seconds():g} s (create every communicator up front: "
            f"init_process_group(device_id=...) or a warm-up collective per group)") from error


# ---- collectives: one JSON line each ---------------------------------------------------------

_run: str | None = None


def _publish_run_key() -> None:
    """Rank 0 names the launch once its process group exists: its port, pid and start time,
    through the default group's store (ports are reused within a test session)."""
    import time

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if dist.get_rank() == 0:
        c10d._get_default_store().set(
            "strict/run", f"{os.environ.get('MASTER_PORT', '?')}-{os.getpid()}-{time.time():.3f}")


def _run_key() -> str:
    """The launch's name, the same on every rank (see _publish_run_key)."""
    global _run
    if _run is None:
        from torch.distributed import distributed_c10d as c10d

        _run = c10d._get_default_store().get("strict/run").decode()
    return _run


def _write(record: dict) -> None:
    global _log
    directory = os.environ.get("MEGATRON_2BW_STRICT_DIR")
    if not directory:
        return
    import torch.distributed as dist

    if _log is None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        name = f"comm-{os.getpid()}-{os.urandom(4).hex()}.jsonl"
        _log = open(Path(directory) / name, "a", buffering=1)
    rank = dist.get_rank() if dist.is_initialized() else -1
    _log.write(json.dumps({"run": _run_key(), "rank": rank, **record}) + "\n")


def _first_tensor(arguments: dict):
    import torch

    for value in arguments.values():
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


def _record(name: str, arguments: dict) -> None:
    import torch.distributed as dist

    group = arguments.get("group")
    tensor = _first_tensor(arguments)
    shape = None if tensor is None else list(tensor.shape)
    if name == "all_to_all_single" and shape and (
            arguments.get("output_split_sizes") is not None
            or arguments.get("input_split_sizes") is not None):
        shape[0] = "v"  # all-to-all-v (MoE token dispatch): each member's own row count
    _write({"op": name, "group": _group_name(group),
            "ranks": dist.get_process_group_ranks(group or _default_group()),
            "shape": shape, "dtype": None if tensor is None else str(tensor.dtype)})


class Records:
    """The collectives recorded in a directory, read incrementally (each file from where the
    last :meth:`update` stopped)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.offsets: dict[Path, int] = {}
        self.sequences: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(list))
        self.members: dict[tuple, list[int]] = {}
        self.finished: dict[str, set[int]] = defaultdict(set)

    def update(self) -> set[str]:
        """Read what was appended since the last call; return the runs it touched."""
        touched = set()
        for path in sorted(self.directory.glob("comm-*.jsonl")):
            with open(path, "rb") as file:
                file.seek(self.offsets.get(path, 0))
                data = file.read()
            complete = data[:data.rfind(b"\n") + 1]  # a line being written is read next time
            self.offsets[path] = self.offsets.get(path, 0) + len(complete)
            for line in complete.decode().splitlines():
                touched.add(self._add(json.loads(line)))
        return touched

    def _add(self, record: dict) -> str:
        run = record["run"]
        if record["op"] == _END:
            self.finished[run].add(record["rank"])
            return run
        key = (run, record["group"])
        self.members[key] = record["ranks"]
        self.sequences[key][record["rank"]].append(
            (record["op"], record["shape"], record["dtype"]))
        return run

    def problems(self, runs: set[str] | None = None) -> list[str]:
        """One line per group (of ``runs``, default all) whose members disagree."""
        found = []
        for key, by_rank in sorted(self.sequences.items()):
            if runs is None or key[0] in runs:
                problem = _disagreement(key, self.members[key], by_rank, self.finished[key[0]])
                if problem:
                    found.append(problem)
        return found


def check(directory: str | os.PathLike) -> list[str]:
    """Compare every group's members' collective sequences, per run: one line per group where
    two members differ at some index, or (when both reached destroy_process_group) in length.
    A member that stopped early (a failure test) is compared on the prefix it issued."""
    records = Records(directory)
    records.update()
    return records.problems()


def _disagreement(key: tuple, ranks: list[int], by_rank: dict[int, list],
                  finished: set[int]) -> str | None:
    run, group = key
    first = ranks[0]
    for rank in ranks[1:]:
        mine, theirs = by_rank.get(first, []), by_rank.get(rank, [])
        for index, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                return (f"run {run}, group {group} (ranks {ranks}): collective #{index} is "
                        f"{_show(a)} on rank {first} but {_show(b)} on rank {rank}")
        if len(mine) != len(theirs) and {first, rank} <= finished:
            return (f"run {run}, group {group} (ranks {ranks}): rank {first} issued "
                    f"{len(mine)} collectives, rank {rank} {len(theirs)}")
    return None


def _show(entry: tuple) -> str:
    op, shape, dtype = entry
    return op if shape is None else f"{op}({shape}, {dtype})"
