"""Everything one GPU can prove about megatron-2bw, in one call of at most 8 minutes.

    make gpu-wheels      # here, once: megatron-core 0.16.1's cp312 wheel into wheels/ (ignored)
    pip install --no-deps --target /tmp/site wheels/*.whl && \\
        PYTHONPATH=/tmp/site:. python scripts/gpu_check.py            # on the GPU machine
    python scripts/gpu_check.py --cpu                                  # tiny sizes, CI

Parts: matmul (the bf16 rate), train (megatron, flush and 2bw side by side), resume, versions,
deferred, waits, profile. Each runs in its own process with its own time limit (one that
fails or hangs does not stop the others); ``$OUT`` (else --out, else runs/gpu_check/) gets
gpu_check.log, summary.json and the GPU's layer profile, and one short table comes last.
Invariants: the exit code is 0 only when every part passed; ``--cpu`` runs the same parts at
tiny sizes on gloo (tests/test_gpu_check.py); ``wheels/`` is git-ignored, so a runner that
copies the working tree must carry it by name. What each part checks: docs/gpu.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PARTS = ("matmul", "train", "resume", "versions", "deferred", "waits", "profile")
BF16_NOISE = 2e-3
"""Relative loss difference a resumed bf16 run may show and still count (stated in the row)."""
EXACT = 1e-6
"""Relative weight error of the deferred step against the in-place one (the tests' bound)."""


@dataclass(frozen=True)
class Sizes:
    """What one mode (GPU or --cpu) runs."""

    train: tuple[str, ...]
    """Model and batch flags of the train part."""
    train_iters: int
    warmup_iters: int
    """Iterations left out of ms/iteration and TFLOP/s."""
    resume: tuple[str, ...]
    resume_iters: int
    resume_at: int
    harness: tuple[str, ...]
    """Model flags of the versions and deferred parts (one microbatch per step)."""
    harness_m: int
    deferred_iters: int
    matmul_n: int
    queued_matmuls: int
    """Matrix products queued ahead of the waited-on all-reduce in the waits part."""
    profile: tuple[str, ...]
    part_timeout_s: dict = field(default_factory=dict)


def _model(layers: int, hidden: int, heads: int, seq: int, vocab: int, mbs: int,
           gbs: int) -> tuple[str, ...]:
    return tuple(str(x) for x in (
        "--num-layers", layers, "--hidden-size", hidden, "--num-attention-heads", heads,
        "--seq-length", seq, "--max-position-embeddings", seq, "--vocab-size", vocab,
        "--micro-batch-size", mbs, "--global-batch-size", gbs))


def _layer_profile(layers: int, hidden: int, heads: int, seq: int, vocab: int,
                   micro_batch_sizes: str, tp_sizes: str, repeats: int,
                   extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """`tools/plan.py profile`'s flags for one layer at these sizes (no link profile, no
    calibration run)."""
    return tuple(str(x) for x in (
        "--num-layers", layers, "--hidden-size", hidden, "--num-attention-heads", heads,
        "--seq-length", seq, "--vocab-size", vocab, "--micro-batch-sizes", micro_batch_sizes,
        "--tensor-parallel-sizes", tp_sizes, "--no-links", "--no-calibrate", *extra,
        "--repeats", repeats))


GPU = Sizes(
    train=_model(24, 1024, 16, 1024, 50257, 4, 32), train_iters=14, warmup_iters=4,
    resume=_model(8, 1024, 16, 512, 32000, 4, 16), resume_iters=8, resume_at=4,
    harness=_model(4, 1024, 16, 512, 32000, 2, 2), harness_m=4, deferred_iters=4,
    matmul_n=8192, queued_matmuls=20,
    profile=_layer_profile(24, 2048, 16, 2048, 51200, "1,2,4", "1,2", repeats=5),
    part_timeout_s={"matmul": 25, "train": 140, "resume": 85, "versions": 45,
                    "deferred": 45, "waits": 25, "profile": 90})
BUDGET_S = 470
"""The whole check on a GPU (one device call of at most 8 minutes): a part gets what is left
when that is less than its own limit, and none under 10 s."""
CPU = Sizes(
    train=_model(2, 32, 4, 16, 64, 2, 4), train_iters=5, warmup_iters=2,
    resume=_model(2, 32, 4, 16, 64, 2, 4), resume_iters=4, resume_at=2,
    harness=_model(2, 32, 4, 16, 64, 2, 2), harness_m=2, deferred_iters=3,
    matmul_n=256, queued_matmuls=2,
    profile=_layer_profile(2, 32, 4, 16, 64, "1,2", "1", repeats=2, extra=("--no-recompute",)),
    part_timeout_s={name: 60 for name in PARTS})

COMMON = ("--mock-data", "--transformer-impl", "local", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--lr", "1e-4", "--min-lr", "1e-5",
          "--lr-decay-style", "cosine", "--lr-warmup-iters", "0", "--seed", "1234",
          "--log-interval", "1", "--eval-iters", "0", "--distributed-timeout-minutes", "2")


@dataclass
class Context:
    """What a part gets: the mode, its sizes and its output folder."""

    cpu: bool
    sizes: Sizes
    out: Path

    @property
    def parts(self) -> Path:
        """Each part's log and result while it runs (merged into the run's files after it)."""
        return self.out / "parts"

    @property
    def device_flags(self) -> list[str]:
        return ["--cpu"] if self.cpu else []


# ---- the parts ------------------------------------------------------------------------------

def part_matmul(ctx: Context) -> dict:
    """bf16 matrix products of n x n x n: TFLOP/s, the mean of 10 after 3 warm-ups."""
    import torch

    n, device = ctx.sizes.matmul_n, _device(ctx)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(ctx)
    started = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(ctx)
    seconds = (time.perf_counter() - started) / 10
    tflops = 2 * n ** 3 / seconds / 1e12
    return {"ok": tflops > 0, "tflops": tflops, "n": n,
            "summary": f"{tflops:.3g} TFLOP/s bf16 ({n}^3 matmul) on {_device_name(ctx)}"}


def part_train(ctx: Context) -> dict:
    """megatron, flush, 2bw at PP=1, bf16: losses by the rules, speed side by side."""
    sizes = ctx.sizes
    flags = [*ctx.device_flags, *sizes.train, *COMMON, "--bf16",
             "--train-iters", str(sizes.train_iters)]
    peak = _matmul_tflops(ctx)
    runs = {}
    for schedule in ("megatron", "flush", "2bw"):
        log = _train(flags + ["--pipeline-schedule", schedule])
        steady = [r for r in log.iterations if r.iteration > sizes.warmup_iters]
        ms = _mean(r.ms_per_iteration for r in steady)
        tflops = _mean(r.tflops_per_device for r in steady if r.tflops_per_device is not None)
        runs[schedule] = {"losses": [r.loss for r in log.iterations], "ms": ms,
                          "tflops": tflops, "mfu": tflops / peak if peak else None,
                          "peak_memory_mib": max((r.peak_memory_mib or 0)
                                                 for r in log.iterations)}
    megatron, flush, twobw = (runs[s]["losses"] for s in ("megatron", "flush", "2bw"))
    flush_equal = flush == megatron and len(megatron) == sizes.train_iters
    twobw_rule = (len(twobw) == sizes.train_iters and twobw[0] == megatron[0]
                  and all(a != b for a, b in zip(twobw[1:], megatron[1:])))
    speed = " | ".join(f"{s} {r['ms']:.0f} ms {r['tflops']:.3g} TFLOP/s"
                       + (f" MFU {r['mfu']:.0%}" if r["mfu"] is not None else "")
                       for s, r in runs.items())
    rules = (f"flush==megatron {'at all' if flush_equal else 'NOT at all'} "
             f"{len(megatron)} iterations; 2bw==megatron at 1 and != from 2 on: "
             f"{'yes' if twobw_rule else 'NO'}")
    return {"ok": flush_equal and twobw_rule, "runs": runs, "matmul_tflops": peak,
            "summary": f"{speed}; {rules}"}


def part_resume(ctx: Context) -> dict:
    """2bw --swiglu bf16: N iterations saving at K; resumed from K's checkpoint to N."""
    sizes = ctx.sizes
    n, k = sizes.resume_iters, sizes.resume_at
    flags = [*ctx.device_flags, *sizes.resume, *COMMON, "--bf16", "--swiglu",
             "--pipeline-schedule", "2bw", "--train-iters", str(n)]
    with tempfile.TemporaryDirectory(prefix="gpu_check_resume_") as folder:  # not under $OUT
        whole, resumed = Path(folder) / "whole", Path(folder) / "from_k"
        first = _train(flags + ["--save", str(whole), "--save-interval", str(k)])
        resumed.mkdir()
        name = f"iter_{k:07d}"
        shutil.copytree(whole / name, resumed / name)
        (resumed / "latest_checkpointed_iteration.txt").write_text(str(k))
        second = _train(flags + ["--load", str(resumed)])
    expected = {r.iteration: r.loss for r in first.iterations if r.iteration > k}
    got = {r.iteration: r.loss for r in second.iterations}
    if sorted(got) != sorted(expected):
        return {"ok": False, "summary": f"resumed iterations {sorted(got)}, expected "
                                        f"{sorted(expected)}"}
    worst = max(abs(got[i] - expected[i]) / abs(expected[i]) for i in expected)
    how = "bit-exact (as printed)" if worst == 0 else f"max relative difference {worst:.1e}"
    return {"ok": worst <= BF16_NOISE, "max_relative": worst,
            "summary": f"iterations {k + 1}-{n} resumed from {k}: {how} "
                       f"(allowed: {BF16_NOISE:g}, bf16 noise)"}


def part_versions(ctx: Context) -> dict:
    """Gradients of a backward whose forward ran before an optimizer step (version 0 kept
    aside, restored with use(0)) equal a no-step reference bit for bit."""
    results = {}
    for label, extra in (("Float16 optimizer", []),
                         ("distributed optimizer", ["--use-distributed-optimizer"])):
        results[label] = _versions_harness(ctx, extra)
    ok = all(r["bit_equal"] and r["step_changed_weights"] for r in results.values())
    return {"ok": ok, "runs": results,
            "summary": "; ".join(f"{label}: gradients "
                                 f"{'bit-equal' if r['bit_equal'] else 'DIFFER'} "
                                 f"(max {r['max_abs']:.1e}), step "
                                 f"{'changed' if r['step_changed_weights'] else 'KEPT'} weights"
                                 for label, r in results.items())}


def part_deferred(ctx: Context) -> dict:
    """2bw with its step deferred and in place (fp32): equal weights; the memory the deferral
    adds is one fp32 copy of the stage's gradients."""
    in_place = _deferred_harness(ctx, defer=False)
    deferred = _deferred_harness(ctx, defer=True)
    relative = _relative(deferred["params"], in_place["params"])
    moved = _relative(in_place["initial"], in_place["params"])  # what the steps changed
    expected_bytes = 4 * deferred["numel"]
    copy_ok = deferred["copy_bytes"] == expected_bytes and deferred["mode"] == "deferred"
    summary = (f"weights relative error {relative:.1e} (<= {EXACT:g}; the steps moved them "
               f"{moved:.1e}); gradient copy "
               f"{deferred['copy_bytes'] / 2**20:.1f} MiB = 4 B x {deferred['numel']:,} "
               f"parameters: {'yes' if copy_ok else 'NO'}")
    ok = relative <= EXACT and moved > 100 * EXACT and copy_ok
    peak_delta = resident_delta = None
    if not ctx.cpu:  # what stays allocated between iterations; the peak, for information
        resident_delta = deferred["resident_bytes"] - in_place["resident_bytes"]
        peak_delta = deferred["peak_bytes"] - in_place["peak_bytes"]
        close = abs(resident_delta - expected_bytes) <= 0.05 * expected_bytes + 2**20
        summary += (f"; memory between iterations +{resident_delta / 2**20:.1f} MiB vs one fp32 "
                    f"buffer {expected_bytes / 2**20:.1f} MiB: {'matches' if close else 'DIFFERS'}"
                    f" (peak +{peak_delta / 2**20:.1f} MiB)")
        ok = ok and close
    return {"ok": ok, "relative_error": relative, "copy_bytes": deferred["copy_bytes"],
            "expected_bytes": expected_bytes, "peak_delta_bytes": peak_delta,
            "resident_delta_bytes": resident_delta,
            "modes": [in_place["mode"], deferred["mode"]], "summary": summary}


def part_waits(ctx: Context) -> dict:
    """Host time of waits behind queued device work, on a 1-rank group."""
    import datetime

    import torch
    import torch.distributed as dist

    _init_single_rank(ctx)
    device = _device(ctx)
    n = ctx.sizes.matmul_n
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    flag = torch.zeros(1024, device=device)

    def queued_all_reduce():
        for _ in range(ctx.sizes.queued_matmuls):
            a @ a
        return dist.all_reduce(flag, async_op=True)

    def host_ms(wait, repeats: int = 10) -> float:
        total = 0.0
        for _ in range(repeats):
            work = queued_all_reduce()
            started = time.perf_counter()
            wait(work)
            total += time.perf_counter() - started
            _sync(ctx)
        return total / repeats * 1e3

    timeout = datetime.timedelta(minutes=2)
    timed = host_ms(lambda work: work.wait(timeout=timeout))
    plain = host_ms(lambda work: work.wait())
    queued = host_ms(lambda work: _sync(ctx))  # the whole queue: what a full sync costs
    from megatron.core.timers import Timers

    timers = Timers(log_level=2, log_option="minmax")

    def timer_round(work):
        timers("check", log_level=0).start()
        timers("check").stop()

    timer = host_ms(timer_round)
    empty = host_ms(lambda work: torch.cuda.empty_cache() if not ctx.cpu else None)
    dist.destroy_process_group()
    summary = (f"queue {queued:.2f} ms; wait(timeout) {timed:.2f} ms vs wait() {plain:.2f} ms; "
               f"timer start+stop {timer:.2f} ms, empty_cache {empty:.2f} ms behind a pending "
               f"all-reduce")
    return {"ok": True, "queued_ms": queued, "timed_wait_ms": timed, "plain_wait_ms": plain,
            "timer_ms": timer, "empty_cache_ms": empty, "summary": summary}


def part_profile(ctx: Context) -> dict:
    """tools/plan.py profile at shapes that fit one device; the closed forms' per-layer error."""
    from megatron_2bw.planner import CostModel, Profile, preset
    from megatron_2bw.planner.cost import _closed_form_bytes
    from megatron_2bw.planner.profile import device_slug

    name = _device_name(ctx)
    out = ctx.out / f"{device_slug(name)}.json"
    argv = ["profile", *ctx.device_flags, *ctx.sizes.profile, "--out", str(out)]
    print("tools/plan.py " + " ".join(argv), flush=True)
    code = _tool("plan").main(argv)
    if code:
        raise RuntimeError(f"tools/plan.py profile exited with {code}")
    profile = Profile.load(out)
    if not ctx.cpu:  # the GPU's profile, kept where the planner looks for it
        shutil.copy(out, REPO / "tools" / "profiles" / out.name)
    cluster = preset("cpu-local") if ctx.cpu else _gpu_preset(name)
    cost = CostModel(profile.model, cluster, profile.precision)
    rows = []
    for sample in (s for s in profile.samples if s.part == "layer"):
        forward, backward = cost._compute("layer", sample.micro_batch, sample.tp,
                                          sample.recompute)
        memory = _closed_form_bytes(profile.model, "layer", sample.micro_batch, sample.tp,
                                    sample.recompute, cost.element_bytes)
        rows.append({"tp": sample.tp, "micro_batch": sample.micro_batch,
                     "recompute": sample.recompute,
                     "forward_error": forward / sample.forward_s - 1,
                     "backward_error": backward / sample.backward_s - 1,
                     "activation_error": memory / sample.activation_bytes - 1
                     if sample.activation_bytes else None})
    worst = {key: max(abs(r[key]) for r in rows if r[key] is not None)
             for key in ("forward_error", "backward_error", "activation_error")}
    return {"ok": bool(rows), "profile": str(out), "cluster": cluster.name, "layers": rows,
            "worst": worst,
            "summary": f"{len(rows)} layer samples in {out.name}; closed form ({cluster.name}) "
                       f"max |error|: forward {worst['forward_error']:.0%}, backward "
                       f"{worst['backward_error']:.0%}, activations "
                       f"{worst['activation_error']:.0%}"}


PART_FUNCTIONS = {"matmul": part_matmul, "train": part_train, "resume": part_resume,
                  "versions": part_versions, "deferred": part_deferred, "waits": part_waits,
                  "profile": part_profile}


# ---- training and harness helpers -----------------------------------------------------------

def _tool(name: str):
    """tools/<name>.py as a module (its main() runs in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"tools_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(argv: list[str]):
    """One pretrain_gpt_2bw.py run in this process (1 rank); its parsed log."""
    import pretrain_gpt_2bw
    from megatron_2bw.logparse import parse_log
    from megatron_2bw.schedules import executor
    from megatron_2bw.training import loop

    print("pretrain_gpt_2bw.py " + " ".join(argv), flush=True)
    _single_rank_env()
    _reset_peak_memory()  # each run's logged peak is its own
    captured, errors = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(_Tee(sys.stdout, captured)), \
                contextlib.redirect_stderr(_Tee(sys.stderr, errors)):
            pretrain_gpt_2bw.main(argv)
    except SystemExit as stop:
        said = [line for line in errors.getvalue().splitlines() if line.startswith("error:")]
        raise RuntimeError(f"pretrain_gpt_2bw.py exited with {stop.code}"
                           + (f": {said[-1]}" if said else "")) from None
    finally:
        loop._CPU_GROUP = None  # the process group it belonged to is gone
        executor.reset_runners()
    log = parse_log(captured.getvalue())
    if not log.iterations:
        raise RuntimeError("the run logged no iteration")
    return log


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def _built(ctx: Context, flags: list[str]):
    """megatron-core GPT, DDP and optimizer as the training loop builds them, 1 rank."""
    from functools import partial

    import pretrain_gpt_2bw
    from megatron_2bw.arguments import parse_args
    from megatron_2bw.entry import padded_vocab
    from megatron_2bw.runtime import distributed
    from megatron_2bw.runtime.device import select_device
    from megatron_2bw.training import build

    _single_rank_env()
    args = parse_args([*ctx.device_flags, *COMMON, "--train-iters", "10", *flags], world_size=1)
    select_device(args.cpu)
    info = distributed.initialize(1, 1, args.seed, force_cpu=args.cpu, timeout_minutes=2)
    config = build.transformer_config(args, info.device)
    vocab = padded_vocab(args, None)
    provider = partial(pretrain_gpt_2bw.model_provider, args=args, vocab_size=vocab)
    model = build.build_model(args, config, provider)
    optimizer = build.build_optimizer(args, model)
    scheduler = build.build_scheduler(args, optimizer)
    build.attach_config_hooks(config, model, optimizer, align_grad_reduce=args.align_grad_reduce)
    return args, info, config, model, optimizer, scheduler, vocab


def _batch(args, vocab: int, seed: int, device) -> dict:
    import torch

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (args.micro_batch_size, args.seq_length + 1),
                           generator=generator)
    return {"tokens": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device),
            "position_ids": torch.arange(args.seq_length).expand(args.micro_batch_size, -1)
            .to(device), "attention_mask": None,
            "loss_mask": torch.ones(args.micro_batch_size, args.seq_length, device=device)}


def _loss(model, batch):
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output.float().mean()


def _versions_harness(ctx: Context, extra: list[str]) -> dict:
    import torch

    from megatron_2bw.runtime import distributed
    from megatron_2bw.runtime.device import training_device
    from megatron_2bw.weights import WeightVersions

    args, info, _, model, optimizer, _, vocab = _built(ctx, [*ctx.sizes.harness, "--bf16",
                                                             *extra])
    chunk = model[0]
    params = list(chunk.parameters())
    device = training_device()
    batch, other = _batch(args, vocab, 1, device), _batch(args, vocab, 2, device)

    def grads():
        return [p.main_grad.detach().clone() for p in params]

    chunk.zero_grad_buffer()
    _loss(chunk, batch).backward()  # the reference: no step in between
    reference = grads()
    chunk.zero_grad_buffer()
    _loss(chunk, other).backward()  # gradients for the step
    chunk.finish_grad_sync()
    versions = WeightVersions(params)
    versions.use(0)
    loss = _loss(chunk, batch)  # forward at version 0 ...
    versions.fork(1)
    before = [p.detach().clone() for p in versions.tensors_of(1)]
    succeeded, _, _ = optimizer.step()  # ... writes version 1 ...
    versions.after_step()
    changed = bool(succeeded) and any(not torch.equal(a, b) for a, b in
                                      zip(before, versions.tensors_of(1)))
    chunk.zero_grad_buffer()
    versions.use(0)
    loss.backward()  # ... backward at version 0
    got = grads()
    distributed.destroy()
    diffs = [float((a.float() - b.float()).abs().max()) for a, b in zip(got, reference)]
    return {"bit_equal": all(torch.equal(a, b) for a, b in zip(got, reference)),
            "max_abs": max(diffs), "step_changed_weights": changed}


def _deferred_harness(ctx: Context, defer: bool) -> dict:
    import torch

    import megatron_2bw
    import pretrain_gpt_2bw
    from megatron.core import pipeline_parallel
    from megatron_2bw.deferred import why_not_deferred
    from megatron_2bw.runtime import distributed
    from megatron_2bw.runtime.device import training_device
    from megatron_2bw.schedules import executor

    _reset_peak_memory()
    m = ctx.sizes.harness_m
    args, _, _, model, optimizer, scheduler, vocab = _built(
        ctx, [*ctx.sizes.harness[:-1], str(m * int(ctx.sizes.harness[-1])),
              "--pipeline-schedule", "2bw"])
    device = training_device()
    initial = [p.detach().float().cpu().clone() for p in model[0].parameters()]
    executor.reset_runners()
    megatron_2bw.install("2bw")
    fb = pipeline_parallel.get_forward_backward_func()
    fb.attach_optimizer(optimizer, defer=defer)
    # One GPU holds one pipeline stage, where the executor keeps the step in place (nothing to
    # wait for); the harness defers it there all the same to measure what the deferral does.
    executor.why_not_deferred = lambda *args: None

    def data():
        k = 0
        while True:
            yield _batch(args, vocab, 100 + k, device)
            k += 1

    iterator = data()
    resident = 0
    for iteration in range(ctx.sizes.deferred_iters):
        if iteration == ctx.sizes.deferred_iters - 1:
            resident = 0 if ctx.cpu else torch.cuda.memory_allocated()  # between iterations
            fb.prepare_drain()
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        fb(forward_step_func=pretrain_gpt_2bw.forward_step, data_iterator=iterator,
           model=model, num_microbatches=m, seq_length=args.seq_length,
           micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length,
           forward_only=False)
        optimizer.step()
        scheduler.step(increment=args.global_batch_size)
    fb.drain()
    copies = fb.deferred.copies if fb.deferred is not None else None
    executor.why_not_deferred = why_not_deferred
    result = {"params": [p.detach().float().cpu() for p in model[0].parameters()],
              "initial": initial,
              "numel": sum(p.numel() for p in model[0].parameters()),
              "copy_bytes": sum(c.numel() * c.element_size()
                                for c in copies or () if c is not None),
              "mode": fb.step_mode,
              "resident_bytes": resident,
              "peak_bytes": 0 if ctx.cpu else torch.cuda.max_memory_allocated()}
    executor.reset_runners()
    distributed.destroy()
    return result


# ---- devices and processes ------------------------------------------------------------------

def _single_rank_env() -> None:
    from megatron_2bw.runtime.ports import free_port

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def _reset_peak_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _init_single_rank(ctx: Context) -> None:
    import datetime

    import torch.distributed as dist

    from megatron_2bw.runtime.device import select_device

    _single_rank_env()
    select_device(ctx.cpu)  # cuda:0, or the CPU runtime (megatron's timers)
    dist.init_process_group("gloo" if ctx.cpu else "nccl", rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=2))


def _device(ctx: Context):
    return "cpu" if ctx.cpu else "cuda"


def _device_name(ctx: Context) -> str:
    import torch

    if not ctx.cpu:
        return torch.cuda.get_device_name(0)
    from megatron_2bw.planner.cluster import cpu_name

    return cpu_name()


def _sync(ctx: Context) -> None:
    import torch

    if not ctx.cpu:
        torch.cuda.synchronize()


def _gpu_preset(name: str):
    from megatron_2bw.planner import preset

    return preset("dgx-h200" if "H200" in name.upper() else "dgx-h100")


def _matmul_tflops(ctx: Context) -> float | None:
    """The matmul part's rate (measured again when its result is missing)."""
    path = ctx.parts / "matmul.json"
    if not path.exists():
        path = ctx.out / "summary.json"
        return json.loads(path.read_text()).get("matmul", {}).get("tflops") \
            if path.exists() else part_matmul(ctx)["tflops"]
    if path.exists():
        return json.loads(path.read_text()).get("tflops")
    return part_matmul(ctx)["tflops"]


def _relative(got: list, reference: list) -> float:
    """||got - reference|| / ||reference|| over all tensors (the tests' weight error)."""
    difference = sum(float((a.double() - b.double()).norm()) ** 2 for a, b in zip(got, reference))
    return (difference / sum(float(b.double().norm()) ** 2 for b in reference)) ** 0.5


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def run_part(name: str, ctx: Context) -> None:
    """In the part's own process: run it, write <out>/<name>.json ({"ok", "summary", ...})."""
    started = time.perf_counter()
    try:
        result = PART_FUNCTIONS[name](ctx)
    except BaseException as error:  # noqa: BLE001 (any failure is this part's row)
        traceback.print_exc()
        result = {"ok": False, "summary": f"{type(error).__name__}: "
                                          f"{str(error).splitlines()[0] if str(error) else ''}"}
    result["seconds"] = time.perf_counter() - started
    (ctx.parts / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))


def _launch(name: str, ctx: Context, left_s: float) -> dict:
    """Run one part in a forked process of its own session with its time limit (past it the
    session is killed: the part's helper processes too); its result row. The part's output
    goes to <out>/parts/<name>.log, its result to <out>/parts/<name>.json."""
    log = ctx.parts / f"{name}.log"
    result_path = ctx.parts / f"{name}.json"
    result_path.unlink(missing_ok=True)
    timeout = min(ctx.sizes.part_timeout_s[name], left_s)
    if timeout < 10:
        return {"ok": False, "seconds": 0.0, "summary": f"not run: {left_s:.0f} s of the "
                                                        f"budget left"}
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the part's process
        code = 1
        try:
            os.setsid()
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            run_part(name, ctx)
            code = 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    status = None
    while status is None and time.perf_counter() - started < timeout:
        done, status = os.waitpid(pid, os.WNOHANG)
        status = status if done else None
        time.sleep(0.1)
    seconds = time.perf_counter() - started
    if status is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return {"ok": False, "seconds": seconds,
                "summary": f"ran past its {timeout} s limit (log: {log})"}
    if not result_path.exists():
        return {"ok": False, "seconds": seconds,
                "summary": f"ended ({os.waitstatus_to_exitcode(status)}) before writing a "
                           f"result (log: {log})"}
    return json.loads(result_path.read_text())


def _merge(ctx: Context, name: str, line: str, log: Path) -> None:
    """Append the part's log to the run's log (the files a device call returns are few)."""
    part_log = ctx.parts / f"{name}.log"
    with open(log, "a") as stream:
        stream.write(f"==== {line}\n")
        if part_log.exists():
            stream.write(part_log.read_text(errors="replace"))
            part_log.unlink()
        stream.write("\n")
    (ctx.parts / f"{name}.json").unlink(missing_ok=True)


def _preimport(cpu: bool) -> None:
    """With --cpu, import torch and megatron-core once, before the parts are forked. On a GPU
    each part imports them itself: a parent that touched CUDA could not fork."""
    if not cpu:
        return
    from megatron_2bw.runtime.device import select_device

    select_device(True)  # the CPU runtime first (it precedes megatron's models)
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401

    import pretrain_gpt_2bw  # noqa: F401
    from megatron_2bw.training import loop  # noqa: F401


def format_table(rows: dict[str, dict]) -> str:
    lines = [f"{'part':<9} {'result':<6} {'s':>6}  summary"]
    for name, row in rows.items():
        lines.append(f"{name:<9} {'OK' if row.get('ok') else 'FAIL':<6} "
                     f"{row.get('seconds', float('nan')):>6.1f}  {row.get('summary', '')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny sizes, gloo, no GPU needed")
    parser.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu_check",
                        help="logs and results (default: $OUT, else runs/gpu_check)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, from {','.join(PARTS)}")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # one part's process
    args = parser.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(  # absolute: tools start processes elsewhere
        str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)
    ctx = Context(args.cpu, CPU if args.cpu else GPU, Path(args.out).resolve())
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.parts.mkdir(exist_ok=True)
    if args.part:  # one part in this process (debugging)
        run_part(args.part, ctx)
        return 0
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)} (choose from {', '.join(PARTS)})")
    started = time.perf_counter()
    _preimport(ctx.cpu)
    log = ctx.out / "gpu_check.log"
    log.write_text("")
    rows = {}
    budget = BUDGET_S if not ctx.cpu else float("inf")
    for name in parts:
        rows[name] = _launch(name, ctx, budget - (time.perf_counter() - started))
        line = (f"{name}: {'OK' if rows[name].get('ok') else 'FAIL'} "
                f"({rows[name].get('seconds', 0):.1f} s) {rows[name].get('summary', '')}")
        print(line, flush=True)
        _merge(ctx, name, line, log)
        (ctx.out / "summary.json").write_text(json.dumps(rows, indent=1, default=str))
    shutil.rmtree(ctx.parts, ignore_errors=True)
    print(f"\ngpu_check ({'--cpu' if args.cpu else 'GPU'}) in "
          f"{time.perf_counter() - started:.0f} s, logs in {ctx.out}:")
    print(format_table(rows))
    return 0 if all(row.get("ok") for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
