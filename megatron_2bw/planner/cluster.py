"""The cluster as the planner sees it: nodes of G devices, memory per device, the device's
sustained compute, and two kinds of links: each device's share of the node's NVLink/NVSwitch
fabric, and the node's network adapters (NICs).

    cluster = preset("dgx-h100", nodes=128)      # 1024 H100s
    cluster.group_bandwidth(size=8, stride=1)    # NVLink: a tensor-parallel group in a node
    cluster.group_bandwidth(size=16, stride=1)   # 8 ranks per node, each over its own NIC

Bandwidths are bytes/s in one direction. A link is shared by the ranks that use it at the same
time: on a DGX every GPU has its own NIC, so a ring that leaves a node through k of its GPUs
crosses at k NICs' bandwidth; on the paper's p3.16xlarge the 8 GPUs share one 25 Gb/s adapter,
so the 8 GPUs of a node that all talk across nodes at once get an eighth of it each.
`--gpus-per-node` changes how many GPUs a node holds, never what one link carries.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

__all__ = ["Link", "GemmRate", "Cluster", "PRESETS", "preset", "cpu_name", "GiB", "PrecisionError"]

GiB = 2**30
_Gb = 1e9 / 8  # bytes/s in one Gb/s


class PrecisionError(ValueError):
    """A precision the cluster's devices cannot run (bf16 on V100)."""


@dataclass(frozen=True)
class Link:
    """A path between two devices."""

    bandwidth: float
    """Bytes/s, one direction."""
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
class GemmRate:
    """Sustained FLOP/s of a matrix multiply as a function of its shape.

    rate(n) = peak x max_efficiency x n / (n + half_dim), n the smallest of the GEMM's three
    dimensions (M, N, K): a GEMM whose narrowest side is `half_dim` reaches half of the large-
    GEMM rate (tiles left partly empty, too few tiles per SM wave, K too short to hide the
    loads). One pair of constants per device type, used for every GEMM the model runs,
    attention's batched ones included (their n is the head dimension h/a)."""

    max_efficiency: float = 1.0
    half_dim: float = 0.0

    def efficiency(self, n: float) -> float:
        return self.max_efficiency * n / (n + self.half_dim)


@dataclass(frozen=True)
class Cluster:
    """Homogeneous nodes of `gpus_per_node` devices."""

    name: str
    nodes: int
    gpus_per_node: int
    memory_bytes: float
    """Memory per device."""
    intra_node: Link
    """One device's NVLink/NVSwitch bandwidth inside a node (loopback for CPU processes)."""
    nic: Link
    """One network adapter between nodes."""
    gpus_per_nic: int = 1
    """Devices that share one adapter (1 on DGX systems, 8 on AWS p3.16xlarge)."""
    peak_flops: dict = field(default_factory=dict)
    """Dense peak FLOP/s per device by precision the device supports ("fp32", "fp16",
    "bf16"); a precision missing here is refused."""
    memory_bandwidth: float = 1e12
    """Device memory bytes/s: element-wise kernels and the optimizer step are bound by it."""
    gemm: GemmRate = GemmRate()
    """Sustained share of the 16-bit peak by GEMM shape (fp32 runs at the fp32 peak)."""
    memory_efficiency: float = 1.0
    """Share of `memory_bandwidth` a streaming kernel sustains."""
    default_precision: str = "bf16"
    device: str = "cuda"
    """"cuda" or "cpu": what the launch flags ask for."""
    device_name: str = ""
    """Names the profile file (`tools/profiles/<device name>.json`)."""
    flash_attention: bool = False
    """The devices run FlashAttention kernels (compute capability 8.0 and later: A100, H100,
    H200; FlashAttention-2 and cuDNN's fused attention need Ampere)."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or self.gpus_per_nic < 1:
            raise ValueError(f"need nodes >= 1, gpus per node >= 1 and gpus per NIC >= 1, got "
                             f"{self.nodes} nodes of {self.gpus_per_node}, "
                             f"{self.gpus_per_nic} per NIC")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_(self, **changes) -> "Cluster":
        return dataclasses.replace(self, **changes)

    def check_precision(self, precision: str) -> None:
        """Raise PrecisionError (one line) for a precision the devices do not have."""
        if precision not in self.peak_flops:
            hint = (" (V100 has no bf16: use fp16, which trains with dynamic loss scaling)"
                    if precision == "bf16" else "")
            raise PrecisionError(f"cluster {self.name} has no {precision}{hint}; it supports "
                                 f"{', '.join(sorted(self.peak_flops))}")

    def attention_is_flash(self, backend: str, precision: str) -> bool:
        """Whether `--attention-backend backend` runs FlashAttention-style kernels (no s x s
        matrix kept): flash and fused (cuDNN's) do, unfused and local do not, auto does where
        the devices have them in 16-bit (megatron-core then picks transformer_engine's flash
        or fused attention). ValueError (one line) for flash or fused on devices without."""
        if backend in ("flash", "fused"):
            if not self.flash_attention:
                raise ValueError(f"{backend}: cluster {self.name}'s devices have no "
                                 f"FlashAttention kernels (they need compute capability 8.0, "
                                 f"A100 or later)")
            return True
        if backend == "auto":
            return self.flash_attention and precision in ("fp16", "bf16")
        if backend in ("unfused", "local"):
            return False
        raise ValueError(f"unknown --attention-backend {backend!r}")

    def gemm_flops(self, precision: str, n: float) -> float:
        """Sustained FLOP/s of a GEMM whose smallest dimension is n."""
        self.check_precision(precision)
        return self.peak_flops[precision] * self.gemm.efficiency(n)

    @property
    def stream_bandwidth(self) -> float:
        """Bytes/s an element-wise kernel moves."""
        return self.memory_bandwidth * self.memory_efficiency

    # ---- links ----------------------------------------------------------------------------
    def ranks_per_node(self, size: int, stride: int) -> int:
        """Members of the group {r, r + stride, ..., r + (size-1) stride} inside one node
        (ranks fill nodes in order: rank // gpus_per_node is the node)."""
        return max(1, min(size, self.gpus_per_node // stride))

    def crosses_nodes(self, size: int, stride: int) -> bool:
        """Whether such a group leaves a node for some r: it stays inside for every r when its
        span size x stride fits in a node and divides it."""
        span, g = size * stride, self.gpus_per_node
        return size > 1 and not (span <= g and g % span == 0)

    def nic_share(self, concurrent: int) -> float:
        """Bytes/s one device gets across nodes while `concurrent` devices of its node use the
        network at once: its adapter's bandwidth over the devices sharing that adapter."""
        sharing = max(1, min(self.gpus_per_nic, concurrent, self.gpus_per_node))
        return self.nic.bandwidth / sharing

    def group_link(self, size: int, stride: int) -> Link:
        """The link a ring collective over {r, r + stride, ...} runs at, while every group of
        its kind (every tensor-, or every data-parallel group) runs the same collective.

        Inside a node: NVLink. Across nodes the ring leaves each node through the k group
        members in it (NCCL runs one ring per member, each crossing at its own NIC), so it
        crosses at k NIC shares, all G devices of the node talking across at once; it is never
        faster than NVLink when k > 1 (the ring's other edges)."""
        if not self.crosses_nodes(size, stride):
            return self.intra_node
        k = self.ranks_per_node(size, stride)
        crossing = k * self.nic_share(self.gpus_per_node)
        bandwidth = min(crossing, self.intra_node.bandwidth) if k > 1 else crossing
        return Link(bandwidth, max(self.nic.latency, self.intra_node.latency))

    def all_to_all(self, nbytes: float, size: int, stride: int) -> float:
        """Seconds of an all-to-all over {r, r + stride, ...} in which each of the `size`
        ranks holds `nbytes` and keeps 1/size of it, while every group of its kind (every
        expert-parallel group) does the same.

        Pairwise exchange, the long-message all-to-all (Thakur, Rabenseifner and Gropp 2005,
        "Optimization of Collective Communication Operations in MPICH"): size - 1 steps of
        alpha, and the (size - 1)/size of the buffer that leaves the rank at beta. Across
        nodes a rank's k - 1 node mates take (k - 1)/size of its buffer over NVLink while the
        size - k others take the rest over its NIC share, all G devices of the node sending
        across at once; the two parts run at the same time (NCCL posts every peer's send
        together)."""
        if size <= 1:
            return 0.0
        if not self.crosses_nodes(size, stride):
            link = self.intra_node
            return (size - 1) * link.latency + (size - 1) / size * nbytes / link.bandwidth
        k = self.ranks_per_node(size, stride)
        inside = (k - 1) / size * nbytes / self.intra_node.bandwidth
        across = (size - k) / size * nbytes / self.nic_share(self.gpus_per_node)
        latency = max(self.nic.latency, self.intra_node.latency)
        return (size - 1) * latency + max(inside, across)

    def p2p_link(self, depth: int, stride: int) -> Link:
        """Between neighbouring pipeline stages, `stride` = t w ranks apart: NVLink when the
        whole pipeline lies in one node; else the slowest boundary crosses nodes, where the
        min(stride, G) devices of a node that send across at once share their adapters."""
        if not self.crosses_nodes(depth, stride):
            return self.intra_node
        return Link(self.nic_share(min(stride, self.gpus_per_node)), self.nic.latency)


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
        nic=Link(bandwidth=1e9, latency=100e-6),
        peak_flops={"fp32": 20e9, "bf16": 5e9, "fp16": 2e9},
        memory_bandwidth=5e9, default_precision="fp32", device="cpu", device_name=cpu_name())


# Sustained GEMM rate of NVIDIA tensor-core GPUs: large GEMMs at 72% of the dense 16-bit peak,
# a GEMM 96 wide (a 96-wide attention head) at half of that; element-wise kernels stream at 80%
# of the memory bandwidth. Derived once, as the one triple that brings all ten rows of
# Megatron-LM SC'21 Table 1 (DGX A100, NGC PyTorch 20.12) within 6% at the same time (a grid
# over max efficiency 0.70-0.80, half width 0-256, streaming 0.5-0.9; docs/planner.md,
# "Calibration"); no row has a constant of its own. The other GPU types keep the same shape
# constants with their own peaks and bandwidths.
_TENSOR_CORE_GEMM = GemmRate(max_efficiency=0.72, half_dim=96.0)
_STREAM = 0.80

PRESETS: dict[str, Cluster] = {
    # The paper's cluster (PipeDream-2BW Section 5.1): AWS p3.16xlarge, 8 x V100-SXM2-16GB.
    # V100 datasheet: 125 TFLOP/s fp16 tensor core, 15.7 TFLOP/s fp32, 900 GB/s HBM2, NVLink 2.0
    # 300 GB/s per GPU (6 links x 25 GB/s per direction: 150 GB/s one way). AWS EC2 P3 page:
    # p3.16xlarge has 25 Gb/s networking, one adapter for the 8 GPUs. No bf16: fp16 with loss
    # scaling, as the paper trained.
    "v100-25gbe": Cluster(
        name="v100-25gbe", nodes=1, gpus_per_node=8, memory_bytes=16 * GiB,
        intra_node=Link(bandwidth=150e9, latency=5e-6),
        nic=Link(bandwidth=25 * _Gb, latency=50e-6), gpus_per_nic=8,
        peak_flops={"fp32": 15.7e12, "fp16": 125e12},
        memory_bandwidth=900e9, gemm=_TENSOR_CORE_GEMM, memory_efficiency=_STREAM,
        default_precision="fp16", device_name="tesla-v100-sxm2-16gb"),
    # DGX A100 (NVIDIA DGX A100 datasheet and user guide): 8 x A100-SXM4-80GB, 312 TFLOP/s
    # dense bf16/fp16, 19.5 fp32, 2,039 GB/s HBM2e; NVLink 3 through NVSwitch 600 GB/s per GPU
    # (300 one way); 8 x ConnectX-6 HDR 200 Gb/s InfiniBand, one per GPU. Megatron-LM SC'21's
    # Selene nodes.
    "dgx-a100": Cluster(
        name="dgx-a100", nodes=1, gpus_per_node=8, memory_bytes=80 * GiB,
        intra_node=Link(bandwidth=300e9, latency=5e-6),
        nic=Link(bandwidth=200 * _Gb, latency=10e-6), gpus_per_nic=1,
        peak_flops={"fp32": 19.5e12, "fp16": 312e12, "bf16": 312e12},
        memory_bandwidth=2.039e12, gemm=_TENSOR_CORE_GEMM, memory_efficiency=_STREAM,
        device_name="nvidia-a100-sxm4-80gb", flash_attention=True),
    # DGX H100 (NVIDIA DGX H100 datasheet; H100 SXM5 datasheet): 8 x H100-80GB, 989 TFLOP/s
    # dense bf16/fp16, 67 fp32, 3.35 TB/s HBM3; NVLink 4 900 GB/s per GPU (450 one way);
    # 8 x ConnectX-7 400 Gb/s InfiniBand/Ethernet, one per GPU.
    "dgx-h100": Cluster(
        name="dgx-h100", nodes=1, gpus_per_node=8, memory_bytes=80 * GiB,
        intra_node=Link(bandwidth=450e9, latency=5e-6),
        nic=Link(bandwidth=400 * _Gb, latency=10e-6), gpus_per_nic=1,
        peak_flops={"fp32": 67e12, "fp16": 989e12, "bf16": 989e12},
        memory_bandwidth=3.35e12, gemm=_TENSOR_CORE_GEMM, memory_efficiency=_STREAM,
        device_name="nvidia-h100-80gb-hbm3", flash_attention=True),
    # DGX H200 (NVIDIA DGX H200 datasheet; H200 SXM datasheet): 8 x H200 141 GB HBM3e at
    # 4.8 TB/s, the H100's 989 TFLOP/s dense bf16; NVLink 4 900 GB/s per GPU; 8 x ConnectX-7
    # 400 Gb/s, one per GPU.
    "dgx-h200": Cluster(
        name="dgx-h200", nodes=1, gpus_per_node=8, memory_bytes=141e9,
        intra_node=Link(bandwidth=450e9, latency=5e-6),
        nic=Link(bandwidth=400 * _Gb, latency=10e-6), gpus_per_nic=1,
        peak_flops={"fp32": 67e12, "fp16": 989e12, "bf16": 989e12},
        memory_bandwidth=4.8e12, gemm=_TENSOR_CORE_GEMM, memory_efficiency=_STREAM,
        device_name="nvidia-h200", flash_attention=True),
}
ALIASES = {"paper": "v100-25gbe", "v100": "v100-25gbe", "a100": "dgx-a100", "h100": "dgx-h100",
           "h200": "dgx-h200"}


def preset(name: str, nodes: int | None = None, **changes) -> Cluster:
    """A named cluster ("v100-25gbe" alias "paper", "dgx-a100", "dgx-h100", "dgx-h200",
    "cpu-local"), with `nodes` and any field overridden."""
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

