"""Measurements the cost model can use instead of closed forms.

Layer profile (`measure`): one megatron-core transformer layer, built from the same
TransformerConfig training builds, timed forward and backward at several microbatch sizes, with
and without full recomputation, with the bytes autograd keeps for the backward; plus the
embedding and the output layer with its loss, and the optimizer step. A tensor-parallel rank is
emulated in one process by a layer of a/t heads and f/t FFN width (what one of t ranks computes,
without the all-reduces, which the cost model adds from the links). On CUDA it runs on the
current GPU, elsewhere on CPU through `megatron_2bw.runtime.cpu` (one process, a gloo process
group of 1, `initialize_model_parallel(1, 1)`). `measure_links` times all-reduces between two
local processes (gloo on CPU, NCCL between two GPUs) for the intra-node link.

End-to-end profile (`run_end_to_end`): whole configurations trained for a few iterations with
torchrun on `pretrain_gpt_2bw.py` (`pretrain_bert_2bw.py` for BERT) with `--mock-data`, reading
the time per iteration and peak memory from the training log.

Profiles are JSON, named after the device (`tools/profiles/<device name>.json`), and load
anywhere (`Profile.load`), so a profile taken on a GPU node plans on a laptop.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from megatron_2bw.runtime.ports import free_port

from .cluster import Link, cpu_name as _cpu_name
from .model import ModelSpec

__all__ = ["Sample", "Profile", "E2ERun", "E2EProfile", "Accuracy", "measure", "measure_links",
           "run_end_to_end", "parse_training_log", "compare", "format_accuracy",
           "default_profile_path", "device_slug", "PROFILE_DIR"]

REPO = Path(__file__).resolve().parents[2]
PROFILE_DIR = REPO / "tools" / "profiles"
PARTS = ("layer", "embedding", "head")


class _JsonFile:
    """Saved as indented JSON with a "format" line; a file of another format is refused."""

    FORMAT = ""

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "format": self.FORMAT}

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike):
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path} holds a JSON {type(data).__name__}, not a {cls.FORMAT!r} "
                             "object")
        found = data.pop("format", cls.FORMAT)
        if found != cls.FORMAT:
            raise ValueError(f"{path} holds a {found!r}, not a {cls.FORMAT!r} (a layer profile "
                             "goes with --profile, end-to-end runs with --measured)")
        return cls.from_json(data)


@dataclass(frozen=True)
class Sample:
    """One measured part at one (tensor-parallel size, microbatch size, recomputation)."""

    part: str
    """"layer" (one transformer layer), "embedding" (word + position embedding, first stage)
    or "head" (final LayerNorm, output layer and cross entropy, last stage)."""
    tp: int
    """Tensor-parallel size emulated (the part's per-rank shapes)."""
    micro_batch: int
    recompute: bool
    forward_s: float
    backward_s: float
    """Backward time; with recomputation it includes the recomputed forward."""
    activation_bytes: float
    """Bytes autograd keeps from the forward for the backward (parameters excluded)."""


@dataclass
class Profile(_JsonFile):
    """A layer profile: what `plan.py profile` writes and `plan.py --profile` reads."""

    device: str
    """"cuda" or "cpu"."""
    device_name: str
    precision: str
    model: ModelSpec
    """The sizes measured (h, a, s, f, V); another model is scaled by FLOPs and by the closed-
    form activation bytes."""
    samples: list[Sample] = field(default_factory=list)
    threads: int = 1
    optimizer_fixed_s: float = 0.0
    """Optimizer step (with gradient finalisation and clipping): fixed part ..."""
    optimizer_per_param_s: float = 0.0
    """... plus this per parameter of the stage."""
    runtime_overhead_bytes: float = 0.0
    """Memory in use before any model exists (on CPU the process's resident set with torch and
    megatron-core loaded; 0 on CUDA, whose allocator statistics start empty)."""
    intra_node_link: Link | None = None
    """Measured between two local processes, when `measure_links` ran."""
    compute_scale: float = 1.0
    """A whole training iteration of the profiled model on one device (`calibrate`), measured,
    over its prediction from the parts above: the work the parts leave out (data, the loss,
    DDP's gradient hooks, the training loop, the working set of a whole model instead of one
    layer). The cost model multiplies every compute and optimizer time by it."""
    calibration: dict = field(default_factory=dict)
    """What `compute_scale` comes from: the layout, measured and predicted seconds."""
    created: str = ""
    versions: dict = field(default_factory=dict)

    # ---- lookup ---------------------------------------------------------------------------
    def lookup(self, part: str, tp: int, micro_batch: int, recompute: bool) -> Sample | None:
        """The measured sample nearest to (tp, micro_batch, recompute): this tp if it was
        measured, else tp = 1 (the returned sample's `tp` says which); the nearest microbatch
        size, its times and bytes scaled by micro_batch / measured. None when `part` was not
        measured."""
        rc = recompute if part == "layer" else False
        for tp_try in dict.fromkeys((tp, 1)):
            pool = [s for s in self.samples if s.part == part and s.tp == tp_try
                    and s.recompute == rc]
            if not pool:
                continue
            near = min(pool, key=lambda s: (abs(math.log(s.micro_batch / micro_batch)),
                                            -s.micro_batch))
            scale = micro_batch / near.micro_batch
            return dataclasses.replace(
                near, micro_batch=micro_batch, forward_s=near.forward_s * scale,
                backward_s=near.backward_s * scale,
                activation_bytes=near.activation_bytes * scale)
        return None

    def optimizer_step_s(self, params: float) -> float:
        return self.optimizer_fixed_s + self.optimizer_per_param_s * params

    # ---- JSON -----------------------------------------------------------------------------
    FORMAT = "megatron-2bw layer profile v1"

    @classmethod
    def from_json(cls, data: dict) -> "Profile":
        data = dict(data)
        data.pop("format", None)
        data["model"] = ModelSpec(**data["model"])
        data["samples"] = [Sample(**s) for s in data.get("samples", [])]
        if data.get("intra_node_link"):
            data["intra_node_link"] = Link(**data["intra_node_link"])
        return cls(**data)


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def default_profile_path(device_name: str) -> Path:
    """tools/profiles/<device name>.json"""
    return PROFILE_DIR / f"{device_slug(device_name)}.json"


def _rss_bytes() -> float:
    """This process's resident set now (Linux), else its peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


# ---- layer profile ------------------------------------------------------------------------


def _training_args(model: ModelSpec, precision: str, cpu: bool):
    """The validated flags training would parse for this model (one process)."""
    from megatron_2bw.arguments import build_parser, validate_args

    argv = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
            "--num-attention-heads", str(model.num_attention_heads),
            "--seq-length", str(model.seq_length), "--max-position-embeddings",
            str(model.seq_length), "--mock-data", "--vocab-size", str(model.vocab_size),
            "--micro-batch-size", "1", "--lr", "1e-4", "--train-iters", "1"]
    if model.ffn_hidden_size:
        argv += ["--ffn-hidden-size", str(model.ffn_hidden_size)]
    if not model.dropout:
        argv += ["--hidden-dropout", "0", "--attention-dropout", "0"]
    if precision in ("bf16", "fp16"):
        argv.append(f"--{precision}")
    if cpu:
        argv.append("--cpu")
    return validate_args(build_parser().parse_args(argv), world_size=1)


class _SavedBytes:
    """Sums the storage bytes autograd saves for the backward, each storage once, parameters
    excluded (a part's input counts: a layer's input is what the layer before it leaves)."""

    def __init__(self, exclude: Iterable):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.seen: dict[int, int] = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.exclude and ptr != 0:
            self.seen[ptr] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _clock(device: str) -> Callable[[], float]:
    """Wall time on CUDA (synchronised); on a CPU with one thread, this thread's CPU time,
    which other processes sharing the cores do not inflate (a training process has a core to
    itself; a busy machine should not make the profile slower than the training)."""
    import torch

    if device == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _time_part(run_forward: Callable, params: list, sync: Callable, repeats: int,
               warmup: int, clock: Callable[[], float] = time.perf_counter
               ) -> tuple[float, float, float]:
    """(forward seconds, backward seconds, saved bytes): medians over `repeats` timed runs of
    `run_forward()` -> scalar loss or (output, grad) and its backward."""
    import torch

    def once(timed: bool, counter: _SavedBytes | None = None):
        sync()
        start = clock()
        if counter is not None:
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                out, grad = run_forward()
        else:
            out, grad = run_forward()
        sync()
        middle = clock()
        out.backward(grad)
        sync()
        end = clock()
        for p in params:
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad = None
        return middle - start, end - middle

    counter = _SavedBytes(params)
    once(False, counter)
    for _ in range(warmup):
        once(False)
    forward, backward = zip(*(once(True) for _ in range(repeats)))
    return statistics.median(forward), statistics.median(backward), float(counter.total)


def measure(model: ModelSpec, precision: str = "fp32", micro_batches: Sequence[int] = (1, 2, 4, 8),
            tensor_parallel: Sequence[int] = (1,), recompute: Sequence[bool] = (False, True),
            repeats: int = 5, warmup: int = 2, threads: int | None = None,
            force_cpu: bool = False, log: Callable[[str], None] = lambda s: None) -> Profile:
    """Profile one layer, the embedding and the head of `model` on this process's device.

    Starts (and leaves) a process group of 1 when none exists; call it in a fresh process."""
    import torch
    import torch.distributed as dist

    from megatron_2bw.runtime import cpu as cpu_runtime

    device = cpu_runtime.select_device(force_cpu)
    if device == "cpu":
        cpu_runtime.install(force=force_cpu)
        torch.set_num_threads(threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    else:
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=0, world_size=1)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    overhead = _runtime_overhead() if device == "cpu" else 0.0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    args = _training_args(model, precision, cpu=device == "cpu")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    profile = Profile(
        device=device,
        device_name=torch.cuda.get_device_name() if device == "cuda" else _cpu_name(),
        precision=precision, model=model, threads=torch.get_num_threads(),
        runtime_overhead_bytes=overhead,
        created=datetime.datetime.now().isoformat(timespec="seconds"),
        versions=_versions())
    for t in tensor_parallel:
        if model.num_attention_heads % t or model.ffn % t:
            log(f"skip tp={t}: {model.num_attention_heads} heads / FFN {model.ffn} not divisible")
            continue
        for b in micro_batches:
            for rc in recompute:
                f, bw, nbytes = _measure_layer(args, model, device, t, b, rc, sync, repeats,
                                               warmup)
                profile.samples.append(Sample("layer", t, b, rc, f, bw, nbytes))
                log(f"layer      tp={t} b={b:<3} recompute={rc!s:<5} forward {f * 1e3:8.2f} ms"
                    f"  backward {bw * 1e3:8.2f} ms  activations {nbytes / 2**20:8.2f} MiB")
            for part in ("embedding", "head"):
                f, bw, nbytes = _measure_outer(args, model, device, part, t, b, sync, repeats,
                                               warmup)
                profile.samples.append(Sample(part, t, b, False, f, bw, nbytes))
                log(f"{part:<10} tp={t} b={b:<3}                 forward {f * 1e3:8.2f} ms"
                    f"  backward {bw * 1e3:8.2f} ms  activations {nbytes / 2**20:8.2f} MiB")
    profile.optimizer_fixed_s, profile.optimizer_per_param_s = _measure_optimizer(
        args, model, device, sync, repeats)
    log(f"optimizer step: {profile.optimizer_fixed_s * 1e3:.2f} ms + "
        f"{profile.optimizer_per_param_s * 1e9:.2f} ns/parameter")
    return profile


def _runtime_overhead() -> float:
    """Resident bytes of a training process before its model exists: this process with the
    modules a training process loads imported."""
    import importlib

    for name in ("megatron_2bw.training.loop", "megatron_2bw.schedules.executor",
                 "megatron_2bw.data.gpt", "megatron.core.optimizer",
                 "megatron.core.models.gpt"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    return _rss_bytes()


def _versions() -> dict:
    import torch

    try:
        from importlib.metadata import version

        megatron = version("megatron-core")
    except Exception:  # noqa: BLE001 - a missing distribution only loses the record
        megatron = "unknown"
    return {"torch": torch.__version__, "megatron-core": megatron}


def _config(args, model: ModelSpec, device: str, t: int, recompute: bool, num_layers: int = 1):
    """Training's TransformerConfig for one of t tensor-parallel ranks (a/t heads, f/t FFN)."""
    from megatron_2bw.training.build import transformer_config

    rc = dict(recompute_granularity="full", recompute_method="uniform",
              recompute_num_layers=1) if recompute else {}
    return transformer_config(
        args, device, num_layers=num_layers, num_attention_heads=model.num_attention_heads // t,
        kv_channels=model.hidden_size // model.num_attention_heads,
        ffn_hidden_size=model.ffn // t, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, **rc)


def _layer_spec(args, model: ModelSpec):
    from megatron_2bw import entry

    if model.kind == "bert" and hasattr(entry, "bert_layer_spec"):
        return entry.bert_layer_spec(args)
    return entry.gpt_layer_spec(args)


def _block(args, model, device, t, recompute, num_layers=1):
    import torch
    from megatron.core.transformer.transformer_block import TransformerBlock

    config = _config(args, model, device, t, recompute, num_layers)
    block = TransformerBlock(config, _layer_spec(args, model), pre_process=True,
                             post_process=False)
    if device == "cuda":
        block.cuda()
    block.train()
    return block, config


def _measure_layer(args, model: ModelSpec, device: str, t: int, b: int, recompute: bool,
                   sync, repeats: int, warmup: int) -> tuple[float, float, float]:
    import torch

    block, config = _block(args, model, device, t, recompute)
    s, h = model.seq_length, model.hidden_size
    dtype = config.params_dtype
    x = torch.randn(s, b, h, dtype=dtype, device=device, requires_grad=True)  # (s, b, h)
    grad = torch.randn(s, b, h, dtype=dtype, device=device)

    def run():
        return block(hidden_states=x, attention_mask=None), grad

    return _time_part(run, list(block.parameters()), sync, repeats, warmup, _clock(device))


def _measure_outer(args, model: ModelSpec, device: str, part: str, t: int, b: int, sync,
                   repeats: int, warmup: int) -> tuple[float, float, float]:
    """The embedding (first stage) or the head: final LayerNorm, output layer V/t x h and
    Megatron's vocab-parallel cross entropy (last stage), as GPTModel runs them."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding)

    config = _config(args, model, device, t, recompute=False)
    s, h, v = model.seq_length, model.hidden_size, model.padded_vocab(t) // t
    tokens = torch.randint(0, v, (b, s), device=device)  # (b, s)
    if part == "embedding":
        module = LanguageModelEmbedding(config, vocab_size=v, max_sequence_length=s,
                                        position_embedding_type="learned_absolute")
        positions = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
        grad = torch.randn(s, b, h, dtype=config.params_dtype, device=device)

        def run():
            return module(tokens, positions), grad  # (s, b, h)
    else:
        norm = torch.nn.LayerNorm(h, eps=config.layernorm_epsilon, dtype=config.params_dtype)
        output = tensor_parallel.ColumnParallelLinear(
            h, v, config=config, init_method=config.init_method, bias=False,
            gather_output=False)
        module = torch.nn.ModuleList([norm, output])
        x = torch.randn(s, b, h, dtype=config.params_dtype, device=device, requires_grad=True)

        def run():
            logits, _ = output(norm(x))  # (s, b, V/t)
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits, tokens.t().contiguous())
            return loss.float().mean(), None
    if device == "cuda":
        module.cuda()
    return _time_part(run, list(module.parameters()), sync, repeats, warmup, _clock(device))


def _measure_optimizer(args, model: ModelSpec, device: str, sync, repeats: int
                       ) -> tuple[float, float]:
    """Megatron's optimizer step (DDP gradient finalisation, clipping, Adam/SGD) on blocks of 1
    and 3 layers: fixed seconds and seconds per parameter from the two points."""
    import torch
    from megatron.core.distributed import finalize_model_grads

    from megatron_2bw.training import build

    points = []
    for layers in (1, 3):
        block, config = _block(args, model, device, 1, False, num_layers=layers)
        if config.fp16 or config.bf16:
            from megatron.core.transformer.module import Float16Module

            block = Float16Module(config, block)
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)

        ddp = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                  use_distributed_optimizer=False), block)
        optimizer = build.build_optimizer(args, [ddp])
        params = sum(p.numel() for p in ddp.parameters())
        times, clock = [], _clock(device)
        for i in range(repeats + 1):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            for p in ddp.parameters():
                p.main_grad.normal_(0, 1e-3)
            sync()
            start = clock()
            finalize_model_grads([ddp])
            optimizer.step()
            sync()
            if i:
                times.append(clock() - start)
        points.append((params, statistics.median(times)))
    (p1, t1), (p3, t3) = points
    per_param = max((t3 - t1) / (p3 - p1), 0.0)
    return max(t1 - per_param * p1, 0.0), per_param


# ---- links --------------------------------------------------------------------------------


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
    results = []
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        times = []
        for i in range(repeats + 2):
            dist.barrier()
            sync()
            start = time.perf_counter()
            dist.all_reduce(buf)
            sync()
            if i >= 2:
                times.append(time.perf_counter() - start)
        results.append((nbytes, min(times)))  # the link itself, not the other processes
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def measure_links(repeats: int = 10, sizes: Sequence[int] = (2**12, 2**16, 2**20, 2**22, 2**24)
                  ) -> Link:
    """All-reduces between two local processes (gloo on CPU, NCCL between two GPUs), fitted to
    the ring model of `Link.all_reduce` with n = 2: time = 2 alpha + n_bytes / beta."""
    import torch
    import torch.multiprocessing as mp

    from megatron_2bw.runtime.cpu import cuda_usable

    backend = "nccl" if cuda_usable() and torch.cuda.device_count() >= 2 else "gloo"
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
    return _fit_link(points)


def _fit_link(points: Sequence[tuple[float, float]]) -> Link:
    """Least squares time = 2 alpha + n / beta over (n bytes, seconds) points."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    intercept = max(my - slope * mx, 0.0)
    return Link(bandwidth=1.0 / slope, latency=intercept / 2)


# ---- end-to-end ---------------------------------------------------------------------------


@dataclass(frozen=True)
class E2ERun:
    """One configuration trained for a few iterations."""

    t: int
    d: int
    w: int
    b: int
    m: int
    recompute: bool
    schedule: str
    precision: str
    seconds_per_iteration: float | None
    """Median of the logged intervals after the first (which holds the warm-up)."""
    peak_memory_bytes: float | None
    """Largest "peak memory (MiB)" logged: the last rank's (it prints the log)."""
    intervals: tuple[float, ...] = ()
    """Each logged interval's time per iteration, the first included."""
    command: tuple[str, ...] = ()
    error: str | None = None
    fastest_s: float | None = None
    """Fastest logged interval after the first: on a shared machine the least disturbed one."""
    load_average: float | None = None
    """Higher 1-minute load average of the machine at the run's start and end (CPU runs share
    the cores with whatever else runs)."""


@dataclass
class E2EProfile(_JsonFile):
    model: ModelSpec
    device_name: str
    runs: list[E2ERun] = field(default_factory=list)
    created: str = ""

    FORMAT = "megatron-2bw end-to-end profile v1"

    @classmethod
    def from_json(cls, data: dict) -> "E2EProfile":
        data = dict(data)
        data.pop("format", None)
        data["model"] = ModelSpec(**data["model"])
        data["runs"] = [E2ERun(**{**r, "intervals": tuple(r.get("intervals", ())),
                                  "command": tuple(r.get("command", ()))})
                        for r in data.get("runs", [])]
        return cls(**data)


_TIME_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
_MEM_RE = re.compile(r"peak memory \(MiB\): ([0-9.]+)")


def parse_training_log(text: str) -> tuple[list[float], list[float]]:
    """(seconds per iteration of each logged interval, peak MiB of each) from a training log."""
    times = [float(x) / 1000 for x in _TIME_RE.findall(text)]
    mems = [float(x) for x in _MEM_RE.findall(text)]
    return times, mems


def _mock_data_supported() -> bool:
    try:
        from megatron_2bw.data import gpt

        return hasattr(gpt, "build_mock_gpt_datasets")
    except ImportError:
        return False


def _data_flags(model: ModelSpec, scratch: Path) -> tuple[list[str], ModelSpec]:
    """--mock-data where the data module has it; else a tiny corpus built once."""
    if _mock_data_supported():
        return ["--mock-data", "--vocab-size", str(model.vocab_size)], model
    from megatron_2bw.data.default import prepare_default_data

    data = prepare_default_data(scratch / "data", vocab_size=512, max_chars=200_000)
    flags = ["--data-path", data.data_prefix, "--tokenizer-model", data.tokenizer_model,
             "--data-cache-path", str(scratch / "index-cache")]
    return flags, dataclasses.replace(model, vocab_size=512)


def run_end_to_end(model: ModelSpec, layouts: Sequence, precision: str = "fp32",
                   train_iters: int = 12, log_interval: int = 3, cpu: bool = True,
                   repeat: int = 1, idle_below: float | None = None,
                   timeout: float = 600.0, log: Callable[[str], None] = lambda s: None,
                   scratch: str | os.PathLike | None = None) -> E2EProfile:
    """Train each layout (`cost.Layout`) for `train_iters` iterations with torchrun on this
    machine (t d w processes) and read its log. With `repeat` > 1 each layout runs that many
    times and the fastest run is kept: other processes on the machine only ever slow a run
    down. With `idle_below`, each run first waits (up to 10 minutes) for the 1-minute load
    average to drop below it."""
    scratch = Path(scratch or tempfile.mkdtemp(prefix="plan-e2e-"))
    data_flags, model = _data_flags(model, scratch)
    profile = E2EProfile(model=model, device_name=_cpu_name() if cpu else _cuda_name(),
                         created=datetime.datetime.now().isoformat(timespec="seconds"))
    for layout in layouts:
        runs = []
        for _ in range(max(repeat, 1)):
            if idle_below is not None:
                _wait_for_idle(idle_below, log)
            runs.append(_run_one(layout, model, precision, data_flags, train_iters,
                                 log_interval, cpu, timeout, log))
        timed = [r for r in runs if r.seconds_per_iteration is not None]
        profile.runs.append(min(timed, key=lambda r: r.seconds_per_iteration) if timed
                            else runs[-1])
    return profile


def calibrate(profile: Profile, micro_batch: int, microbatches: int = 4, devices: int = 1,
              train_iters: int = 10, cpu: bool = True,
              log: Callable[[str], None] = lambda s: None) -> Profile:
    """Set `profile.compute_scale`: train the profiled model data-parallel on `devices` local
    devices (t = d = 1, w = devices, `microbatches` of `micro_batch` each) and solve
    measured = scale x (compute + optimizer) + communication for the scale, the communication
    (gradient all-reduce) as the cost model predicts it. With every local device busy, as in
    the runs planned, the scale also holds what devices sharing a machine cost each other
    (CPU cores sharing caches and memory bandwidth, stragglers at each all-reduce).
    Returns the profile."""
    from .cluster import preset
    from .cost import CostModel, Layout

    layout = Layout(1, 1, devices, micro_batch, microbatches, False, "megatron")
    measured = run_end_to_end(profile.model, [layout], profile.precision, train_iters=train_iters,
                              log_interval=1, cpu=cpu, log=log).runs[0]
    if measured.seconds_per_iteration is None:
        log(f"calibration failed ({measured.error}); compute_scale stays 1")
        return profile
    profile.compute_scale = 1.0
    cluster = preset("cpu-local" if profile.device == "cpu" else "dgx-h100",
                     gpus_per_node=devices)
    estimate = CostModel(profile.model, cluster, profile.precision, profile=profile).time(layout)
    communication = estimate.step - estimate.optimizer
    profile.compute_scale = ((measured.seconds_per_iteration - communication)
                             / (estimate.iteration - communication))
    profile.calibration = {"layout": layout.label(), "measured_s": measured.seconds_per_iteration,
                           "predicted_s": estimate.iteration}
    if measured.peak_memory_bytes and profile.device == "cpu":
        # The resident set of a training process holds more than the tensors and the imported
        # modules (process groups, the data pipeline, the allocator's free lists): the
        # overhead is what the run's peak leaves after the modelled tensors.
        tensors = CostModel(profile.model, cluster, profile.precision, profile=profile).memory(
            layout).stages[-1].total - profile.runtime_overhead_bytes
        profile.calibration["imported_bytes"] = profile.runtime_overhead_bytes
        profile.runtime_overhead_bytes = max(measured.peak_memory_bytes - tensors,
                                             profile.runtime_overhead_bytes)
    log(f"calibration {layout.label()}: measured {measured.seconds_per_iteration * 1e3:.1f} ms, "
        f"parts predict {estimate.iteration * 1e3:.1f} ms -> compute scale "
        f"{profile.compute_scale:.3f}; runtime memory "
        f"{profile.runtime_overhead_bytes / 2**20:.0f} MiB")
    return profile


def _run_one(layout, model: ModelSpec, precision: str, data_flags: list[str], train_iters: int,
             log_interval: int, cpu: bool, timeout: float, log: Callable[[str], None]) -> E2ERun:
    from .flags import entry_script, launch_flags

    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--nproc-per-node", str(layout.world),
               "--master-port", str(free_port()), str(REPO / entry_script(model)),
               *launch_flags(layout, model, precision, cpu=cpu), *data_flags,
               "--train-iters", str(train_iters), "--log-interval", str(log_interval),
               "--eval-iters", "0", "--lr-warmup-iters", "0",
               "--distributed-timeout-minutes", "5"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    log(f"running {layout.label()}: {' '.join(command[1:])}")
    load_before = _load_average()
    error = None
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
        text = done.stdout + done.stderr
        if done.returncode:
            error = f"exit {done.returncode}: " + _last_error(text)
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        error = f"timed out after {timeout:.0f} s"
    times, mems = parse_training_log(text)
    steady = times[1:] or times  # the first interval holds the warm-up
    run = E2ERun(t=layout.t, d=layout.d, w=layout.w, b=layout.b, m=layout.m,
                 recompute=layout.recompute, schedule=layout.schedule, precision=precision,
                 seconds_per_iteration=statistics.median(steady) if steady else None,
                 peak_memory_bytes=max(mems) * 2**20 if mems else None,
                 intervals=tuple(times), command=tuple(command[1:]), error=error,
                 fastest_s=min(steady) if steady else None,
                 load_average=max(load_before, _load_average()))
    log(f"  -> {run.seconds_per_iteration * 1e3:.1f} ms/iteration (load average "
        f"{run.load_average:.1f})" if run.seconds_per_iteration else f"  -> failed: {error}")
    return run


def _load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def _wait_for_idle(below: float, log: Callable[[str], None], limit_s: float = 600.0) -> None:
    deadline = time.monotonic() + limit_s
    if _load_average() >= below:
        log(f"  waiting for the load average ({_load_average():.1f}) to drop below {below}")
    while _load_average() >= below and time.monotonic() < deadline:
        time.sleep(5)


def _last_error(text: str) -> str:
    lines = [line for line in text.splitlines() if "error" in line.lower()]
    return lines[-1].strip()[:300] if lines else text.strip().splitlines()[-1][:300] if text else ""


def _cuda_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"


# ---- predicted vs measured ----------------------------------------------------------------


@dataclass(frozen=True)
class Accuracy:
    """One end-to-end run against the cost model's prediction for its layout."""

    layout: object
    """`cost.Layout`."""
    predicted_s: float
    measured_s: float | None
    predicted_memory_bytes: float
    """The logging rank's: the last pipeline stage (it prints the training log)."""
    measured_memory_bytes: float | None
    error: str | None = None
    load_average: float | None = None
    fastest_s: float | None = None

    @property
    def time_error(self) -> float | None:
        """(predicted - measured) / measured."""
        if not self.measured_s:
            return None
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def fastest_error(self) -> float | None:
        """Against the fastest interval (the least disturbed on a shared machine)."""
        if not self.fastest_s:
            return None
        return (self.predicted_s - self.fastest_s) / self.fastest_s

    @property
    def memory_error(self) -> float | None:
        if not self.measured_memory_bytes:
            return None
        return ((self.predicted_memory_bytes - self.measured_memory_bytes)
                / self.measured_memory_bytes)


def compare(e2e: E2EProfile, cost, simulate: bool = True) -> list[Accuracy]:
    """Predict every run of `e2e` with `cost` (a `cost.CostModel`)."""
    from .cost import Layout

    rows = []
    for run in e2e.runs:
        layout = Layout(run.t, run.d, run.w, run.b, run.m, run.recompute, run.schedule)
        time_estimate = cost.time(layout, simulate=simulate)
        memory = cost.memory(layout).stages[-1].total
        rows.append(Accuracy(layout, time_estimate.iteration, run.seconds_per_iteration,
                             memory, run.peak_memory_bytes, run.error, run.load_average,
                             run.fastest_s))
    return rows


def format_accuracy(rows: Sequence[Accuracy]) -> str:
    """The predicted-vs-measured table."""
    def pct(x):
        return "    -" if x is None else f"{x * 100:+5.1f}%"

    def ms(x):
        return "       -" if x is None else f"{x * 1e3:8.1f}"

    def mib(x):
        return "      -" if x is None else f"{x / 2**20:7.0f}"

    lines = [f"{'layout':<28} {'pred ms':>8} {'meas ms':>8} {'error':>6}  {'fastest':>8} "
             f"{'error':>6}   {'pred MiB':>8} {'meas MiB':>8} {'error':>6}  {'load':>4}"]
    for r in rows:
        load = "   -" if r.load_average is None else f"{r.load_average:4.1f}"
        lines.append(f"{r.layout.label():<28} {ms(r.predicted_s)} {ms(r.measured_s)} "
                     f"{pct(r.time_error)}  {ms(r.fastest_s)} {pct(r.fastest_error)}   "
                     f"{mib(r.predicted_memory_bytes)}  {mib(r.measured_memory_bytes)} "
                     f"{pct(r.memory_error)}  {load}" + (f"   ({r.error})" if r.error else ""))
    errors = [abs(r.time_error) for r in rows if r.time_error is not None]
    if errors:
        lines.append(f"time (median interval): mean |error| {statistics.fmean(errors) * 100:.1f}%, "
                     f"max {max(errors) * 100:.1f}%; fastest: the least disturbed interval; "
                     f"load: the machine's 1-minute load average during the run")
    return "\n".join(lines)
