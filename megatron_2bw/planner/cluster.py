"""The cluster as the planner sees it: nodes of G devices, memory per device, and two kinds of
links (inside a node, between nodes), each a bandwidth per device and a latency per message.

    cluster = preset("dgx-h100", nodes=128)   # 1024 H100s
    cluster.link_for_group(size=8, stride=1)  # NVLink: a tensor-parallel group inside a node

Bandwidths are bytes/s per device and direction. Between nodes, a device gets its share of the
node's network: every device of a node talks across nodes at once in the collectives that
cross nodes (data-parallel all-reduce, pipeline sends when a stage fills a node).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

__all__ = ["Link", "Cluster", "PRESETS", "preset", "cpu_name", "GiB"]

GiB = 2**30
_Gb = 1e9 / 8  # bytes/s in one Gb/s


@dataclass(frozen=True)
class Link:
    """A path between two devices."""

    bandwidth: float
    """Bytes/s per device, one direction."""
    latency: float
    """Seconds per message (alpha in the alpha-beta model)."""

    def transfer(self, nbytes: float) -> float:
        """One point-to-point message: alpha + n / beta."""
        return self.latency + nbytes / self.bandwidth

    def all_reduce(self, nbytes: float, n: int) -> float:
        """Ring all-reduce of n bytes over n ranks: 2(n-1) steps, each rank sends and receives
        2(n-1)/n of the buffer (Patarasuk & Yuan 2009; Thakur et al. 2005): the bandwidth term
        of the data-parallel cost in PipeDream-2BW Section 4.3 and of Megatron's TP all-reduces."""
        if n <= 1:
            return 0.0
        return 2 * (n - 1) * self.latency + 2 * (n - 1) / n * nbytes / self.bandwidth


@dataclass(frozen=True)
class Cluster:
    """Homogeneous nodes of `gpus_per_node` devices."""

    name: str
    nodes: int
    gpus_per_node: int
    memory_bytes: float
    """Memory per device."""
    intra_node: Link
    """Between devices of one node (NVLink; loopback for CPU processes)."""
    inter_node: Link
    """Between nodes, per device (the node's network divided by its devices)."""
    peak_flops: dict = field(default_factory=dict)
    """Dense peak FLOP/s per device by precision ("fp32", "fp16", "bf16")."""
    memory_bandwidth: float = 1e12
    """Device memory bytes/s (the optimizer step is bound by it)."""
    compute_efficiency: float = 0.5
    """Share of peak a transformer layer reaches without a profile; Megatron-LM SC'21, Table 1
    reports 44-52% of A100 peak for GPT models of 1.7B-1T parameters."""
    device: str = "cuda"
    """"cuda" or "cpu": what the launch flags ask for."""
    device_name: str = ""
    """Names the profile file (`tools/profiles/<device name>.json`)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"need nodes >= 1 and gpus per node >= 1, got {self.nodes} nodes "
                             f"of {self.gpus_per_node}")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_(self, **changes) -> "Cluster":
        return dataclasses.replace(self, **changes)

    def flops(self, precision: str) -> float:
        """Achievable FLOP/s of a transformer layer: peak x efficiency."""
        if precision not in self.peak_flops:
            raise ValueError(f"cluster {self.name} has no peak FLOP/s for {precision}; "
                             f"known: {sorted(self.peak_flops)}")
        return self.peak_flops[precision] * self.compute_efficiency

    def link_for_group(self, size: int, stride: int) -> Link:
        """The slowest link a ring over ranks {r, r + stride, ..., r + (size-1) stride} uses.

        Ranks fill nodes in order (rank // gpus_per_node is the node). The group stays inside
        one node for every r when its span size x stride fits in a node and divides it."""
        if size <= 1:
            return self.intra_node
        span, g = size * stride, self.gpus_per_node
        return self.intra_node if span <= g and g % span == 0 else self.inter_node


def _cpu_memory() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * GiB


def cpu_name() -> str:
    """'cpu <model name>' from /proc/cpuinfo (names the CPU's profile file)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "cpu " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return "cpu " + (platform.processor() or platform.machine())


def _cpu_local() -> Cluster:
    """This machine: one process per core over gloo on loopback. Link and compute numbers are
    rough placeholders; `plan.py profile` measures both and the profile replaces them."""
    cores = os.cpu_count() or 1
    return Cluster(
        name="cpu-local", nodes=1, gpus_per_node=cores,
        memory_bytes=_cpu_memory() / cores,
        intra_node=Link(bandwidth=1e9, latency=100e-6),
        inter_node=Link(bandwidth=1e9, latency=100e-6),
        peak_flops={"fp32": 20e9, "bf16": 5e9, "fp16": 2e9},
        memory_bandwidth=5e9, compute_efficiency=1.0, device="cpu", device_name=cpu_name())


PRESETS: dict[str, Cluster] = {
    # The paper's cluster (PipeDream-2BW Section 5.1): AWS p3.16xlarge, 8 x V100-16GB on
    # NVLink 2.0 (6 links x 25 GB/s per direction), 25 Gb/s Ethernet between servers.
    "v100-25gbe": Cluster(
        name="v100-25gbe", nodes=1, gpus_per_node=8, memory_bytes=16 * GiB,
        intra_node=Link(bandwidth=150e9, latency=5e-6),
        inter_node=Link(bandwidth=25 * _Gb / 8, latency=50e-6),
        peak_flops={"fp32": 15.7e12, "fp16": 125e12, "bf16": 15.7e12},
        memory_bandwidth=900e9, device_name="tesla-v100-sxm2-16gb"),
    # DGX A100: 8 x A100-80GB, NVLink 3 600 GB/s (300 per direction), 8 x 200 Gb/s InfiniBand.
    "dgx-a100": Cluster(
        name="dgx-a100", nodes=1, gpus_per_node=8, memory_bytes=80 * GiB,
        intra_node=Link(bandwidth=300e9, latency=5e-6),
        inter_node=Link(bandwidth=200 * _Gb, latency=10e-6),
        peak_flops={"fp32": 19.5e12, "fp16": 312e12, "bf16": 312e12},
        memory_bandwidth=2.0e12, device_name="nvidia-a100-sxm4-80gb"),
    # DGX H100: 8 x H100-80GB, NVLink 4 900 GB/s (450 per direction), 8 x 400 Gb/s InfiniBand.
    "dgx-h100": Cluster(
        name="dgx-h100", nodes=1, gpus_per_node=8, memory_bytes=80 * GiB,
        intra_node=Link(bandwidth=450e9, latency=5e-6),
        inter_node=Link(bandwidth=400 * _Gb, latency=10e-6),
        peak_flops={"fp32": 67e12, "fp16": 989e12, "bf16": 989e12},
        memory_bandwidth=3.35e12, device_name="nvidia-h100-80gb-hbm3"),
}
ALIASES = {"paper": "v100-25gbe", "v100": "v100-25gbe", "a100": "dgx-a100", "h100": "dgx-h100"}


def preset(name: str, nodes: int | None = None, **changes) -> Cluster:
    """A named cluster ("v100-25gbe" alias "paper", "dgx-a100", "dgx-h100", "cpu-local"),
    with `nodes` and any field overridden."""
    name = ALIASES.get(name, name)
    if name == "cpu-local":
        cluster = _cpu_local()
    elif name in PRESETS:
        cluster = PRESETS[name]
    else:
        raise ValueError(f"unknown cluster {name!r}; choose one of "
                         f"{sorted([*PRESETS, 'cpu-local', *ALIASES])}")
    if nodes is not None:
        changes["nodes"] = nodes
    return cluster.with_(**changes) if changes else cluster
