"""Pipeline schedules side by side: the same small GPT, the same global batch, on CPU processes.

    python tools/bench_schedules.py [--depth 2 --microbatches 2 --iters 20 --warmup 3]

Every schedule (2bw, flush, gpipe, pipedream, pipemare, zb-h1, naive, and megatron = Megatron's
own 1F1B) trains the same GPT with PP = d on d single-threaded CPU processes (one stage per
core, gloo p2p), and so does the same model on ONE process (PP = 1, same global batch) for the
bubble-free ideal:

    ideal time per iteration = single-process time / d

and, as a check of the machine, d copies of that single process run at once, one per core
("single, d at once"; the "vs busy" column): on a machine whose cores share caches, memory
bandwidth or a host, a process runs slower while the other cores work, which a pipeline of d
busy processes pays and a process alone does not. Each copy holds the whole model (a stage holds
1/d of it), so this reference errs on the slow side.

Each run is ``torchrun`` over this file in worker mode: an in-process harness builds megatron-2bw's
``Trainer`` and times each ``train_step`` (forward/backward of the m microbatches, the
optimizer step) with ``time.perf_counter``; no evaluation, no checkpoint, no log-interval
collective. The first ``--warmup`` iterations and the last one (2BW's drain) are not measured.
A stage's time per iteration is the median of its measured iterations; the table shows the
slowest stage. Training data are random tokens (the data pipeline is not what is measured).

Memory columns, per stage: peak stashed activations (microbatches forwarded and not yet
backwarded; for zb-h1, not yet through their W, since its W re-traverses the kept graph) from the
schedule's action lists (Megatron's 1F1B has PipeDream-Flush's order); their bytes = count x the tensors one microbatch's forward saves for backward
on that stage (measured with autograd's saved-tensor hooks, parameters excluded; the
boundary activation alone is s*b*h*4 bytes in fp32); weights = the stage's parameter bytes x
the weight versions the schedule keeps (2 for 2BW).

Fairness: by default ``--clip-grad 0 --untie-embeddings-and-output-weights``. A grad-norm
all-reduce over the pipeline stages (clipping) or the tied-embedding all-reduce between the first
and the last stage synchronises all stages at every optimizer step, which the other schedules
pay anyway in their flush; under 2BW it would add a (d-1) x backward stall per batch, which the
deferred step removes (``megatron_2bw.deferred``; ``--no-deferred-step`` keeps the stall).
``--clip-grad 1.0 --tie-embeddings`` turns them back on; ``--sync-variants`` adds rows with them:
2bw deferred, 2bw with the step where the loop calls it, and flush.
megatron-core 0.16.1's ``ChainedOptimizer.step()`` computes the grad norm (an all-reduce over
the model-parallel group) even with clipping off; the training code steps its one inner optimizer
instead (``megatron_2bw.training.build``), and ``--chained-optimizer`` puts megatron-core's
wrapper back to show what that all-reduce costs (2BW's deferred step skips it).

Where the time goes, per stage (``a/b`` = stage 0/stage 1, medians over measured iterations):
``cpu ms`` the main thread's CPU time (compute and Python), ``runq ms`` its run-queue delay
(ready to run while another process had the core: load from outside the benchmark, or the
stages of one pipeline sharing a core), ``recv ms`` time blocked in the executor's p2p exchanges
(fused send/receive groups: idle waiting for the neighbour; '-' for Megatron's own schedule and PP=1). Per iteration,
wall ~ cpu + runq + recv + time blocked in collectives.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_2bw.cli import (ToolError, ToolParser, add_model_size_flags,  # noqa: E402
                              check_training_flags,
                              comma_list, main_guard, nonneg_float, nonneg_int, output_file,
                              positive_int, writable_dir)
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


def worker(argv: list[str]) -> int:
    ours, flags = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    p = ToolParser(prog="bench_schedules.py --worker")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--chained-optimizer", action="store_true")
    p.add_argument("--timeline", action="store_true")
    opts = p.parse_args(ours)

    import torch

    torch.set_num_threads(1)
    from functools import partial

    import megatron_2bw
    import pretrain_gpt_2bw
    from megatron_2bw import entry
    from megatron_2bw.arguments import parse_args
    from megatron_2bw.runtime import distributed
    from megatron_2bw.training.loop import Trainer

    args = parse_args(flags)
    megatron_2bw.install(args.pipeline_schedule)
    waits = _Waits()
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
    optimizer_note = type(trainer.optimizer).__name__
    runner = trainer.forward_backward
    if opts.timeline and hasattr(runner, "timeline"):
        runner.timeline = []
    total = opts.warmup + opts.iters + 1  # + the drain call (2BW), not measured
    seconds, cpu_seconds, runq_seconds, recv_seconds, coll_seconds, ends = [], [], [], [], [], []
    for i in range(total):
        if i == total - 1 and hasattr(runner, "prepare_drain"):
            runner.prepare_drain()
        saved.active = 0 < i < opts.warmup or (opts.warmup == 1 and i == 0)
        start, cpu_start, runq_start = time.perf_counter(), time.thread_time(), waits.run_queue()
        waits.recv = waits.collective = 0.0
        trainer.train_step()
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.thread_time() - cpu_start)
        runq_end = waits.run_queue()
        runq_seconds.append(None if runq_start is None or runq_end is None
                            else runq_end - runq_start)
        recv_seconds.append(waits.recv if waits.used else None)
        coll_seconds.append(waits.collective)
        ends.append(time.perf_counter())
    if hasattr(runner, "drain"):
        runner.drain()

    from megatron.core import parallel_state as ps

    chunk = trainer.model[0]
    rank = torch.distributed.get_rank()
    result = {
        "rank": rank, "stage": ps.get_pipeline_model_parallel_rank(),
        "seconds": seconds[opts.warmup:opts.warmup + opts.iters],
        "cpu_seconds": cpu_seconds[opts.warmup:opts.warmup + opts.iters],
        "run_queue_seconds": runq_seconds[opts.warmup:opts.warmup + opts.iters],
        "recv_seconds": recv_seconds[opts.warmup:opts.warmup + opts.iters],
        "collective_seconds": coll_seconds[opts.warmup:opts.warmup + opts.iters],
        "measured_wall": ends[opts.warmup + opts.iters - 1] - ends[opts.warmup - 1]
        if opts.warmup else None,
        "param_bytes": sum(p.numel() * p.element_size() for p in chunk.parameters()),
        "saved_bytes_per_microbatch": max(saved.per_microbatch, default=None),
        "optimizer": optimizer_note,
        "threads": torch.get_num_threads(),
    }
    Path(opts.out, f"rank{rank}.json").write_text(json.dumps(result))
    if opts.timeline and getattr(runner, "timeline", None):
        from megatron_2bw import trace

        trace.save_records(runner.timeline, Path(opts.out, f"rank{rank}.jsonl"), rank=rank,
                           extra={"schedule": args.pipeline_schedule,
                                  "microbatches": args.num_microbatches})
    distributed.destroy()
    return 0


# --- driver -------------------------------------------------------------------------------------

def _model_flags(a: argparse.Namespace) -> list[str]:
    return ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
            "--num-attention-heads", str(a.num_attention_heads),
            "--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length),
            "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch-size", str(a.micro_batch_size * a.microbatches),
            "--vocab-size", str(a.vocab_size), "--mock-data", "--cpu",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4",
            "--lr-decay-style", "constant", "--train-iters", str(a.warmup + a.iters + 1),
            "--eval-iters", "0", "--log-interval", "1000000", "--seed", "1234"]


def _launch(a: argparse.Namespace, schedule: str, nproc: int, clip_grad: float, tied: bool,
            label: str, timeline_dir: Path | None, copies: int = 1,
            extra: tuple[str, ...] = ()) -> dict:
    """One configuration under torchrun; returns the per-rank results. ``copies`` > 1 starts
    that many independent jobs at once (the busy-machine reference): copy i reports as stage i."""
    flags = _model_flags(a) + ["--pipeline-schedule", schedule,
                               "--pipeline-model-parallel-size", str(nproc),
                               "--clip-grad", str(clip_grad), *extra]
    if not tied:
        flags.append("--untie-embeddings-and-output-weights")
    with tempfile.TemporaryDirectory() as root:
        outs = [Path(root, str(i)) for i in range(copies)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        what = f"{copies} x 1 process at once" if copies > 1 else \
            f"{nproc} process{'es' if nproc > 1 else ''}"
        print(f"  {label}: {what} ...", end="", flush=True, file=sys.stderr)
        started = time.perf_counter()
        jobs = []
        for out in outs:
            out.mkdir()
            command = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node",
                       str(nproc), "--master-port", str(free_port()),
                       str(Path(__file__).resolve()), "--worker", "--out", str(out),
                       "--warmup", str(a.warmup), "--iters", str(a.iters)]
            command += ["--chained-optimizer"] if a.chained_optimizer else []
            command += ["--timeline"] if timeline_dir else []
            command += ["--", *flags]
            if a.nice:
                command = ["nice", "-n", str(a.nice), *command]
            jobs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True))
        outputs = [job.communicate()[0] for job in jobs]
        print(f" {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        for job, output in zip(jobs, outputs):
            if job.returncode != 0:
                for line in output.splitlines()[-30:]:  # indented: not this tool's error line
                    print(f"  | {line}", file=sys.stderr)
                raise ToolError(f"{label} run", f"failed with exit code {job.returncode}; "
                                                "its last lines are above")
        ranks = []
        for copy, out in enumerate(outs):
            for path in sorted(out.glob("rank*.json")):
                rank = json.loads(path.read_text())
                if copies > 1:
                    rank["rank"] = rank["stage"] = copy
                ranks.append(rank)
        if timeline_dir is not None and any(outs[0].glob("rank*.jsonl")):
            target = timeline_dir / label
            target.mkdir(parents=True, exist_ok=True)
            for stale in target.glob("*.jsonl"):
                stale.unlink()
            for p in outs[0].glob("rank*.jsonl"):
                (target / p.name).write_text(p.read_text())
    return {"ranks": sorted(ranks, key=lambda r: r["rank"])}


def _iteration_time(run: dict) -> float:
    """Slowest stage's median time per iteration (s)."""
    return max(statistics.median(r["seconds"]) for r in run["ranks"])


def _paired(numerators: list[float], denominators: list[float], scale: float = 1.0) -> float:
    """Median over rounds of ``scale * numerator / denominator`` taken within each round."""
    return statistics.median(scale * n / x for n, x in zip(numerators, denominators))


def _stash_counts(schedule: str, depth: int, microbatches: int) -> list[int]:
    """Per stage, the most microbatches whose autograd graph the executor holds at once: from
    F to B, or from F to W where the backward is split (zb-h1's W traverses the graph again)."""
    from megatron_2bw.schedules import Kind, pipeline_actions
    from megatron_2bw.schedules.actions import MAKES_PARAM_GRADS

    order = "flush" if schedule == "megatron" else schedule  # Megatron's 1F1B = Flush's order
    peaks = []
    for actions in pipeline_actions(order, depth, microbatches, 3):
        held = peak = 0
        for a in actions:
            held += (a.kind is Kind.FORWARD) - (a.kind in MAKES_PARAM_GRADS)
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def _versions(schedule: str) -> int:
    from megatron_2bw.schedules import SCHEDULES as SPECS

    return SPECS[schedule].max_versions if schedule in SPECS else 1


def _per_stage(values) -> str:
    return "/".join(values)


def _pooled(rounds: list[dict]) -> list[dict]:
    """Per stage, the per-iteration measurements of every round joined."""
    stages: dict[int, dict[str, list]] = {}
    for run in rounds:
        for rank in run["ranks"]:
            joined = stages.setdefault(rank["stage"], {})
            for key, value in rank.items():
                if isinstance(value, list):
                    joined.setdefault(key, []).extend(value)
    return [stages[i] for i in sorted(stages)]


def _median_ms(stages: list[dict], key: str) -> str:
    """Per stage, the median over measured iterations of ``key``, in ms ('-' if not measured)."""
    def one(values):
        values = [v for v in values if v is not None]
        return f"{statistics.median(values) * 1e3:.0f}" if values else "-"

    return _per_stage(one(stage.get(key) or []) for stage in stages)


def _parser() -> argparse.ArgumentParser:
    p = ToolParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=positive_int, default=2,
                   help="pipeline stages d = processes")
    p.add_argument("--microbatches", type=positive_int, default=2,
                   help="microbatches per batch m")
    p.add_argument("--schedules", type=comma_list(str, SCHEDULES), default=SCHEDULES,
                   help=f"comma-separated (default: {','.join(SCHEDULES)})")
    p.add_argument("--iters", type=positive_int, default=20, help="measured iterations")
    p.add_argument("--warmup", type=nonneg_int, default=3,
                   help="iterations before measuring (at least 1 is run)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="run every configuration this many times, interleaved; the table "
                        "shows the median over rounds")
    add_model_size_flags(p, num_layers=8, micro_batch_size=2)
    p.add_argument("--vocab-size", type=positive_int, default=1024)
    p.add_argument("--clip-grad", type=nonneg_float, default=0.0)
    p.add_argument("--tie-embeddings", action="store_true",
                   help="share input and output embeddings (an all-reduce at every step)")
    p.add_argument("--sync-variants", action="store_true",
                   help="also run 2bw and flush with --clip-grad 1.0 and tied embeddings")
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


def _check_configs(a: argparse.Namespace, schedules: list[str]) -> None:
    """Every configuration's training flags pass the training validator before any runs:
    the pipeline on --depth processes, and the single process (PP=1)."""
    rename = {"--pipeline-model-parallel-size": "--depth", "--global-batch-size": "--microbatches",
              "--train-iters": "--iters"}
    for schedule, nproc in [("megatron", 1)] + [(s, a.depth) for s in schedules]:
        flags = _model_flags(a) + ["--pipeline-schedule", schedule,
                                   "--pipeline-model-parallel-size", str(nproc)]
        check_training_flags(flags, nproc, f"{schedule} on {nproc} process(es)", rename=rename)


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
    _check_configs(a, schedules)
    d, m, b = a.depth, a.microbatches, a.micro_batch_size
    h, s = a.hidden_size, a.seq_length

    print(f"benchmark: GPT {a.num_layers} layers, h={h}, heads={a.num_attention_heads}, s={s}, "
          f"vocab={a.vocab_size}; micro batch b={b}, m={m} microbatches, global batch {b * m}; "
          f"PP={d} on {d} single-threaded CPU processes; {a.warmup} warm-up + {a.iters} measured "
          f"iterations; clip-grad {a.clip_grad}, embeddings {'tied' if a.tie_embeddings else 'untied'}"
          f"{', ChainedOptimizer' if a.chained_optimizer else ''}", file=sys.stderr)
    # (row name, schedule, processes, clip-grad, tied, label, copies at once, extra flags)
    configs = [(SINGLE, "megatron", 1, a.clip_grad, a.tie_embeddings, "single", 1, ()),
               (BUSY, "megatron", 1, a.clip_grad, a.tie_embeddings, "single_busy", d, ())]
    configs += [(sch, sch, d, a.clip_grad, a.tie_embeddings, sch, 1, ()) for sch in schedules]
    if a.sync_variants:
        configs += [("2bw +clip+tied", "2bw", d, 1.0, True, "2bw_clip_tied", 1, ()),
                    ("2bw +clip+tied, loop step", "2bw", d, 1.0, True, "2bw_clip_tied_loop", 1,
                     ("--no-deferred-step",)),
                    ("flush +clip+tied", "flush", d, 1.0, True, "flush_clip_tied", 1, ())]
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {}
    times: dict[str, list[float]] = {name: [] for name, *_ in configs}
    for round_ in range(a.rounds):  # rounds interleave the configurations (drifting load)
        if a.rounds > 1:
            print(f" round {round_ + 1} of {a.rounds}", file=sys.stderr)
        for name, schedule, nproc, clip, tied, label, copies, extra in configs:
            run = _launch(a, schedule, nproc, clip, tied, label,
                          a.timeline_dir if nproc > 1 and round_ == 0 else None, copies, extra)
            runs.setdefault(name, []).append(run)
            times[name].append(_iteration_time(run))
    load_after = os.getloadavg()
    time_of = {name: statistics.median(ts) for name, ts in times.items()}
    if a.json:  # written before the table, so a formatting error loses no measurement
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                      "ms_per_round": {
                                          k: [t * 1e3 for t in v] for k, v in times.items()},
                                      "runs": runs}, indent=1))

    single, busy = time_of[SINGLE], time_of[BUSY]
    ideal = single / d
    # Ratios pair the runs of one round (minutes apart at most) before taking the median over
    # rounds: a shared machine's speed drifts by 10-20% between rounds, which would otherwise
    # enter a ratio of two medians taken at different times.
    vs_ideal = {name: _paired(times[SINGLE], ts, 1 / d) for name, ts in times.items()}
    vs_busy = {name: _paired(times[BUSY], ts, 1 / d) for name, ts in times.items()}
    vs_2bw = {name: _paired(times["2bw"], ts) if "2bw" in times else float("nan")
              for name, ts in times.items()}
    boundary = s * b * h * 4  # one microbatch's activation at a stage boundary, fp32
    width = max(17, *(len(name) for name in runs))
    header = (f"{'schedule':<{width}} {'ms/iter':>8} {'samples/s':>9} {'vs 2bw':>7} {'vs ideal':>8} "
              f"{'vs busy':>7}  "
              f"{'cpu ms':>9} {'runq ms':>9} {'recv ms':>9} {'coll ms':>9}  "
              f"{'stash':>5} {'stash MiB':>10} {'weights MiB':>11}")
    rows = [header, "-" * len(header)]
    for name, rounds in runs.items():
        schedule = name.split()[0]
        t = time_of[name]
        if name.startswith("single"):
            stash = [1] * len(rounds[0]["ranks"])
            versions = 1
        else:
            stash = _stash_counts(schedule, d, m)
            versions = _versions(schedule)
        by_stage = {r["stage"]: r for r in rounds[0]["ranks"]}
        saved = [by_stage[i]["saved_bytes_per_microbatch"] or boundary for i in sorted(by_stage)]
        weights = [by_stage[i]["param_bytes"] * versions for i in sorted(by_stage)]
        stages = _pooled(rounds)
        rows.append(
            f"{name:<{width}} {t * 1e3:8.1f} {b * m / t:9.2f} "
            f"{vs_2bw[name]:7.2f} {vs_ideal[name]:8.2f} {vs_busy[name]:7.2f}  "
            f"{_median_ms(stages, 'cpu_seconds'):>9} {_median_ms(stages, 'run_queue_seconds'):>9} "
            f"{_median_ms(stages, 'recv_seconds'):>9} "
            f"{_median_ms(stages, 'collective_seconds'):>9}  "
            f"{_per_stage(str(c) for c in stash):>5} "
            f"{_per_stage(f'{c * x / 2**20:.1f}' for c, x in zip(stash, saved)):>10} "
            f"{_per_stage(f'{w / 2**20:.1f}' for w in weights):>11}")
    rows.append("ms/iter: median over rounds of the slowest stage's median; vs 2bw and vs ideal:"
                " median over rounds of the ratio within a round; per stage (stage "
                "0/1/...), medians over all measured iterations: cpu = main-thread CPU ms, runq = "
                "ms ready but not running (another process had the core), recv = ms blocked in "
                "p2p exchanges, coll = ms in all-reduces; stash = peak stashed microbatches; "
                "weights = parameters x versions")
    rows.append(f"ideal = single-process time / d = {single * 1e3:.1f} / {d} = {ideal * 1e3:.1f} ms"
                f" per iteration; busy = the same with d copies of the single process running at"
                f" once, one per core: {busy * 1e3:.1f} / {d} = {busy / d * 1e3:.1f} ms (what this"
                f" machine's shared caches, memory and host give each of d busy cores; every copy"
                f" holds the whole model, a stage only 1/d of it); boundary activation s*b*h*4 = {boundary / 2**20:.2f} MiB, "
                f"saved for backward per microbatch and stage (measured): "
                + "/".join(f"{(r['saved_bytes_per_microbatch'] or 0) / 2**20:.1f}"
                           for r in sorted(runs[schedules[0]][0]['ranks'],
                                           key=lambda r: r['stage']))
                + " MiB")
    optimizers = {r["optimizer"] for rounds in runs.values() for run in rounds
                  for r in run["ranks"]}
    rows.append(f"optimizer: {', '.join(sorted(optimizers))}"
                + (" (megatron-core's ChainedOptimizer.step() all-reduces the grad norm over "
                   "the stages at every step, also with --clip-grad 0; 2bw's deferred step "
                   "skips it)"
                   if "ChainedOptimizer" in optimizers else ""))
    rows.append(f"note: --clip-grad {a.clip_grad} and "
                f"{'tied' if a.tie_embeddings else 'untied'} embeddings for every row but the "
                "+clip+tied ones; a grad-norm or tied-embedding all-reduce syncs all stages at "
                "each step, which costs 2BW a (d-1) x backward stall per batch unless its step "
                "is deferred (the default; --sync-variants shows both)")
    rows.append(f"load average before/after: {load_before[0]:.2f}/{load_after[0]:.2f} "
                f"(on {os.cpu_count()} CPUs){f'; ran under nice -n {a.nice}' if a.nice else ''}")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
