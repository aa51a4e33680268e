"""The paper's baseline comparison (PipeDream-2BW, Section 5.2-5.3, Figures 6 and 7): the same
model and global batch trained with several (schedule, layout) entries, side by side.

    python tools/compare.py                       # tiny GPT, 2 CPU processes, 5 entries
    python tools/compare.py --from-logs "2BW=runs/a.log" "GPipe=runs/b.log"   # logs of GPU runs

The default entries (Tensor MP, Inter-layer MP, GPipe, PipeDream-Flush, PipeDream-2BW) are
real ``pretrain_gpt_2bw.py`` runs under torchrun; --from-logs reads our logs and Megatron-LM's
own (``megatron_2bw.logparse``). Prints one table and writes a PNG bar chart of throughput and
peak memory per configuration.

Invariants: numbers are medians over the log lines after --warmup, without the last (its
interval holds the drain), each entry's median round with --rounds; ``stash`` and ``versions``
come from the action lists. Entries, columns: docs/schedules.md, "The paper's baseline comparison".
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOLS = Path(__file__).resolve().parent
for _path in (str(REPO), str(TOOLS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from megatron_2bw.cli import (ToolError, ToolParser, add_model_size_flags,  # noqa: E402
                              check_training_flags,
                              existing_file, main_guard, nonneg_float, nonneg_int, output_file,
                              positive_int, reading, writable_dir)
from megatron_2bw.logparse import ParsedLog, parse_log, rank_memory_line  # noqa: E402

__all__ = ["Entry", "Summary", "DEFAULT_ENTRIES", "parse_entry", "summarize",
           "median_over_rounds", "speedups",
           "format_table", "plot", "run_logged", "main"]

FAIRNESS_HELP = (
    "Every entry runs with --clip-grad 0 and --untie-embeddings-and-output-weights unless "
    "--clip-grad/--tie-embeddings say otherwise: gradient clipping needs a global grad-norm "
    "all-reduce over all stages, and tied embeddings an all-reduce between the first and the "
    "last stage, at every optimizer step. Under 2BW that collective synchronises the stages "
    "at each step and stalls the pipeline it otherwise keeps full across batches (a (d-1) x "
    "backward wait per batch); the schedules that flush pay it anyway. The same settings for "
    "every entry keep the comparison fair.")
CHAINED_HELP = (
    "megatron-core 0.16.1's ChainedOptimizer.step() all-reduces the grad norm over the "
    "model-parallel group at every step, also with --clip-grad 0, which syncs the stages just "
    "as clipping would. By default each process steps the one optimizer inside it instead "
    "(the same update without that collective, as tools/bench_schedules.py does); this flag "
    "keeps the ChainedOptimizer the training loop builds.")


@dataclass(frozen=True)
class Entry:
    """One configuration: a schedule on a (tensor, pipeline) layout; DP fills the processes."""

    label: str
    schedule: str
    tp: int | None = 1
    pp: int | None = 1
    """None (with schedule "n/a"): a log that does not say (Megatron-LM's, without its
    arguments block)."""


UNKNOWN = "n/a"
"""The schedule of a log that does not say which it ran."""

DEFAULT_ENTRIES = (
    Entry("Tensor MP", "megatron", tp=2, pp=1),
    Entry("Inter-layer MP", "naive", tp=1, pp=2),
    Entry("GPipe", "gpipe", tp=1, pp=2),
    Entry("PipeDream-Flush", "flush", tp=1, pp=2),
    Entry("PipeDream-2BW", "2bw", tp=1, pp=2),
)


def parse_entry(text: str) -> Entry:
    """'LABEL:SCHEDULE:TP:PP' (e.g. '2BW PP=4:2bw:1:4') -> Entry; TP, PP >= 1."""
    parts = text.rsplit(":", 3)
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"expected LABEL:SCHEDULE:TP:PP, got {text!r}")
    label, schedule, tp, pp = parts
    from megatron_2bw.arguments import SCHEDULES

    if schedule not in SCHEDULES:
        raise argparse.ArgumentTypeError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    try:
        entry = Entry(label, schedule, int(tp), int(pp))
    except ValueError:
        raise argparse.ArgumentTypeError(f"TP and PP must be integers in {text!r}") from None
    if entry.tp < 1 or entry.pp < 1:
        raise argparse.ArgumentTypeError(f"TP and PP must be >= 1 in {text!r}")
    return entry


def parse_log_source(text: str) -> tuple[str, str]:
    """'LABEL=PATH' -> (label, path) of an existing file."""
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH, got {text!r}")
    return label, existing_file(path)


# ---- summary math -----------------------------------------------------------------------------

@dataclass
class Summary:
    """Medians over the measured log lines of one run."""

    label: str
    schedule: str
    tp: int | None
    pp: int | None
    dp: int | None
    """None: not known (see Entry)."""
    microbatches: int | None
    measured_lines: int
    ms_per_iteration: float
    samples_per_s: float
    tokens_per_s: float | None
    tflops_per_device: float | None
    peak_memory_mib: dict[int, float] = field(default_factory=dict)
    """rank -> peak memory; only the logging (last) rank when no per-process lines exist."""
    stash: list[int] | None = None
    """Peak stashed activations (microbatches) per pipeline stage."""
    versions: int | None = None
    """Weight versions each stage keeps."""

    @property
    def max_memory_mib(self) -> float | None:
        return max(self.peak_memory_mib.values()) if self.peak_memory_mib else None


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(entry: Entry, log: ParsedLog, warmup: int, nproc: int | None = None) -> Summary:
    """Median time, throughput and TFLOP/s over the log lines after ``warmup`` iterations,
    leaving out the last line (the drain at the end of training falls into its interval);
    peak memory per process. Raises ValueError when no line is left to measure."""
    lines = log.iterations
    if lines and lines[-1].iteration == lines[-1].train_iters:
        lines = lines[:-1]
    measured = [r for r in lines if r.iteration > warmup]
    if not measured:
        raise ValueError(f"{entry.label}: no log line after {warmup} warm-up iterations "
                         f"(logged: {[r.iteration for r in log.iterations]}); train longer or "
                         "lower --warmup")
    memory = dict(log.rank_memory_mib)
    if not memory and log.iterations and log.iterations[-1].peak_memory_mib is not None:
        last_rank = (log.header.world_size if log.header else nproc or 1) - 1
        memory = {last_rank: max(r.peak_memory_mib for r in log.iterations
                                 if r.peak_memory_mib is not None)}
    header = log.header
    dp = None
    if entry.tp is not None and entry.pp is not None:
        world = header.world_size if header else (nproc or entry.tp * entry.pp)
        dp = world // (entry.tp * entry.pp)
    return Summary(
        label=entry.label, schedule=entry.schedule, tp=entry.tp, pp=entry.pp,
        dp=dp, microbatches=header.microbatches if header else None,
        measured_lines=len(measured),
        ms_per_iteration=_median(r.ms_per_iteration for r in measured),
        samples_per_s=_median(r.samples_per_s for r in measured),
        tokens_per_s=_median(r.tokens_per_s for r in measured),
        tflops_per_device=_median(r.tflops_per_device for r in measured),
        peak_memory_mib=memory)


def median_over_rounds(rounds: list[Summary]) -> Summary:
    """One summary of repeated runs of an entry: the round with the median time per iteration
    (its own throughput and TFLOP/s; for an even count the faster of the middle two), and the
    largest peak memory of each process over all rounds."""
    ordered = sorted(rounds, key=lambda s: s.ms_per_iteration)
    chosen = ordered[(len(ordered) - 1) // 2]
    memory: dict[int, float] = {}
    for s in rounds:
        for rank, mib in s.peak_memory_mib.items():
            memory[rank] = max(mib, memory.get(rank, 0.0))
    return replace(chosen, peak_memory_mib=memory,
                   measured_lines=sum(s.measured_lines for s in rounds))


def speedups(summaries: list[Summary], reference: str) -> dict[str, float]:
    """label -> the reference's throughput over this entry's (how much faster the reference
    is; the paper quotes 2BW's speed-ups over each baseline so)."""
    ref = next((s for s in summaries if s.label == reference), None)
    if ref is None:
        raise ValueError(f"reference {reference!r} is not an entry: "
                         f"{[s.label for s in summaries]}")
    return {s.label: ref.samples_per_s / s.samples_per_s for s in summaries}


def _add_schedule_memory(summary: Summary) -> None:
    """Stash per stage and weight versions from the schedule's action lists."""
    if summary.microbatches is None:
        return
    from bench_schedules import _stash_counts, _versions

    summary.stash = _stash_counts(summary.schedule, summary.pp, summary.microbatches)
    summary.versions = _versions(summary.schedule)


def format_table(summaries: list[Summary], reference: str | None) -> str:
    ratio = speedups(summaries, reference) if reference else {}
    ranks = sorted({r for s in summaries for r in s.peak_memory_mib})
    mem_head = "peak MiB " + "/".join(f"r{r}" for r in ranks) if ranks else "peak MiB"
    header = (f"{'configuration':<18} {'schedule':<8} {'TPxPPxDP':>8} {'m':>3} {'ms/iter':>9} "
              f"{'samples/s':>9} {'TFLOP/s/dev':>11} {mem_head:>{max(len(mem_head), 14)}} "
              f"{'stash':>7} {'ver':>3}" + (f" {'speed-up':>8}" if reference else ""))
    rows = [header, "-" * len(header)]
    for s in summaries:
        layout = "n/a" if s.tp is None else f"{s.tp}x{s.pp}x{s.dp}"
        memory = "/".join(f"{s.peak_memory_mib[r]:.0f}" if r in s.peak_memory_mib else "-"
                          for r in ranks) or "-"
        tflops = "-" if s.tflops_per_device is None else f"{s.tflops_per_device:.4f}"
        stash = "/".join(map(str, s.stash)) if s.stash else "-"
        microbatches = s.microbatches or ("n/a" if s.schedule == UNKNOWN else "-")
        rows.append(
            f"{s.label:<18} {s.schedule:<8} {layout:>8} {microbatches:>3} "
            f"{s.ms_per_iteration:9.1f} {s.samples_per_s:9.2f} {tflops:>11} "
            f"{memory:>{max(len(mem_head), 14)}} {stash:>7} {s.versions or '-':>3}"
            + (f" {ratio[s.label]:7.2f}x" if reference else ""))
    if reference:
        rows.append(f"speed-up: {reference}'s samples/s over each entry's (medians over "
                    f"{', '.join(str(s.measured_lines) for s in summaries)} measured log lines)")
    return "\n".join(rows)


def plot(summaries: list[Summary], path: Path, title: str) -> Path:
    """Bars of throughput (samples/s) and peak memory per configuration (Figures 6 and 7)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [textwrap.fill(s.label, 10) for s in summaries]  # "PipeDream-\nFlush"
    colors = [f"C{i}" for i in range(len(summaries))]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    bars = left.bar(labels, [s.samples_per_s for s in summaries], color=colors)
    left.bar_label(bars, fmt="%.2f", fontsize=8)
    left.set_ylabel("throughput (samples/s)")
    left.set_title("throughput")
    memory = [s.max_memory_mib or 0 for s in summaries]
    bars = right.bar(labels, memory, color=colors)
    right.bar_label(bars, fmt="%.0f", fontsize=8)
    right.set_ylabel("peak memory, worst process (MiB)")
    right.set_title("memory footprint")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    return save_figure(fig, title, path)


def save_figure(fig, title: str, path: Path) -> Path:
    """Title, lay out and write ``fig`` as a PNG (creating the folder), then free it."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- running ----------------------------------------------------------------------------------

def run_logged(command: list[str], log_path: Path, env: dict | None = None,
               echo: bool = False) -> int:
    """Run ``command`` with stdout and stderr into ``log_path``; return its exit code."""
    print("running:", shlex.join(command), file=sys.stderr, flush=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, env=env, cwd=REPO)
        for line in process.stdout:
            log.write(line)
            log.flush()
            if echo:
                sys.stderr.write(line)
        return process.wait()


def torchrun(nproc: int) -> list[str]:
    return [str(Path(sys.executable).with_name("torchrun")), "--standalone",
            "--nproc-per-node", str(nproc)]


def _model_flags(a: argparse.Namespace, data: bool = True) -> list[str]:
    """Every entry's training flags but its layout; ``data=False``: mock data in place of the
    corpus (no corpus is built, for validating a command line)."""
    flags = ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
             "--num-attention-heads", str(a.num_attention_heads),
             "--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length),
             "--micro-batch-size", str(a.micro_batch_size),
             "--global-batch-size", str(a.global_batch_size),
             "--train-iters", str(a.iters), "--log-interval", str(a.log_interval),
             "--eval-iters", "0", "--lr", "1e-4", "--lr-decay-style", "constant",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234",
             "--clip-grad", str(a.clip_grad)]
    if not a.tie_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    if a.data == "mock" or not data:
        flags += ["--mock-data", "--vocab-size", "1024"]
    else:
        from megatron_2bw.data.default import prepare_default_data

        data = prepare_default_data(split_sentences=a.model == "bert")
        flags += ["--data-path", data.data_prefix, "--tokenizer-model", data.tokenizer_model]
    return flags


def _entry_flags(entry: Entry) -> list[str]:
    return ["--pipeline-schedule", entry.schedule,
            "--tensor-model-parallel-size", str(entry.tp),
            "--pipeline-model-parallel-size", str(entry.pp)]


def _rank_worker(argv: list[str]) -> int:
    """One process of one entry: the entry script's main(), then this process's peak memory."""
    ours, flags = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    model, unchain = ours[1], "--unchain-optimizer" in ours
    if unchain:
        from megatron_2bw.training import build

        chained_builder = build.build_optimizer

        def inner_optimizer(args, chunks):
            optimizer = chained_builder(args, chunks)
            inner = getattr(optimizer, "chained_optimizers", ())
            return inner[0] if len(inner) == 1 else optimizer

        build.build_optimizer = inner_optimizer
    if model == "bert":
        import pretrain_bert_2bw as script
    else:
        import pretrain_gpt_2bw as script
    script.main(flags)

    import torch

    from megatron_2bw.training.logs import peak_memory_mib

    device = "cuda" if torch.cuda.is_available() and "--cpu" not in flags else "cpu"
    print(rank_memory_line(int(os.environ.get("RANK", "0")), peak_memory_mib(device)),
          flush=True)
    return 0


def _run_entry(a: argparse.Namespace, entry: Entry, log_path: Path) -> ParsedLog:
    command = [*torchrun(a.nproc), str(Path(__file__).resolve()), "--rank-worker", a.model]
    command += [] if a.keep_chained_optimizer else ["--unchain-optimizer"]
    command += ["--", *_model_flags(a), *_entry_flags(entry), *a.extra]
    started = time.perf_counter()
    code = run_logged(command, log_path)
    text = log_path.read_text()
    if code != 0:
        raise_failed_run(f"{entry.label} failed (exit code {code})", log_path, text)
    print(f"  {entry.label}: {time.perf_counter() - started:.0f} s, log {log_path}",
          file=sys.stderr, flush=True)
    return parse_log(text)


def raise_failed_run(what: str, log_path: Path, text: str) -> None:
    """Print the failed run's last log lines to stderr, indented (so no line of theirs reads as
    this tool's error line), then raise the one ToolError naming the log."""
    for line in text.splitlines()[-25:]:
        print(f"  | {line}", file=sys.stderr)
    raise ToolError(str(log_path), f"{what}; its last lines are above")


def training_parser(model: str) -> argparse.ArgumentParser | None:
    """The entry script's flag parser for ``model`` (None: GPT's, the default)."""
    if model != "bert":
        return None
    import pretrain_bert_2bw  # BERT adds its own flags

    return pretrain_bert_2bw.parser()


def _check_entries(a: argparse.Namespace, entries: list[Entry]) -> None:
    """Every entry's training command line passes the training entry's validator on
    --nproc processes before the first run starts (ToolError naming the flag)."""
    parser = training_parser(a.model)
    layout = "--entry" if a.entry else "--nproc"  # the flag that chose TP, PP or the world
    rename = {"--tensor-model-parallel-size": layout, "--pipeline-model-parallel-size": layout,
              "--train-iters": "--iters"}
    for entry in entries:
        flags = [*_model_flags(a, data=False), *_entry_flags(entry), *a.extra]
        check_training_flags(flags, a.nproc, f"entry {entry.label!r} ({entry.schedule}, "
                                             f"TP={entry.tp}, PP={entry.pp}, {a.nproc} "
                                             "processes)", parser, rename)


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label).strip("_").lower()


def _parser() -> argparse.ArgumentParser:
    p = ToolParser(description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter,
                   epilog="fairness: " + FAIRNESS_HELP)
    p.add_argument("--entry", action="append", type=parse_entry, default=None,
                   metavar="LABEL:SCHEDULE:TP:PP",
                   help="a configuration (repeat the flag); default: the five above")
    p.add_argument("--from-logs", nargs="+", type=parse_log_source, default=None,
                   metavar="LABEL=PATH",
                   help="summarise existing training logs instead of running (ours or "
                        "Megatron-LM's; schedule and layout are read from our header line, "
                        "else from Megatron-LM's arguments block, else shown as n/a)")
    p.add_argument("--reference", default=None,
                   help="label whose speed-up over each entry the table shows (default: the "
                        "2bw entry)")
    p.add_argument("--model", choices=("gpt", "bert"), default="gpt")
    p.add_argument("--nproc", type=positive_int, default=2, help="processes per entry")
    add_model_size_flags(p, num_layers=4, micro_batch_size=4)
    p.add_argument("--global-batch-size", type=positive_int, default=32)
    p.add_argument("--iters", type=positive_int, default=40,
                   help="training iterations per entry")
    p.add_argument("--log-interval", type=positive_int, default=5,
                   help="iterations per log line (the loop checks for a stop signal on all "
                        "ranks at each log line, a collective: keep it > 1)")
    p.add_argument("--warmup", type=nonneg_int, default=10, help="iterations not measured")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="run every entry this many times, interleaved; the table shows the "
                        "round with the median time (a shared machine's load drifts)")
    p.add_argument("--data", choices=("mock", "corpus"), default="mock",
                   help="mock: random tokens (--mock-data); corpus: the embedded corpus")
    p.add_argument("--clip-grad", type=nonneg_float, default=0.0, help=FAIRNESS_HELP)
    p.add_argument("--tie-embeddings", action="store_true",
                   help="share input and output embeddings (see --clip-grad)")
    p.add_argument("--keep-chained-optimizer", action="store_true", help=CHAINED_HELP)
    p.add_argument("--out", type=writable_dir, default=REPO / "runs" / "compare",
                   help="logs, PNG and JSON go here")
    p.add_argument("--png", type=output_file, default=None,
                   help="default: OUT/compare_MODEL.png")
    p.add_argument("--json", type=output_file, default=None,
                   help="also write the summaries here")
    p.add_argument("extra", nargs="*", help="after '--': more flags for every entry")
    return p


@main_guard
def main(argv: list[str] | None = None) -> int:
    """Compare the entries (or --from-logs); bad input ends it with one `error:` line, exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-worker"]:
        return _rank_worker(argv)
    return _compare(_parser().parse_args(argv))


def _summaries_from_logs(a: argparse.Namespace) -> list[Summary]:
    """One summary per --from-logs LABEL=PATH, ours or Megatron-LM's (the header from our
    line or its arguments block; n/a without either); a log that cannot be read or has too
    few iteration lines raises ToolError naming --from-logs and the file."""
    summaries = []
    for label, path in a.from_logs:
        with reading("--from-logs", path):
            log = parse_log(Path(path).read_text())
        if not log.iterations and log.header is None:
            raise ToolError("--from-logs", f"{path} has no training log line ('iteration N/M "
                                           "| ...', ours or Megatron-LM's)")
        h = log.header
        entry = Entry(label, h.schedule, h.tp, h.pp) if h else Entry(label, UNKNOWN, None, None)
        summaries.append(_summarize(entry, log, a.warmup, "--from-logs", path))
    return summaries


def _summarize(entry: Entry, log: ParsedLog, warmup: int, flag: str, path,
               nproc: int | None = None) -> Summary:
    """:func:`summarize`; a log with no line to measure raises ToolError naming ``flag``."""
    try:
        return summarize(entry, log, warmup, nproc)
    except ValueError as err:
        raise ToolError(flag, f"{path}: {err}") from None


def _reference(reference: str | None, entries: list) -> str | None:
    """``reference``, which must be one of the entries' labels, or by default the 2bw entry's
    label (None without one)."""
    labels = [e.label for e in entries]
    if reference is not None and reference not in labels:
        raise ToolError("--reference", f"{reference!r} is not an entry's label: {labels}")
    return reference or next((e.label for e in entries if e.schedule == "2bw"), None)


def _compare(a: argparse.Namespace) -> int:
    load_before = os.getloadavg()
    summaries: list[Summary] = []
    if a.from_logs:
        summaries = _summaries_from_logs(a)
        reference = _reference(a.reference, summaries)
        title = "from logs: " + ", ".join(s.label for s in summaries)
    else:
        entries = a.entry or list(DEFAULT_ENTRIES)
        reference = _reference(a.reference, entries)
        _check_entries(a, entries)
        print(f"compare: {a.model.upper()} {a.num_layers} layers, h={a.hidden_size}, "
              f"heads={a.num_attention_heads}, s={a.seq_length}, micro batch "
              f"{a.micro_batch_size}, global batch {a.global_batch_size}, {a.nproc} processes, "
              f"{a.iters} iterations ({a.warmup} warm-up), data {a.data}, clip-grad "
              f"{a.clip_grad}, embeddings {'tied' if a.tie_embeddings else 'untied'}",
              file=sys.stderr)
        rounds: dict[str, list[Summary]] = {e.label: [] for e in entries}
        for round_ in range(a.rounds):  # interleaved: a drifting load hits every entry alike
            if a.rounds > 1:
                print(f" round {round_ + 1} of {a.rounds}", file=sys.stderr)
            for entry in entries:
                suffix = f"_round{round_ + 1}" if a.rounds > 1 else ""
                log_path = a.out / f"{a.model}_{_slug(entry.label)}{suffix}.log"
                log = _run_entry(a, entry, log_path)
                rounds[entry.label].append(
                    _summarize(entry, log, a.warmup, "--warmup", log_path, a.nproc))
        summaries = [median_over_rounds(rounds[e.label]) for e in entries]
        title = (f"{a.model.upper()} L={a.num_layers} h={a.hidden_size} s={a.seq_length}, "
                 f"B={a.global_batch_size}, b={a.micro_batch_size}, {a.nproc} processes")
    for s in summaries:
        _add_schedule_memory(s)
    load_after = os.getloadavg()
    print(format_table(summaries, reference))
    if not a.from_logs and a.rounds > 1:
        print("ms/iter by round: " + "; ".join(
            f"{label} " + "/".join(f"{s.ms_per_iteration:.0f}" for s in runs)
            for label, runs in rounds.items()))
    if not a.from_logs:
        optimizer = ("ChainedOptimizer kept" if a.keep_chained_optimizer else
                     "inner optimizer stepped (no grad-norm all-reduce)")
        print(f"settings: --clip-grad {a.clip_grad}, "
              f"{'tied' if a.tie_embeddings else 'untied'} embeddings, {optimizer} for every "
              f"entry; load average before/after {load_before[0]:.2f}/{load_after[0]:.2f} on "
              f"{os.cpu_count()} CPUs")
    png = plot(summaries, a.png or a.out / f"compare_{a.model}.png", title)
    print(f"chart: {png}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps([asdict(s) for s in summaries], indent=1))
    return 0


if __name__ == "__main__":  # required: the checkpoint writer spawns a helper process
    sys.exit(main())
