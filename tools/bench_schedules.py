"""Pipeline schedules side by side: the same small GPT, the same global batch, on CPU processes.

    python tools/bench_schedules.py [--depth 2 --microbatches 2 --iters 20 --warmup 3]

Every schedule trains the same GPT with PP = d on d single-threaded CPU processes, and the same
model on ONE process gives the bubble-free ideal (single-process time / d); d copies of that
process at once ("single, d at once", "vs busy") check what the machine's shared cores cost.
Each run is torchrun over this file in worker mode, timing each ``train_step`` of megatron-2bw's
``Trainer`` (no evaluation, checkpoint or log collective; warm-up and the drain not measured).

Invariants: every row trains the same model on the same random tokens; the table shows the
slowest stage's median; memory columns are measured (saved-tensor hooks, weight versions after
every iteration); clipping and tied embeddings are off unless asked for (they would synchronise
the stages at every step). Every column and variant: docs/bench_schedules.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_2bw.cli import (RunName, ToolError, ToolParser,  # noqa: E402
                              add_model_size_flags, check_training_flags, comma_list,
                              existing_file, main_guard, nonneg_float, nonneg_int, output_file,
                              positive_int, run_name, writable_dir)
from megatron_2bw.arguments import SCHEDULES  # noqa: E402
from megatron_2bw.runtime.ports import free_port  # noqa: E402

SINGLE = "single (PP=1)"
BUSY = "single, d at once"


# --- worker: one rank of one configuration ------------------------------------------------------

def _synthetic_data(args, state):
    """Random-token GPT microbatches in GPTDataset's format (causal mask, every token counted)."""
    import torch

    from megatron_2bw.training.loop import DataIterators

    b, s = args.micro_batch_size, args.seq_length
    generator = torch.Generator().manual_seed(args.seed)
    mask = (torch.tril(torch.ones(s, s)) < 0.5).expand(b, 1, s, s)  # True = masked out

    def microbatches():
        while True:
            tokens = torch.randint(0, args.vocab_size, (b, s + 1), generator=generator)
            yield {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                   "loss_mask": torch.ones(b, s), "attention_mask": mask,
                   "position_ids": torch.arange(s).expand(b, s)}

    return DataIterators(train=microbatches(), valid=None)


class _SavedBytes:
    """Bytes one forward saves for backward (distinct storages, parameters excluded)."""

    def __init__(self, forward_step):
        self.forward_step = forward_step
        self.active = False
        self.per_microbatch: list[int] = []

    def __call__(self, data_iterator, model):
        if not self.active:
            return self.forward_step(data_iterator, model)
        import torch

        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, int] = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            result = self.forward_step(data_iterator, model)
        self.per_microbatch.append(sum(saved.values()))
        return result


class _PendingW:
    """The most bytes this stage's pending weight-gradient passes keep at once (zb-h1: each
    I leaves inputs and output gradients for its W; ``schedules.wgrad``), sampled after every
    I."""

    def __init__(self):
        from megatron_2bw.schedules.wgrad import WeightGradStore

        self.peak = 0
        self._alive: list = []
        input_pass = WeightGradStore.input_pass

        def tracked(store, *args, **kwargs):
            pending = input_pass(store, *args, **kwargs)
            self._alive = [p for p in self._alive if p.pending] + [pending]
            self.peak = max(self.peak, sum(p.nbytes() for p in self._alive))
            return pending

        WeightGradStore.input_pass = tracked


class _Waits:
    """Per-iteration instrumentation of this process: time blocked in the executor's p2p
    exchanges (wraps ``StageComm.exchange``; None for Megatron's own schedule, which uses its
    own p2p), time in the main thread's ``torch.distributed.all_reduce`` calls (the loop's loss
    average, megatron-core's grad norm) and waiting for a deferred step's collectives, and the
    main thread's run-queue delay (``/proc/self/task/TID/schedstat``: runnable but not running,
    i.e. another thread or process had the core)."""

    def __init__(self):
        import threading

        import torch.distributed as dist

        from megatron_2bw.deferred import DeferredStep
        from megatron_2bw.schedules import p2p

        self.recv = 0.0
        self.collective = 0.0
        self.used = False  # a p2p exchange of this package's executor ran
        self._main_thread = threading.get_ident()
        self._schedstat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        dist.all_reduce = self._timed(dist.all_reduce, "collective")
        DeferredStep.wait_collectives = self._timed(DeferredStep.wait_collectives, "collective")
        p2p.StageComm.exchange = self._timed(p2p.StageComm.exchange, "recv")

    def _timed(self, function, counter: str):
        """``function``, its main-thread seconds added to ``self.<counter>`` (a deferred
        step's helper thread blocks in all-reduces too, but the stage does not wait for it)."""
        import threading

        def timed(*args, **kwargs):
            if threading.get_ident() != self._main_thread:
                return function(*args, **kwargs)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                setattr(self, counter, getattr(self, counter) + time.perf_counter() - start)
                self.used |= counter == "recv"

        return timed

    def run_queue(self) -> float | None:
        try:
            with open(self._schedstat) as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return None


class _StepTimes:
    """Per iteration, the main thread's time in the optimizer's update (every megatron-core
    optimizer's ``step_with_ready_grads``, wall and CPU) and in dist_muon's all-gather of the
    parameters the other data-parallel replicas stepped; installed before the optimizer is
    built (the layer-wise optimizer binds its gather when built)."""

    def __init__(self):
        from megatron.core.optimizer import optimizer as core
        from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

        from megatron_2bw.training import layer_wise

        self.step = self.step_cpu = self.gather = 0.0
        for cls in (core.FP32Optimizer, core.MixedPrecisionOptimizer):
            cls.step_with_ready_grads = self._timed(cls.step_with_ready_grads, "step")
        layer_wise.gather_padded = self._timed(layer_wise.gather_padded, "gather")
        LayerWiseDistributedOptimizer.allgather_params = self._timed(
            LayerWiseDistributedOptimizer.allgather_params, "gather")

    def _timed(self, function, counter: str):
        def timed(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                setattr(self, counter, getattr(self, counter) + time.perf_counter() - start)
                if counter == "step":
                    self.step_cpu += time.thread_time() - cpu

        return timed

    def take(self) -> dict[str, float]:
        """The times since the last call, as Iteration fields."""
        times = {"step_seconds": self.step, "step_cpu_seconds": self.step_cpu,
                 "gather_seconds": self.gather}
        self.step = self.step_cpu = self.gather = 0.0
        return times


def _optimizer_state_bytes(optimizer) -> int:
    """Bytes of the optimizer state this rank holds: every member's torch optimizer state
    tensors and, for 16-bit weights, its fp32 main copies (distinct storages)."""
    import torch

    from megatron_2bw.deferred import members

    storages: dict[int, int] = {}
    for member in members(optimizer):
        tensors = [t for state in member.optimizer.state.values() for t in state.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0]  # not the step counters
        tensors += [p for group in getattr(member, "fp32_from_float16_groups", []) for p in group]
        for t in tensors:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@dataclass
class Iteration:
    """One training iteration on one rank, in seconds (None where not measured)."""

    seconds: float
    """Wall time of ``train_step``."""
    cpu_seconds: float
    """The main thread's CPU time."""
    run_queue_seconds: float | None
    """The main thread's time ready to run while another thread or process had the core."""
    recv_seconds: float | None
    """Time blocked in the executor's p2p exchanges (None: Megatron's own schedule, PP=1)."""
    collective_seconds: float
    """Time in the main thread's all-reduces and a deferred step's waits."""
    end: float
    """``time.perf_counter()`` when the iteration ended."""
    busy_seconds: float | None = None
    """Time in the executor's actions (F, B, I, W, S); the rest of ``seconds`` is this stage's
    bubble (None: Megatron's own schedule, which records none)."""
    step_seconds: float = 0.0
    """Wall time in the optimizer's step (its members' ``step_with_ready_grads``: the update)."""
    step_cpu_seconds: float = 0.0
    """The main thread's CPU time in that step."""
    gather_seconds: float = 0.0
    """Wall time in dist_muon's all-gather of the parameters other replicas stepped."""


@dataclass
class RankResult:
    """What one rank of one run measured (written as JSON by the worker)."""

    rank: int
    stage: int
    iterations: list[Iteration]
    """The measured iterations only (warm-up and the drain call left out)."""
    measured_wall: float | None
    """From the end of the last warm-up iteration to the end of the last measured one."""
    param_bytes: int
    saved_bytes_per_microbatch: int | None
    """The most bytes one forward saved for backward (parameters excluded)."""
    optimizer: str
    threads: int
    copied_bytes: int | None = None
    pending_w_bytes: int = 0
    """The most bytes pending W's kept at once (``_PendingW``)."""
    weight_bytes: int | None = None
    """The most bytes the stage's weight versions held at once (``_weight_bytes``)."""
    """Bytes copied in one iteration (a warm-up one; ``CopiedBytes``)."""
    action_seconds: dict[str, float] = field(default_factory=dict)
    """Action kind (F, B, I, W, S) -> median duration over the measured iterations."""
    optimizer_state_bytes: int = 0
    """Bytes of the optimizer's state on this rank (moments, momentum, not step counters; fp32
    main copies where the weights are 16-bit), after the last iteration."""

    def values(self, key: str) -> list:
        """One field of every measured iteration."""
        return [getattr(iteration, key) for iteration in self.iterations]

    @classmethod
    def from_json(cls, data: dict) -> "RankResult":
        data = dict(data, iterations=[Iteration(**i) for i in data["iterations"]])
        return cls(**data)


def _worker_options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The worker's own flags (before ``--``) and the training flags (after)."""
    ours, flags = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    p = ToolParser(prog="bench_schedules.py --worker")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--chained-optimizer", action="store_true")
    p.add_argument("--timeline", action="store_true")
    return p.parse_args(ours), flags


def _build_trainer(args, opts: argparse.Namespace):
    """megatron-2bw's Trainer for the benchmark's GPT (random tokens), its forward step wrapped
    to count saved bytes; with --chained-optimizer, megatron-core's wrapper around the optimizer."""
    from functools import partial

    import pretrain_gpt_2bw
    from megatron_2bw import entry
    from megatron_2bw.training.loop import Trainer

    vocab = entry.padded_vocab(args, None)
    saved = _SavedBytes(pretrain_gpt_2bw.forward_step)
    trainer = Trainer(args, partial(pretrain_gpt_2bw.model_provider, args=args, vocab_size=vocab),
                      _synthetic_data, saved, vocab)
    if opts.chained_optimizer and not hasattr(trainer.optimizer, "chained_optimizers"):
        from megatron.core.optimizer import ChainedOptimizer

        trainer.optimizer = ChainedOptimizer([trainer.optimizer])  # get_megatron_optimizer's
        if hasattr(trainer.forward_backward, "attach_optimizer"):
            trainer.forward_backward.attach_optimizer(trainer.optimizer,
                                                      defer=not args.no_deferred_step)
    return trainer, saved


def _timed_iteration(trainer, waits: _Waits, steps: _StepTimes) -> Iteration:
    """One ``train_step`` with its wall, CPU, run-queue, waiting and optimizer times."""
    start, cpu_start, runq_start = time.perf_counter(), time.thread_time(), waits.run_queue()
    waits.recv = waits.collective = 0.0
    steps.take()
    trainer.train_step()
    seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
    runq_end = waits.run_queue()
    return Iteration(seconds=seconds, cpu_seconds=cpu,
                     run_queue_seconds=None if runq_start is None or runq_end is None
                     else runq_end - runq_start,
                     recv_seconds=waits.recv if waits.used else None,
                     collective_seconds=waits.collective, end=time.perf_counter(),
                     **steps.take())


def _weight_bytes(trainer) -> int:
    """Bytes of every weight version the stage holds now (the parameters where the schedule
    keeps one)."""
    tensors = getattr(trainer.forward_backward, "weight_tensors", lambda: None)()
    if tensors is None:
        tensors = [p for chunk in trainer.model for p in chunk.parameters()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _run_iterations(trainer, saved: _SavedBytes, copied, waits: _Waits,
                    steps: _StepTimes, warmup: int, iters: int,
                    weights: list[int]) -> list[Iteration]:
    """Every iteration: ``warmup``, ``iters`` measured, and the drain call (2BW's last, which
    leaves nothing in flight; asked for as many calls ahead as the schedule needs); saved bytes
    are counted in warm-up iterations (the first one only where it is the only one), copies in
    the last warm-up iteration; ``weights`` gets each iteration's weight-version bytes."""
    runner, total = trainer.forward_backward, warmup + iters + 1
    notice = getattr(runner, "drain_notice", lambda m: 1)(trainer.args.num_microbatches)
    iterations = []
    for i in range(total):
        if total - i <= notice and hasattr(runner, "prepare_drain"):
            runner.prepare_drain(total - i)
        saved.active = 0 < i < warmup or (warmup == 1 and i == 0)
        with copied.counting() if i == warmup - 1 else contextlib.nullcontext():
            iterations.append(_timed_iteration(trainer, waits, steps))
        weights.append(_weight_bytes(trainer))
    if hasattr(runner, "drain"):
        runner.drain()
    return iterations


def _action_seconds(records: list, measured: list[Iteration], start: float) -> dict[str, float]:
    """From the executor's timeline records: each measured iteration's ``busy_seconds`` (set
    here), and per action kind the median duration over the measured iterations."""
    durations: dict[str, list[float]] = {}
    totals: dict[str, list[float]] = {}  # per iteration, the kind's summed time
    for iteration in measured:
        inside = [r for r in records if start <= r.start and r.end <= iteration.end]
        iteration.busy_seconds = sum(r.end - r.start for r in inside)
        for r in inside:
            durations.setdefault(r.kind, []).append(r.end - r.start)
        for kind in {r.kind for r in inside}:
            totals.setdefault(kind, []).append(sum(r.end - r.start for r in inside
                                                   if r.kind == kind))
        start = iteration.end
    return {**{kind: statistics.median(values) for kind, values in durations.items()},
            **{f"{kind} per iteration": statistics.median(values)
               for kind, values in totals.items()}}


def worker(argv: list[str]) -> int:
    """One rank of one configuration: train, time, write ``rank<N>.json`` (a RankResult) and,
    with --timeline, the executor's timeline records."""
    opts, flags = _worker_options(argv)
    import warnings

    warnings.simplefilter("ignore")  # before the imports: their warnings repeat on every rank
    import torch

    torch.set_num_threads(1)
    import megatron_2bw
    from megatron_2bw.arguments import parse_args
    from megatron_2bw.runtime import distributed
    from megatron_2bw.runtime.copies import CopiedBytes

    args = parse_args(flags)
    megatron_2bw.install(args.pipeline_schedule)
    waits, steps = _Waits(), _StepTimes()
    trainer, saved = _build_trainer(args, opts)
    runner, copied, pending_w = trainer.forward_backward, CopiedBytes(), _PendingW()
    if hasattr(runner, "timeline"):
        runner.timeline = []
    weights: list[int] = []
    iterations = _run_iterations(trainer, saved, copied, waits, steps, opts.warmup, opts.iters,
                                 weights)

    from megatron.core import parallel_state as ps

    measured = iterations[opts.warmup:opts.warmup + opts.iters]
    records = getattr(runner, "timeline", None)
    actions = _action_seconds(records, measured, iterations[opts.warmup - 1].end) if records \
        else {}
    rank = torch.distributed.get_rank()
    result = RankResult(
        rank=rank, stage=ps.get_pipeline_model_parallel_rank(), iterations=measured,
        measured_wall=measured[-1].end - iterations[opts.warmup - 1].end if opts.warmup else None,
        param_bytes=sum(p.numel() * p.element_size() for p in trainer.model[0].parameters()),
        saved_bytes_per_microbatch=max(saved.per_microbatch, default=None),
        optimizer=type(trainer.optimizer).__name__, threads=torch.get_num_threads(),
        copied_bytes=copied.bytes, pending_w_bytes=pending_w.peak, action_seconds=actions,
        weight_bytes=max(weights), optimizer_state_bytes=_optimizer_state_bytes(trainer.optimizer))
    Path(opts.out, f"rank{rank}.json").write_text(json.dumps(asdict(result)))
    if opts.timeline and getattr(runner, "timeline", None):
        from megatron_2bw import trace

        trace.save_records(runner.timeline, Path(opts.out, f"rank{rank}.jsonl"), rank=rank,
                           extra={"schedule": args.pipeline_schedule,
                                  "microbatches": args.num_microbatches})
    distributed.destroy()
    return 0


# --- driver -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """One configuration of the table: a row."""

    name: str
    """The row's name."""
    schedule: str
    processes: int
    """Pipeline stages: processes per replica."""
    clip_grad: float
    tied: bool
    label: str
    """Its timeline folder's name."""
    copies: int = 1
    """Independent jobs started at once (the busy-machine reference: copy i reports as stage i)."""
    extra: tuple[str, ...] = ()
    """More training flags."""
    microbatches: int | None = None
    """Microbatches per batch when not --microbatches (2BW's row at m < d runs m = d)."""
    split: tuple[int, ...] | None = None
    """Its layers per virtual stage (model order) where it is a --splits row; None: the layout
    flags given (--decoder-last-pipeline-num-layers, ...), or the even split."""
    replicas: int = 1
    """Data-parallel replicas of its pipeline (--data-parallel-size; 1 for the single rows)."""

    @property
    def world(self) -> int:
        """Processes of one job: stages x replicas."""
        return self.processes * self.replicas


@dataclass
class Run:
    """One run of one configuration: its ranks' results."""

    ranks: list[RankResult]

    def iteration_time(self) -> float:
        """The slowest stage's median time per iteration (s)."""
        return max(statistics.median(r.values("seconds")) for r in self.ranks)

    def by_stage(self) -> list[RankResult]:
        return sorted(self.ranks, key=lambda r: r.stage)


TWOBW_AT_D = "2bw (m=d)"
"""2BW's row when --microbatches is below --depth (2BW refuses m < d): m = d."""


def _microbatches(a: argparse.Namespace, name: str) -> int:
    """Microbatches per batch of a row."""
    return a.depth if name == TWOBW_AT_D else a.microbatches


def _model_flags(a: argparse.Namespace, microbatches: int | None = None) -> list[str]:
    """The model and batch: m microbatches per replica, --data-parallel-size replicas' worth
    in every row (the single-process rows step the whole global batch)."""
    m = (a.microbatches if microbatches is None else microbatches) * a.data_parallel_size
    return ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
            "--num-attention-heads", str(a.num_attention_heads),
            "--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length),
            "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch-size", str(a.micro_batch_size * m),
            "--vocab-size", str(a.vocab_size), "--mock-data", "--cpu",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4",
            "--lr-decay-style", "constant", "--train-iters", str(a.warmup + a.iters + 1),
            "--eval-iters", "0", "--log-interval", "1000000", "--seed", "1234"]


def _training_flags(a: argparse.Namespace, config: Config) -> list[str]:
    flags = _model_flags(a, config.microbatches) + ["--pipeline-schedule", config.schedule,
                               "--pipeline-model-parallel-size", str(config.processes),
                               "--clip-grad", str(config.clip_grad), *config.extra]
    if config.processes > 1 and config.copies == 1:
        flags += _split_flags(a, config)
    return flags + ([] if config.tied else ["--untie-embeddings-and-output-weights"])


LAYOUT_FLAGS = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                "--account-for-embedding-in-pipeline-split",
                "--account-for-loss-in-pipeline-split", "--pipeline-model-parallel-layout")
"""Megatron-LM's layout flags, passed on to every pipelined row."""


def _split_flags(a: argparse.Namespace, config: Config) -> list[str]:
    """A pipelined row's layout flags: a --splits row's split as the planner writes it
    (`planner.flags.layout_flags`), else the layout flags given."""
    if config.split is not None:
        from megatron_2bw.planner.flags import layout_flags

        return layout_flags(_layout(a, config, config.split), a.num_layers)
    flags = []
    for flag in LAYOUT_FLAGS:
        value = getattr(a, flag[2:].replace("-", "_"))
        if value is True:
            flags.append(flag)
        elif value not in (None, False):
            flags += [flag, str(value)]
    return flags


def _torchrun() -> str:
    """$TORCHRUN (as scripts/train_torchrun.sh reads it), else the torchrun beside this Python."""
    return os.environ.get("TORCHRUN") or str(Path(sys.executable).with_name("torchrun"))


def _worker_command(a: argparse.Namespace, config: Config, out: Path, timeline: bool) -> list[str]:
    command = [_torchrun(), "--nproc-per-node",
               str(config.world), "--master-port", str(free_port()),
               str(Path(__file__).resolve()), "--worker", "--out", str(out),
               "--warmup", str(a.warmup), "--iters", str(a.iters)]
    command += ["--chained-optimizer"] if a.chained_optimizer else []
    command += ["--timeline"] if timeline else []
    command += ["--", *_training_flags(a, config)]
    return ["nice", "-n", str(a.nice), *command] if a.nice else command


def _read_ranks(outs: list[Path], copies: int) -> list[RankResult]:
    ranks = []
    for copy, out in enumerate(outs):
        for path in sorted(out.glob("rank*.json")):
            rank = RankResult.from_json(json.loads(path.read_text()))
            if copies > 1:
                rank.rank = rank.stage = copy
            ranks.append(rank)
    return sorted(ranks, key=lambda r: r.rank)


def _keep_timeline(out: Path, timeline_dir: Path | None, label: str) -> None:
    if timeline_dir is None or not any(out.glob("rank*.jsonl")):
        return
    target = timeline_dir / label
    target.mkdir(parents=True, exist_ok=True)
    for stale in target.glob("*.jsonl"):
        stale.unlink()
    for p in out.glob("rank*.jsonl"):
        (target / p.name).write_text(p.read_text())


def _launch(a: argparse.Namespace, config: Config, timeline_dir: Path | None) -> Run:
    """One configuration under torchrun (``config.copies`` jobs at once)."""
    with tempfile.TemporaryDirectory() as root:
        outs = [Path(root, str(i)) for i in range(config.copies)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        n = config.world
        what = f"{config.copies} x 1 process at once" if config.copies > 1 else \
            f"{n} process{'es' if n > 1 else ''}"
        print(f"  {config.label}: {what} ...", end="", flush=True, file=sys.stderr)
        started, jobs = time.perf_counter(), []
        for out in outs:
            out.mkdir()
            jobs.append(subprocess.Popen(_worker_command(a, config, out, timeline_dir is not None),
                                         env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True))
        outputs = [job.communicate()[0] for job in jobs]
        print(f" {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        for job, output in zip(jobs, outputs):
            if job.returncode != 0:
                for line in output.splitlines()[-30:]:  # indented: not this tool's error line
                    print(f"  | {line}", file=sys.stderr)
                raise ToolError(f"{config.label} run", f"failed with exit code "
                                f"{job.returncode}; its last lines are above")
        _keep_timeline(outs[0], timeline_dir, config.label)
        return Run(_read_ranks(outs, config.copies))


def _paired(numerators: list[float], denominators: list[float], scale: float = 1.0) -> float:
    """Median over rounds of ``scale * numerator / denominator`` taken within each round."""
    return statistics.median(scale * n / x for n, x in zip(numerators, denominators))


def _stash_counts(schedule: str, depth: int, microbatches: int) -> list[int]:
    """Per stage, the most microbatches forwarded and not yet through their backward (B, or I
    where the backward is split: after the I only what its W needs is kept)."""
    from megatron_2bw.schedules import Kind, pipeline_actions
    from megatron_2bw.schedules.actions import SENDS_GRAD

    order = "flush" if schedule == "megatron" else schedule  # Megatron's 1F1B = Flush's order
    peaks = []
    batches = max(3, 2 * depth)  # at m < d PipeDream's look-ahead spans d - 1 batches
    for actions in pipeline_actions(order, depth, microbatches, batches):
        held = peak = 0
        for a in actions:
            held += (a.kind is Kind.FORWARD) - (a.kind in SENDS_GRAD)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _versions(schedule: str) -> int:
    from megatron_2bw.schedules import SCHEDULES as SPECS

    return SPECS[schedule].max_versions if schedule in SPECS else 1


def _per_stage(values) -> str:
    return "/".join(values)


def _median_ms(ranks: list[list[RankResult]], key: str) -> str:
    """Per stage, the median over every round's measured iterations of ``key``, in ms ('-' if
    not measured); ``ranks[i]`` holds stage i's results of every round."""
    def one(results: list[RankResult]) -> str:
        values = [v for r in results for v in r.values(key) if v is not None]
        return f"{statistics.median(values) * 1e3:.0f}" if values else "-"

    return _per_stage(one(results) for results in ranks)


def _stages(runs: list[Run]) -> list[list[RankResult]]:
    """Per stage, that stage's results of every round."""
    return [list(results) for results in zip(*(run.by_stage() for run in runs))]


def _parser() -> argparse.ArgumentParser:
    p = ToolParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=positive_int, default=2,
                   help="pipeline stages d = processes")
    p.add_argument("--microbatches", type=positive_int, default=2,
                   help="microbatches per batch m")
    p.add_argument("--schedules", type=comma_list(run_name), default=SCHEDULES,
                   help=f"comma-separated (default: {','.join(SCHEDULES)}); each may name a "
                        "correction and an optimizer, SCHEDULE[-CORRECTION][+OPTIMIZER] "
                        "(2bw-ef+muon: 2bw with --stale-weight-correction ef, --optimizer "
                        "muon)")
    p.add_argument("--data-parallel-size", type=positive_int, default=1,
                   help="replicas of every pipelined row (d x N processes, m microbatches each; "
                        "the single-process rows step the same global batch); per-rank "
                        "columns then list stage 0's ranks first")
    p.add_argument("--no-single-rows", action="store_true",
                   help="leave out the single-process references (vs ideal, vs busy: nan)")
    p.add_argument("--iters", type=positive_int, default=20, help="measured iterations")
    p.add_argument("--warmup", type=nonneg_int, default=3,
                   help="iterations before measuring (at least 1 is run)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="run every configuration this many times, interleaved; the table "
                        "shows the median over rounds")
    # head dimension 64 as in GPT-2/3; hidden 512 keeps the linear layers' GEMMs the bulk of a
    # layer's time, as in the models users train (at 256 on one CPU core the elementwise work
    # and attention are ~40% of the backward)
    add_model_size_flags(p, num_layers=8, micro_batch_size=2, hidden_size=512,
                         num_attention_heads=8)
    p.add_argument("--vocab-size", type=positive_int, default=1024,
                   help="the output layer's width: at 32000 (a real tokenizer's) the output "
                        "layer and the loss weigh several layers on the last stage")
    g = p.add_argument_group("layer splits (Megatron-LM's flags, for every pipelined row)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=positive_int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=positive_int, default=None)
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true")
    g.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT")
    g.add_argument("--splits", type=comma_list(str, ("even", "planner")), default=None,
                   help="instead: each schedule once per split, 'even' (megatron-core's) and "
                        "'planner' (the planner's balanced split for this model and layout, "
                        "tools/plan.py's), paired within rounds, with the planner's predicted "
                        "time per iteration beside the measured one")
    g.add_argument("--profile", type=existing_file, default=None,
                   help="the layer profile the planner predicts with (default: tools/profiles/"
                        "<this CPU>.json where it exists, else closed forms)")
    p.add_argument("--clip-grad", type=nonneg_float, default=0.0)
    p.add_argument("--tie-embeddings", action="store_true",
                   help="share input and output embeddings (an all-reduce at every step)")
    p.add_argument("--sync-variants", action="store_true",
                   help="also run 2bw and flush with --clip-grad 1.0 and tied embeddings")
    p.add_argument("--moe-variants", action="store_true",
                   help="also run 2bw and flush with every FFN a Mixture of Experts (MOE_FLAGS: "
                        f"{' '.join(MOE_FLAGS)}; all experts on each stage, no biases)")
    p.add_argument("--chained-optimizer", action="store_true",
                   help="step the optimizer wrapped in megatron-core's ChainedOptimizer (as "
                        "get_megatron_optimizer returns it), which all-reduces the grad norm "
                        "over the stages at every step even without clipping")
    p.add_argument("--timeline-dir", type=writable_dir, default=None,
                   help="also record timelines of this package's schedules here "
                        "(draw with tools/timeline.py --records DIR/<schedule>)")
    p.add_argument("--nice", type=_niceness, default=0,
                   help="run the configurations under 'nice -n N'; a negative N (needs the "
                        "privilege) keeps other processes on a shared machine from taking the "
                        "stages' cores (see the runq column)")
    p.add_argument("--json", type=output_file, default=None,
                   help="also write all measurements here")
    return p


def _niceness(text: str) -> int:
    """A `nice -n` value, -20..19."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not -20 <= value <= 19:
        raise argparse.ArgumentTypeError(f"expected an integer in -20..19, got {text!r}")
    return value


def _check_configs(a: argparse.Namespace, configs: list[Config]) -> None:
    """Every configuration's training flags, exactly as its run gets them, pass the training
    validator before any runs."""
    rename = {"--pipeline-model-parallel-size": "--depth", "--global-batch-size": "--microbatches",
              "--train-iters": "--iters"}
    for config in configs:
        check_training_flags(_training_flags(a, config), config.world,
                             f"{config.schedule} on {config.world} process(es)",
                             rename=rename)


def _configs(a: argparse.Namespace, schedules: list[str]) -> list[Config]:
    """The table's rows: the single process, d copies of it at once, every schedule, and with
    --sync-variants 2bw and flush with clipping and tied embeddings."""
    clip, tied = a.clip_grad, a.tie_embeddings
    configs = [] if a.no_single_rows else [
        Config(SINGLE, "megatron", 1, clip, tied, "single"),
        Config(BUSY, "megatron", 1, clip, tied, "single_busy",
               copies=a.depth * a.data_parallel_size)]
    below = a.microbatches < a.depth  # 2BW runs m = d there
    if a.splits:
        return configs + [dataclasses.replace(_split_config(a, s, split),
                                              replicas=a.data_parallel_size)
                          for s in schedules for split in a.splits]
    rows = [Config(TWOBW_AT_D, s, a.depth, clip, tied, "2bw_m_d", microbatches=a.depth)
            if s == "2bw" and below else _run_config(a, s) for s in schedules]
    if a.moe_variants:
        rows += [Config(f"{s} +moe", s, a.depth, clip, tied, f"{s}_moe", extra=MOE_FLAGS)
                 for s in ("2bw", "flush")]
    if a.sync_variants:
        rows += [Config("2bw +clip+tied", "2bw", a.depth, 1.0, True, "2bw_clip_tied"),
                 Config("2bw +clip+tied, loop step", "2bw", a.depth, 1.0, True,
                        "2bw_clip_tied_loop", extra=("--no-deferred-step",)),
                 Config("flush +clip+tied", "flush", a.depth, 1.0, True, "flush_clip_tied")]
    return configs + [dataclasses.replace(row, replicas=a.data_parallel_size) for row in rows]


MOE_FLAGS = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
             "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear")
"""The --moe-variants rows' experts: the model's FFN (4h) in each of 4 experts, 2 per token, so
a token's FFN FLOPs double and each stage holds 4 FFNs' weights; expert parallelism 1 (the
benchmark runs one process per stage)."""


def _run_config(a: argparse.Namespace, name: str) -> Config:
    """The row of run ``name`` (cli.RunName: a schedule, maybe a correction and an optimizer)."""
    run = RunName.parse(name)
    extra = tuple(run.flags()[2:])  # after its --pipeline-schedule
    label = name.replace("+", "_")
    return Config(name, run.real_schedule, a.depth, a.clip_grad, a.tie_embeddings, label,
                  extra=extra)


def _split_config(a: argparse.Namespace, name: str, which: str) -> Config:
    """A --splits row: schedule `name` with the even split or the planner's."""
    config = _run_config(a, name)
    if which == "even":
        split = None
    else:
        layout = _layout(a, config, None)
        split = _cost_model(a).balanced_split(layout)
        if split is None:
            raise ToolError("--splits", f"the planner's split of {layout.label()} is the even "
                                        "one: nothing to compare")
    label = "even" if split is None else "|".join(map(str, split))
    return dataclasses.replace(config, name=f"{name} {label}",
                               label=f"{config.label}_{label.replace('|', '-')}",
                               split=split)


def _layout(a: argparse.Namespace, config: Config, split: tuple[int, ...] | None):
    """The planner's Layout of a pipelined row (t 1, w 1)."""
    from megatron_2bw.planner import Layout

    return Layout(1, config.processes, config.replicas, a.micro_batch_size,
                  config.microbatches or a.microbatches, False, config.schedule, split=split)


def _cost_model(a: argparse.Namespace):
    """The planner's cost model of the benchmark's model on this machine's cores (fp32, its
    clipping and embeddings), with --profile or this CPU's profile where one exists."""
    from megatron_2bw.planner import CostModel, ModelSpec, Profile, preset

    model = ModelSpec("gpt", a.num_layers, a.hidden_size, a.num_attention_heads, a.seq_length,
                      a.vocab_size, untie_embeddings=not a.tie_embeddings, dropout=False)
    path = _profile_path(a)
    profile = Profile.load(path) if path is not None else None
    return CostModel(model, preset("cpu-local", gpus_per_node=a.depth * a.data_parallel_size),
                     "fp32",
                     profile=profile, clip_grad=a.clip_grad > 0)


def _profile_path(a: argparse.Namespace) -> Path | None:
    """--profile, or this CPU's profile in tools/profiles where one exists."""
    from megatron_2bw.planner import preset
    from megatron_2bw.planner.profile import default_profile_path

    path = Path(a.profile or default_profile_path(preset("cpu-local").device_name))
    return path if path.exists() else None


def _schedule_of(row: str) -> str:
    """The --pipeline-schedule of a row ("2bw (m=d)", "2bw +clip+tied", "2bw-ef+muon")."""
    return RunName.parse(row.split()[0]).real_schedule


def _run_rounds(a: argparse.Namespace, configs: list[Config]) -> dict[str, list[Run]]:
    """Every configuration ``--rounds`` times; rounds interleave the configurations (a shared
    machine's load drifts), every other round in reverse order (a drift within a round then
    favours each of two neighbouring rows as often). Timelines are kept from the first round's
    pipelines."""
    runs: dict[str, list[Run]] = {config.name: [] for config in configs}
    for round_ in range(a.rounds):
        if a.rounds > 1:
            print(f" round {round_ + 1} of {a.rounds}", file=sys.stderr)
        for config in configs[::-1] if round_ % 2 else configs:
            keep = a.timeline_dir if config.world > 1 and round_ == 0 else None
            runs[config.name].append(_launch(a, config, keep))
    return runs


def _write_json(path: Path, a: argparse.Namespace, runs: dict[str, list[Run]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "args": {k: str(v) for k, v in vars(a).items()},
        "ms_per_round": {name: [run.iteration_time() * 1e3 for run in rounds]
                         for name, rounds in runs.items()},
        "runs": {name: [asdict(run) for run in rounds] for name, rounds in runs.items()}},
        indent=1))


@dataclass
class Table:
    """The measurements of every row, and what the rows are compared with."""

    a: argparse.Namespace
    runs: dict[str, list[Run]]
    load: tuple[float, float]
    """The 1-minute load average before and after the runs."""
    configs: list[Config] = field(default_factory=list)
    """The rows' configurations."""
    times: dict[str, list[float]] = field(init=False)
    """Row name -> seconds per iteration, one per round."""

    def __post_init__(self):
        self.times = {name: [run.iteration_time() for run in rounds]
                      for name, rounds in self.runs.items()}

    def time_of(self, name: str) -> float:
        """Median over rounds of a row's seconds per iteration."""
        return statistics.median(self.times[name])

    def ratio(self, name: str, reference: str, scale: float = 1.0) -> float:
        """``scale * reference time / row time``, paired within each round, median over rounds
        (a shared machine's speed drifts by 10-20% between rounds, which would otherwise enter a
        ratio of two medians taken at different times)."""
        if reference not in self.times:
            return float("nan")
        return _paired(self.times[reference], self.times[name], scale)


HEADER = (f"{'ms/iter':>8} {'samples/s':>9} {'vs 2bw':>7} {'vs ideal':>8} {'vs busy':>7}  "
          f"{'cpu ms':>9} {'runq ms':>9} {'recv ms':>9} {'coll ms':>9}  "
          f"{'stash':>5} {'stash MiB':>10} {'weights MiB':>11} {'copied MiB':>10} "
          f"{'W MiB':>9}")


def _row(table: Table, name: str, width: int) -> str:
    """One row: time, throughput, ratios, per-stage waits and memory."""
    a, rounds = table.a, table.runs[name]
    d, t, m, w = a.depth, table.time_of(name), _microbatches(a, name), a.data_parallel_size
    scale = m / (a.microbatches * d * w)  # the ideal: single-process time / (d w), row's m
    first = rounds[0].by_stage()
    if name.startswith("single"):
        stash, versions = [1] * len(first), 1
    else:
        stash = [c for c in _stash_counts(_schedule_of(name), d, m) for _ in range(w)]
        versions = _versions(_schedule_of(name))
    boundary = a.seq_length * a.micro_batch_size * a.hidden_size * 4
    saved = [r.saved_bytes_per_microbatch or boundary for r in first]
    weights = [r.weight_bytes or r.param_bytes * versions for r in first]
    stages = _stages(rounds)
    twobw = "2bw even" if "2bw even" in table.runs else "2bw"  # --splits: the even row
    return (f"{name:<{width}} {t * 1e3:8.1f} {a.micro_batch_size * m * w / t:9.2f} "
            f"{table.ratio(name, twobw):7.2f} {table.ratio(name, SINGLE, scale):8.2f} "
            f"{table.ratio(name, BUSY, scale):7.2f}  "
            f"{_median_ms(stages, 'cpu_seconds'):>9} {_median_ms(stages, 'run_queue_seconds'):>9} "
            f"{_median_ms(stages, 'recv_seconds'):>9} "
            f"{_median_ms(stages, 'collective_seconds'):>9}  "
            f"{_per_stage(str(c) for c in stash):>5} "
            f"{_per_stage(f'{c * x / 2**20:.1f}' for c, x in zip(stash, saved)):>10} "
            f"{_per_stage(f'{w / 2**20:.1f}' for w in weights):>11} "
            f"{_per_stage(f'{(r.copied_bytes or 0) / 2**20:.1f}' for r in first):>10} "
            f"{_per_stage(f'{r.pending_w_bytes / 2**20:.1f}' for r in first):>9}")


def _notes(table: Table, schedules: list[str]) -> list[str]:
    """The lines under the table: what the columns mean, the references, the machine."""
    a = table.a
    boundary = a.seq_length * a.micro_batch_size * a.hidden_size * 4
    first_row = next(name for name in table.runs if not name.startswith("single"))
    saved = "/".join(f"{(r.saved_bytes_per_microbatch or 0) / 2**20:.1f}"
                     for r in table.runs[first_row][0].by_stage())
    optimizers = sorted({r.optimizer for rounds in table.runs.values() for run in rounds
                         for r in run.ranks})
    return [
        "ms/iter: median over rounds of the slowest stage's median; vs 2bw and vs ideal:"
        " median over rounds of the ratio within a round; per stage (stage "
        "0/1/...), medians over all measured iterations: cpu = main-thread CPU ms, runq = "
        "ms ready but not running (another process had the core), recv = ms blocked in "
        "p2p exchanges, coll = ms in all-reduces; stash = peak stashed microbatches (forwarded, "
        "input gradient not yet computed); weights = the most bytes of weight versions held (measured); copied = bytes "
        "written by tensor copies (copy_, clone, _to_copy) in one iteration; W = the most bytes "
        "pending weight-gradient passes keep at once (zb-h1: inputs and output gradients of the "
        "linear layers, from each I to its W)",
        _references(table) + f"boundary activation s*b*h*4 = {boundary / 2**20:.2f} MiB, saved "
        f"for backward per microbatch and stage (measured): {saved} MiB",
        f"optimizer: {', '.join(optimizers)}"
        + (" (megatron-core's ChainedOptimizer.step() all-reduces the grad norm over "
           "the stages at every step, also with --clip-grad 0; 2bw's deferred step skips it)"
           if "ChainedOptimizer" in optimizers else ""),
        f"note: --clip-grad {a.clip_grad} and {'tied' if a.tie_embeddings else 'untied'} "
        "embeddings for every row but the +clip+tied ones; a grad-norm or tied-embedding "
        "all-reduce syncs all stages at each step, which costs 2BW a (d-1) x backward stall per "
        "batch unless its step is deferred (the default; --sync-variants shows both)",
        f"load average before/after: {table.load[0]:.2f}/{table.load[1]:.2f} "
        f"(on {os.cpu_count()} CPUs){f'; ran under nice -n {a.nice}' if a.nice else ''}"]


def _references(table: Table) -> str:
    """The ideal and busy references (the single-process rows), or '' without them."""
    if SINGLE not in table.runs:
        return ""
    n = table.a.depth * table.a.data_parallel_size
    single, busy = table.time_of(SINGLE), table.time_of(BUSY)
    return (f"ideal = single-process time / processes = {single * 1e3:.1f} / {n} = "
            f"{single / n * 1e3:.1f} ms per iteration; busy = the same with {n} copies of the "
            f"single process running at once, one per process: {busy * 1e3:.1f} / {n} = "
            f"{busy / n * 1e3:.1f} ms (what this machine's shared cores, caches, memory and host "
            "give each busy process; every copy holds the whole model, a stage only part of "
            "it); ")


def _table(table: Table, schedules: list[str]) -> str:
    width = max(17, *(len(name) for name in table.runs))
    header = f"{'schedule':<{width}} {HEADER}"
    rows = [header, "-" * len(header)]
    rows += [_row(table, name, width) for name in table.runs]
    return "\n".join(rows + _notes(table, schedules) + _zero_bubble(table)
                     + _over_flush(table) + _optimizer_steps(table)
                     + _split_comparison(table, schedules))


def _split_comparison(table: Table, schedules: list[str]) -> list[str]:
    """--splits: per schedule, the planner's split against the even one, measured (the ratio
    of their times within each round, its median and spread) and predicted by the planner
    (`CostModel.time` with the schedule simulator)."""
    a = table.a
    if not a.splits or "planner" not in a.splits or "even" not in a.splits:
        return []
    cost, path = _cost_model(a), _profile_path(a)
    source = f"profile {path}" if path else "closed forms (no profile of this CPU)"
    lines = [f"splits (d={a.depth}, m={a.microbatches}, vocab {a.vocab_size}; predicted: the "
             f"planner, {source}):"]
    for name in schedules:
        even = next(c for c in table.configs if c.name.startswith(name + " ") and c.split is None)
        ours = next(c for c in table.configs if c.name.startswith(name + " ") and c.split)
        ratios = [e / p for e, p in zip(table.times[even.name], table.times[ours.name])]
        predicted = {c.name: cost.time(_layout(a, c, c.split), simulate=True).iteration
                     for c in (even, ours)}
        measured = {c.name: table.time_of(c.name) for c in (even, ours)}
        errors = "; ".join(f"{c.name}: predicted {predicted[c.name] * 1e3:.1f} ms, measured "
                           f"{measured[c.name] * 1e3:.1f} ms "
                           f"({predicted[c.name] / measured[c.name] - 1:+.1%})"
                           for c in (even, ours))
        flags = " ".join(_split_flags(a, ours))
        cpu = {c.name: _slowest_cpu(table.runs[c.name]) for c in (even, ours)}
        lines.append(f"  {name}: {ours.name.split()[-1]} ({flags}) over even: "
                     f"{statistics.median(ratios):.3f}x measured (rounds "
                     f"{', '.join(f'{r:.3f}' for r in ratios)}; spread "
                     f"{max(ratios) - min(ratios):.3f}), "
                     f"{predicted[even.name] / predicted[ours.name]:.3f}x predicted; {errors}; "
                     f"the slowest stage's CPU ms per iteration {cpu[even.name] * 1e3:.0f} -> "
                     f"{cpu[ours.name] * 1e3:.0f} ({cpu[even.name] / cpu[ours.name]:.3f}x)")
    return lines


def _slowest_cpu(runs: list[Run]) -> float:
    """The largest per-stage median main-thread CPU seconds per iteration (over every round's
    measured iterations): the bottleneck's work, which other processes' load delays (runq)
    but does not add to."""
    return max(statistics.median(v for r in results for v in r.values("cpu_seconds"))
               for results in _stages(runs))


def _over_flush(table: Table) -> list[str]:
    """Each row's speed over flush with its optimizer, paired within rounds: the median and
    the rounds' range, and on each stage the median time per iteration in the optimizer step's
    actions (the S action, and where the step is deferred its application: 2bw, pipedream,
    pipemare; elsewhere the step runs in the loop, outside the actions)."""
    lines = []
    for name, rounds in table.runs.items():
        try:
            reference = RunName.parse(name.split()[0]).reference("flush")
        except Exception:  # noqa: BLE001 -- the single-process rows have no run name
            continue
        if reference == name or reference not in table.times:
            continue
        ratios = [r / x for r, x in zip(table.times[reference], table.times[name])]
        steps = "/".join("-" if math.isnan(ms) else f"{ms:.1f}"  # -: stepped in the loop
                         for ms in _action_ms(rounds, "S per iteration"))
        lines.append(f"  {name}: {statistics.median(ratios):.2f}x {reference} "
                     f"(rounds {min(ratios):.2f}-{max(ratios):.2f}); optimizer step actions "
                     f"ms per iteration, per stage: {steps}")
    return ["speed over flush with the same optimizer (paired rounds):", *lines,
            *_predictions(table)] if lines else []


def _predictions(table: Table) -> list[str]:
    """The planner's ms per iteration of each plain pipelined row (its optimizer, correction,
    clipping and embeddings; the schedule simulator), beside the measured median."""
    a, lines = table.a, []
    if a.splits or a.sync_variants or a.moe_variants:
        return []
    cost, path = _cost_model(a), _profile_path(a)
    for config in table.configs:
        try:
            run = RunName.parse(config.name)
        except Exception:  # noqa: BLE001 -- the single-process rows have no run name
            continue
        if config.processes < 2 or run.schedule not in SCHEDULES:
            continue
        sharded = run.optimizer == "dist_muon"
        model = dataclasses.replace(cost, optimizer="muon" if sharded else run.optimizer,
                                    distributed_optimizer=sharded,
                                    correction=run.correction or "none")
        predicted = model.time(_layout(a, config, None), simulate=True).iteration
        measured = table.time_of(config.name)
        lines.append(f"  {config.name}: predicted {predicted * 1e3:.0f} ms, measured "
                     f"{measured * 1e3:.0f} ms ({predicted / measured - 1:+.1%})")
    source = f"profile {path}" if path else "closed forms (no profile of this CPU)"
    return [f"the planner's ms per iteration ({source}):", *lines] if lines else []


def _optimizer_steps(table: Table) -> list[str]:
    """Per rank, each row's optimizer update (wall and CPU ms, median over every measured
    iteration), dist_muon's gather and the optimizer state; then every +dist_muon row against
    its +muon row: step time (slowest rank's, paired within rounds) and state per rank."""
    def ms(runs: list[Run], key: str) -> str:
        return _per_stage(f"{statistics.median(v for r in results for v in r.values(key)) * 1e3:.1f}"
                          for results in _stages(runs))

    lines = ["optimizer per rank (stage 0's ranks first; ms per iteration, MiB):"]
    for name, runs in table.runs.items():
        if name.startswith("single"):
            continue
        state = _per_stage(f"{r.optimizer_state_bytes / 2**20:.2f}" for r in runs[0].by_stage())
        lines.append(f"  {name}: update {ms(runs, 'step_seconds')} (CPU "
                     f"{ms(runs, 'step_cpu_seconds')}), gather {ms(runs, 'gather_seconds')}, "
                     f"state {state}")
    return lines + [line for name in table.runs if name.endswith("+dist_muon")
                    and name.replace("+dist_muon", "+muon") in table.runs
                    for line in _sharded_over_whole(table, name)]


def _slowest_step(run: Run, key: str) -> float:
    """The largest per-rank median of an optimizer time over the run's measured iterations."""
    return max(statistics.median(r.values(key)) for r in run.ranks)


def _sharded_over_whole(table: Table, name: str) -> list[str]:
    """Row ``name`` (+dist_muon) over its +muon row: the slowest rank's update time, wall and
    CPU, as ratios paired within rounds (median, range), and each rank's optimizer state."""
    whole = name.replace("+dist_muon", "+muon")
    lines = [f"  {name} / {whole}:"]
    for key, what in (("step_seconds", "update wall"), ("step_cpu_seconds", "update CPU"),
                      ("seconds", "iteration")):
        pick = (lambda run: run.iteration_time()) if key == "seconds" else \
            (lambda run, key=key: _slowest_step(run, key))
        ratios = [pick(x) / pick(y) for x, y in zip(table.runs[name], table.runs[whole])]
        lines.append(f"    {what}: {statistics.median(ratios):.3f}x (rounds "
                     f"{', '.join(f'{r:.3f}' for r in ratios)})")
    ours, theirs = table.runs[name][0].by_stage(), table.runs[whole][0].by_stage()
    lines.append("    optimizer state per rank: " + _per_stage(
        f"{x.optimizer_state_bytes / max(y.optimizer_state_bytes, 1):.3f}"
        for x, y in zip(ours, theirs)) + "x")
    return lines


def _action_ms(runs: list[Run], kind: str) -> list[float]:
    """Per stage, the median over rounds of an action's median duration (ms)."""
    return [statistics.median(r.action_seconds.get(kind, float("nan")) for r in results) * 1e3
            for results in _stages(runs)]


def _bubble_ms(runs: list[Run]) -> list[float]:
    """Per stage, the median over every measured iteration of the time outside actions (ms)."""
    return [statistics.median(i.seconds - i.busy_seconds for r in results for i in r.iterations
                              if i.busy_seconds is not None) * 1e3
            for results in _stages(runs)]


BUBBLE_FORMULAS = {  # Qi et al. 2024, Section 2.1 (T_B there is the input-gradient part)
    "flush": ("(d-1)(T_F+T_B)", lambda t: t["F"] + t["B"]),
    "zb-h1": ("(d-1)(T_F+T_I-T_W)", lambda t: t["F"] + t["I"] - t["W"]),
}


def _zero_bubble(table: Table) -> list[str]:
    """flush against zb-h1: measured action times, the bubble their formulas predict beside
    the measured one, the throughput and the copies."""
    if not {"flush", "zb-h1"} <= set(table.runs):
        return []
    d = table.a.depth
    m = table.a.microbatches
    lines = [f"zero bubble (d={d}, m={m}; per stage 0/1/..., ms; predicted "
             "from the stages' mean action times):"]
    iteration, means = {}, {}
    for name, (formula, per_microbatch) in BUBBLE_FORMULAS.items():
        runs = table.runs[name]
        kinds = ("F", "B") if name == "flush" else ("F", "I", "W")
        times = {kind: _action_ms(runs, kind) for kind in kinds}
        mean = means[name] = {kind: statistics.fmean(values) for kind, values in times.items()}
        iteration[name] = m * sum(mean.values()) + (d - 1) * per_microbatch(mean)
        lines.append(f"  {name:<6} " + "  ".join(
            f"T_{kind} {_per_stage(f'{v:.1f}' for v in values)}" for kind, values in times.items())
            + f"  bubble {formula} = {(d - 1) * per_microbatch(mean):.1f}, measured "
            f"{_per_stage(f'{v:.1f}' for v in _bubble_ms(runs))}")
    copies = {name: sum(r.copied_bytes or 0 for r in table.runs[name][0].ranks)
              for name in BUBBLE_FORMULAS}
    lines.append(f"  formulas' iterations m(sum of T) + bubble: flush {iteration['flush']:.1f}, zb-h1 "
                 f"{iteration['zb-h1']:.1f} ms, predicted zb-h1 / flush "
                 f"{iteration['flush'] / iteration['zb-h1']:.2f}x (T_W / T_I = "
                 f"{means['zb-h1']['W'] / means['zb-h1']['I']:.2f}; the optimizer step and "
                 "the exchanges are left out)")
    lines.append(f"  zb-h1 / flush: samples/s {table.ratio('zb-h1', 'flush'):.2f}x (paired within "
                 f"rounds), bytes copied per iteration {copies['zb-h1'] / 2**20:.1f} / "
                 f"{copies['flush'] / 2**20:.1f} MiB = "
                 f"{copies['zb-h1'] / max(copies['flush'], 1):.2f}x (all stages)")
    return lines


def _describe(a: argparse.Namespace) -> str:
    w = a.data_parallel_size
    layout = f"PP={a.depth} on {a.depth}" if w == 1 else \
        f"PP={a.depth} x DP={w} on {a.depth * w}"
    return (f"benchmark: GPT {a.num_layers} layers, h={a.hidden_size}, "
            f"heads={a.num_attention_heads}, s={a.seq_length}, vocab={a.vocab_size}; micro batch "
            f"b={a.micro_batch_size}, m={a.microbatches} microbatches per replica, global batch "
            f"{a.micro_batch_size * a.microbatches * w}; {layout} single-threaded "
            f"CPU processes; {a.warmup} warm-up + {a.iters} measured iterations; clip-grad "
            f"{a.clip_grad}, embeddings {'tied' if a.tie_embeddings else 'untied'}"
            f"{', ChainedOptimizer' if a.chained_optimizer else ''}")


@main_guard
def main(argv: list[str] | None = None) -> int:
    """Benchmark the schedules (or, with --worker, run one rank); bad input ends it with one
    `error:` line and exit code 2."""
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return worker(argv)
    a = _parser().parse_args(argv)
    a.warmup = max(a.warmup, 1)
    schedules = list(dict.fromkeys(a.schedules))
    configs = _configs(a, schedules)
    _check_configs(a, configs)
    print(_describe(a), file=sys.stderr)
    load_before = os.getloadavg()[0]
    runs = _run_rounds(a, configs)
    load = (load_before, os.getloadavg()[0])
    if a.json:  # written before the table, so a formatting error loses no measurement
        _write_json(a.json, a, runs)
    print(_table(Table(a, runs, load, configs), schedules))
    return 0


if __name__ == "__main__":
    sys.exit(main())
