"""The intra-node link, measured as training meets it: all-reduces between two local processes
(gloo on CPU, NCCL between two GPUs), each after a burst of compute on both ranks, fitted to the
alpha-beta ring model of `cluster.Link.all_reduce`.

An all-reduce issued right after compute costs more than one issued by idle processes: the
ranks arrive apart, and on CPU the transport's threads wake on cores the compute just held
(2 cores, gloo, 512 KiB: 0.65 ms idle, about 3 ms after 3-27 ms of matrix multiplies). Tensor
parallelism issues its all-reduces that way, so the link is measured that way: the time of
compute-then-all-reduce steps minus that of the same compute alone, per message size.

    profile.intra_node_link = measure_links()
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

from megatron_2bw.runtime.ports import free_port

from .cluster import Link

__all__ = ["measure_links", "fit_link"]

BURST_SHAPE = (512, 256, 1024)
"""(m, k, n) of the matrix multiply each rank runs before every all-reduce (a few ms on one
CPU core)."""


def _links_worker(rank: int, world: int, port: int, sizes: list[int], repeats: int,
                  backend: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = "cuda" if backend == "nccl" else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    m, k, n = BURST_SHAPE
    left, right = torch.randn(m, k, device=device), torch.randn(k, n, device=device)

    def steps(buf, communicate: bool) -> float:
        """Seconds per compute(-then-all-reduce) step, over `repeats` steps."""
        dist.barrier()
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(left, right)
            if communicate:
                dist.all_reduce(buf)
        sync()
        return (time.perf_counter() - start) / repeats

    results = []
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        steps(buf, True)  # warm-up
        in_situ = [steps(buf, True) - steps(buf, False) for _ in range(3)]
        results.append((nbytes, max(statistics.median(in_situ), 0.0)))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def measure_links(repeats: int = 20, sizes: Sequence[int] = (2**12, 2**16, 2**19, 2**20, 2**22)
                  ) -> Link:
    """All-reduces between two local processes after compute (gloo on CPU, NCCL between two
    GPUs), fitted to the ring model of `Link.all_reduce` with n = 2:
    time = 2 alpha + n_bytes / beta."""
    import torch
    import torch.multiprocessing as mp

    from megatron_2bw.runtime.device import device_kind

    backend = "nccl" if device_kind() == "cuda" and torch.cuda.device_count() >= 2 else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "links.json")
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            mp.spawn(_links_worker, args=(2, free_port(), list(sizes), repeats, backend, out),
                     nprocs=2, join=True)
        finally:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
        points = json.loads(Path(out).read_text())
    return fit_link(points)


def fit_link(points: Sequence[tuple[float, float]]) -> Link:
    """Least squares time = 2 alpha + n / beta over (n bytes, seconds) points."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    intercept = max(my - slope * mx, 0.0)
    return Link(bandwidth=1.0 / slope, latency=intercept / 2)
