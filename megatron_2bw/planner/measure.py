"""Layer profile: one megatron-core transformer layer, built from the same TransformerConfig
training builds, timed forward and backward at several microbatch sizes, with and without full
recomputation, with the bytes autograd keeps for the backward; plus the embedding and the
output layer with its loss, and the optimizer step.

A tensor-parallel rank is emulated in one process by a layer of a/t heads and f/t FFN width
(what one of t ranks computes, without the all-reduces, which the cost model adds from the
links). On CUDA it runs on the current GPU, elsewhere on CPU through `megatron_2bw.runtime.cpu`
(one process, a gloo process group of 1, `initialize_model_parallel(1, 1)`).

    profile = measure(model, "fp32", micro_batches=(1, 2, 4), log=print)   # a `Profile`

torch, megatron-core and the training package are imported by the functions that measure,
so importing this module stays cheap.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from megatron_2bw.runtime.ports import free_port

from .cluster import cpu_name
from .model import ModelSpec
from .profile import Profile, Sample

__all__ = ["measure"]


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

    device = _start(force_cpu, threads)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    overhead = _runtime_overhead() if device == "cpu" else 0.0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    args = _training_args(model, precision, cpu=device == "cpu")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    profile = Profile(
        device=device,
        device_name=torch.cuda.get_device_name() if device == "cuda" else cpu_name(),
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
    profile.orthogonalize_layer_s = _measure_orthogonalization(model, device, sync, repeats)
    log(f"Muon's Newton-Schulz on one layer: {profile.orthogonalize_layer_s * 1e3:.2f} ms")
    return profile


def _start(force_cpu: bool, threads: int | None) -> str:
    """Select this process's device ("cuda" or "cpu"; set_device on CUDA, the CPU runtime on
    the CPU, `threads` of it) and start a process group and model parallelism of 1 where none
    exists; an existing one is left as it is."""
    import torch
    import torch.distributed as dist

    from megatron_2bw.runtime.device import select_device

    device = select_device(force_cpu).kind
    if device == "cpu":
        torch.set_num_threads(threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo" if device == "cpu" else "nccl", rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    return device


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
    from megatron_2bw.training import specs

    if model.kind == "bert":
        return specs.bert_layer_spec(args)
    return specs.gpt_layer_spec(args)


def _block(args, model, device, t, recompute, num_layers=1):
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


def _measure_orthogonalization(model: ModelSpec, device: str, sync, repeats: int) -> float:
    """Seconds of Muon's Newton-Schulz (BlockwiseMuon's, bf16 iterations) on one layer's
    matrices at tp 1 (`ModelSpec.layer_matrices`), median of `repeats` after one warm-up."""
    import torch

    from megatron_2bw.planner.cost import NS_STEPS
    from megatron_2bw.training.muon import newton_schulz

    matrices = [torch.randn(shape, device=device).bfloat16() for shape in model.layer_matrices(1)]
    times, clock = [], _clock(device)
    for i in range(repeats + 1):
        sync()
        start = clock()
        for x in matrices:
            newton_schulz(x, NS_STEPS)
        sync()
        if i:
            times.append(clock() - start)
    return statistics.median(times)


def _measure_optimizer(args, model: ModelSpec, device: str, sync, repeats: int
                       ) -> tuple[float, float]:
    """Megatron's optimizer step (DDP gradient finalisation, clipping, Adam/SGD) on blocks of 1
    and 3 layers: fixed seconds and seconds per parameter from the two points."""
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
