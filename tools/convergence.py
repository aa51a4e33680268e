"""Does 2BW's 1-stale weight update train as well as a flushing schedule? (PipeDream-2BW,
Section 5.1 and Figure 5.)

    python tools/convergence.py                   # small GPT, 2 CPU processes, ~10-20 min
    python tools/convergence.py --model bert      # the same for BERT (masked-LM loss)
    python tools/convergence.py --plot-only       # redraw from the logs of an earlier run

Trains the same model under each schedule (by default 2bw and flush) on PP=2 over 2 CPU
processes, from the same initialization on the same data; plots training and validation loss,
prints the final gap and the iterations the reference (--reference, flush) needs to reach each
run's validation loss at a quarter, half, three quarters and the end of its run. Invariant: it
warns when a run covers more than one epoch of the corpus's training split (--corpus-chars
takes a larger one). Logs, PNG and JSON summary go to --out. The study and how to reproduce
it: docs/convergence.md ("The tool", "Reproducing").
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parent.parent
TOOLS = Path(__file__).resolve().parent
for _path in (str(REPO), str(TOOLS)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from compare import (raise_failed_run, run_logged, save_figure, torchrun,  # noqa: E402
                     training_parser)
from megatron_2bw.arguments import SCHEDULES  # noqa: E402
from megatron_2bw.data.corpus import DEFAULT_MAX_CHARS  # noqa: E402
from megatron_2bw.cli import (T2_SCHEDULE, RunName, ToolError, ToolParser,  # noqa: E402
                              add_model_size_flags, check_training_flags, comma_list,
                              main_guard, nonneg_float, nonneg_int, positive_float,
                              positive_int, reading, run_name, writable_dir)
from megatron_2bw.logparse import ParsedLog, parse_log  # noqa: E402

SPLIT = "949,50,1"

__all__ = ["MODEL_FLAGS", "PAPER_ITERATION_RATIO", "Match", "final_losses", "relative_gap",
           "iterations_to_reach", "ms_per_iteration", "checkpoints", "match_losses",
           "validation_curve", "format_matches", "epochs_covered", "train_split_tokens", "plot",
           "main"]

MODEL_FLAGS = [
    "--lr-decay-style", "cosine", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
    "--split", SPLIT,
]
"""The flags every run shares beyond the model size and learning rate (the tool's flags, by
default a small model that learns visibly in a few hundred iterations on 2 CPU cores: 4 layers,
h 128, s 128, batch 16, lr 3e-4). The learning rate matters to the comparison: at --lr 1e-3
this model trains faster with flush, but 2bw's 1-stale update falls 13% behind in validation
loss at 300 iterations (a plain-PyTorch delayed Adam on a similar model shows the same gap); at
3e-4 the gap is about 2%."""


def final_losses(log: ParsedLog) -> dict[str, float | None]:
    """The last logged training loss (the mean over its log interval) and the last validation
    loss."""
    valid = log.valid()
    return {"train": log.iterations[-1].loss if log.iterations else None,
            "valid": valid[-1].loss if valid else None,
            "iteration": log.iterations[-1].iteration if log.iterations else None}


def relative_gap(value: float, reference: float) -> float:
    """(value - reference) / reference."""
    return (value - reference) / reference


# ---- iterations to match and time to loss ------------------------------------------------------

PAPER_ITERATION_RATIO = 0.8
"""PipeDream-2BW, Section 5.1: GPT's test perplexity of 2BW and vanilla "match exactly when
Vanilla is run for 20% fewer iterations": the reference needs 0.8 of 2BW's iterations."""

MATCH_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
"""Where along a run its loss is matched: the first validation at or after these fractions of
its last validated iteration."""


def iterations_to_reach(curve: Sequence[tuple[float, float]], loss: float) -> float | None:
    """The first iteration at which the reference's validation curve comes down to `loss`.

    `curve` holds (iteration, loss) points in iteration order, joined by straight lines: the
    answer is the iteration of the first point at or below `loss` when it is the curve's first
    point, else the linear interpolation inside the first segment that crosses `loss` from above
    (a curve that rises and falls again counts its first descent); None when no point reaches it.
    """
    for k, (iteration, value) in enumerate(curve):
        if value <= loss:
            if k == 0:
                return float(iteration)
            before, above = curve[k - 1]
            return before + (above - loss) / (above - value) * (iteration - before)
    return None


def ms_per_iteration(log: ParsedLog) -> float:
    """A run's time per iteration: the median of its logged intervals, without the first (start
    up) and the last (the end-of-training drain) where it has more than two; the median keeps
    an interval slowed by an evaluation or by another process on the machine out."""
    records = log.iterations[1:-1] if len(log.iterations) > 2 else log.iterations
    return statistics.median(r.ms_per_iteration for r in records)


@dataclass(frozen=True)
class Match:
    """What the reference schedule needs to reach `schedule`'s validation loss at `iteration`."""

    schedule: str
    iteration: int
    loss: float
    seconds: float
    """`schedule`'s time to `iteration`: iteration x its ms/iteration."""
    reference_iterations: float | None
    """Iterations the reference needs for `loss` (interpolated); None: not within its run."""
    reference_seconds: float | None
    reference_bound: bool = False
    """True when the reference's first validation is already below `loss`: it needs at most
    `reference_iterations`."""

    @property
    def iteration_ratio(self) -> float | None:
        """reference iterations / these: the paper's 0.8 means the reference needs 20% fewer."""
        if self.reference_iterations is None:
            return None
        return self.reference_iterations / self.iteration

    @property
    def time_ratio(self) -> float | None:
        """reference time / this schedule's time to the same loss: above 1, `schedule` gets
        there first."""
        if self.reference_seconds is None or math.isnan(self.reference_seconds + self.seconds):
            return None  # not reached, or a time not measured
        return self.reference_seconds / self.seconds


def checkpoints(iterations: Sequence[int], fractions: Sequence[float] = MATCH_FRACTIONS
                ) -> list[int]:
    """For each fraction f, the first of `iterations` (sorted) at or after f x the last one."""
    chosen = [next(i for i in iterations if i >= f * iterations[-1]) for f in fractions]
    return list(dict.fromkeys(chosen))


def match_losses(name: str, curve: Sequence[tuple[int, float]], ms: float,
                 reference: Sequence[tuple[int, float]], reference_ms: float,
                 fractions: Sequence[float] = MATCH_FRACTIONS) -> list[Match]:
    """One Match per checkpoint of `curve` (a schedule's validation (iteration, loss) points,
    `ms` its time per iteration) against the `reference` curve (`reference_ms` per iteration)."""
    losses = dict(curve)
    matches = []
    for iteration in checkpoints([i for i, _ in curve], fractions):
        needed = iterations_to_reach(reference, losses[iteration])
        matches.append(Match(name, iteration, losses[iteration], iteration * ms / 1e3, needed,
                             None if needed is None else needed * reference_ms / 1e3,
                             reference[0][1] < losses[iteration]))
    return matches


def validation_curve(log: ParsedLog) -> list[tuple[int, float]]:
    """(iteration, validation loss) points of a run, in iteration order."""
    return sorted((v.iteration, v.loss) for v in log.valid())


def format_matches(matches: Sequence[Match], reference: str, ms: dict[str, float]) -> str:
    """The iterations-to-match and time-to-loss table."""
    lines = [f"iterations and time {reference} needs to reach each schedule's validation loss "
             f"(paper, Section 5.1: {PAPER_ITERATION_RATIO:.0%} of 2BW's iterations)",
             f"{'schedule':<16} {'ms/it':>6} {'iteration':>9} {'valid loss':>10} {'time s':>7} "
             f"{reference + ' its':>11} {'ratio':>6} {reference + ' s':>9} {'time ratio':>10}"]
    for m in matches:
        ref_its = ("not reached" if m.reference_iterations is None else
                   f"{'<=' if m.reference_bound else ''}{m.reference_iterations:.0f}")
        ratio = "-" if m.iteration_ratio is None else f"{m.iteration_ratio:.2f}"
        ref_s = ("-" if m.reference_seconds is None or math.isnan(m.reference_seconds) else
                 f"{m.reference_seconds:.0f}")
        time_ratio = "-" if m.time_ratio is None else f"{m.time_ratio:.2f}"
        run_ms = "-" if math.isnan(ms[m.schedule]) else f"{ms[m.schedule]:.0f}"
        seconds = "-" if math.isnan(m.seconds) else f"{m.seconds:.0f}"
        lines.append(f"{m.schedule:<16} {run_ms:>6} {m.iteration:>9} {m.loss:>10.4f} "
                     f"{seconds:>7} {ref_its:>11} {ratio:>6} {ref_s:>9} {time_ratio:>10}")
    lines.append(f"ratio: {reference}'s iterations / the schedule's; time ratio: {reference}'s "
                 "time / the schedule's (above 1: the schedule reaches that loss first); each "
                 "time is iterations x the run's ms/iteration (its median logged one, or with "
                 "--speedup the reference's over the speed; -: no speed given); <=: reached by "
                 f"{reference}'s first validation")
    return "\n".join(lines)


# ---- epochs --------------------------------------------------------------------------------------

def epochs_covered(iterations: int, global_batch_size: int, seq_length: int,
                   train_tokens: int) -> float:
    """Passes over the training split: iterations x global batch x sequence length tokens read
    (as megatron-core's GPTDataset counts them) over the split's tokens."""
    return iterations * global_batch_size * seq_length / train_tokens


def train_split_tokens(data_prefix: str, split: str) -> int:
    """Tokens in the training split of the indexed dataset at `data_prefix`, its documents cut
    by `split` as megatron-core's builder cuts them."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron_2bw.data.gpt import split_document_ranges

    dataset = IndexedDataset(data_prefix)  # alive while its memory-mapped lengths are read
    lengths = numpy.array(dataset.sequence_lengths, dtype=numpy.int64)
    begin, end = split_document_ranges(split, len(lengths))[0]
    return int(lengths[begin:end].sum())


_STYLES = {"2bw": dict(color="C3", label="2BW (PipeDream-2BW)"),
           "flush": dict(color="C0", linestyle="--", label="vanilla (PipeDream-Flush)"),
           "pipedream": dict(color="C2", label="PipeDream (weight stashing)"),
           "pipemare": dict(color="C4", label="PipeMare"),
           T2_SCHEDULE: dict(color="C6", label="PipeMare + T2"),
           # the synchronous schedules give flush's weights: their lines lie on flush's
           "zb-h1": dict(color="C1", linestyle=":", label="ZB-H1 (= flush)"),
           "gpipe": dict(color="C5", linestyle="-.", label="GPipe (= flush)"),
           "megatron": dict(color="C7", linestyle=":", label="Megatron 1F1B (= flush)"),
           "naive": dict(color="C8", linestyle="--", label="naive (= flush)")}


def plot(logs: dict[str, ParsedLog], path: Path, title: str,
         matches: Sequence[Match] = (), reference: str = "flush") -> Path:
    """Training and validation loss against iteration, one line per schedule; with `matches`,
    below them the reference's iterations-to-match (as a fraction of the schedule's iterations,
    the paper's 0.8 drawn) and time-to-loss ratio (1: break-even) at each checkpoint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 2 if matches else 1
    fig, axes = plt.subplots(rows, 2, figsize=(10, 4 * rows), squeeze=False)
    train, valid = axes[0]
    for schedule, log in logs.items():
        style = _STYLES.get(schedule, dict(label=schedule))
        train.plot([r.iteration for r in log.iterations], [r.loss for r in log.iterations],
                   **style)
        v = log.valid()
        valid.plot([r.iteration for r in v], [r.loss for r in v], marker="o", markersize=3,
                   **style)
    train.set_title("training loss")
    valid.set_title("validation loss")
    valid.sharey(train)
    train.set_ylabel("lm loss")
    if matches:
        _plot_matches(axes[1], matches, reference)
    for ax in axes.flat:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, title, path)


def _plot_matches(axes, matches: Sequence[Match], reference: str) -> None:
    """Iteration ratio (left) and time ratio (right) per compared schedule at its checkpoints."""
    iterations, times = axes
    for schedule in dict.fromkeys(m.schedule for m in matches):
        mine = [m for m in matches if m.schedule == schedule and m.iteration_ratio is not None]
        style = {**_STYLES.get(schedule, dict(label=schedule)), "marker": "o"}
        iterations.plot([m.iteration for m in mine], [m.iteration_ratio for m in mine], **style)
        times.plot([m.iteration for m in mine], [m.time_ratio for m in mine], **style)
    iterations.axhline(PAPER_ITERATION_RATIO, color="k", linestyle=":",
                       label="paper: vanilla needs 20% fewer (Sec. 5.1)")
    iterations.axhline(1.0, color="gray", linewidth=0.8)
    times.axhline(1.0, color="k", linestyle=":", label="break-even")
    iterations.set_title(f"{reference}'s iterations to the same validation loss", fontsize=10)
    iterations.set_ylabel(f"{reference} iterations / schedule's")
    times.set_title(f"{reference}'s time to the same validation loss", fontsize=10)
    times.set_ylabel(f"{reference} time / schedule's (> 1: schedule faster)")


def _data(a: argparse.Namespace):
    """The embedded corpus of --corpus-chars characters, built once (DefaultData)."""
    warnings.filterwarnings("ignore", message=".*Apex (is|are) not installed.*")
    from megatron_2bw.data.default import prepare_default_data

    return prepare_default_data(max_chars=a.corpus_chars, split_sentences=a.model == "bert")


def _command(a: argparse.Namespace, schedule: str, data) -> list[str]:
    script = REPO / f"pretrain_{a.model}_2bw.py"
    return [*torchrun(2), str(script), "--data-path", data.data_prefix,
            "--tokenizer-model", data.tokenizer_model, *_training_flags(a, schedule)]


def _size_flags(a: argparse.Namespace) -> list[str]:
    """The model size, batch and learning rate (min-lr a tenth of it) from the tool's flags."""
    return ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
            "--num-attention-heads", str(a.num_attention_heads),
            "--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length),
            "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch-size", str(a.global_batch_size),
            "--lr", f"{a.lr:g}", "--min-lr", f"{a.lr / 10:g}"]


def _schedule_flags(a: argparse.Namespace, run: str) -> list[str]:
    """--pipeline-schedule, --stale-weight-correction and --optimizer of the run named `run`;
    pipemare-t2 is pipemare with T2 on."""
    coefficients = {rule: getattr(a, f"{rule}_coeff", None) for rule in ("predict", "dc", "ef")}
    return RunName.parse(run).flags(a.t2_decay, coefficients)


def _training_flags(a: argparse.Namespace, schedule: str) -> list[str]:
    """Every flag of the run named `schedule` but its data flags."""
    real = RunName.parse(schedule).real_schedule
    return [*_size_flags(a), *MODEL_FLAGS, *_schedule_flags(a, schedule),
            "--pipeline-model-parallel-size", "2",
            "--train-iters", str(a.iters), "--lr-warmup-iters", str(a.iters // 10),
            "--seed", str(a.seed),
            "--log-interval", str(a.log_interval), "--eval-interval", str(a.eval_interval),
            "--eval-iters", str(a.eval_iters), *_extra_for(a.extra, real)]


def _extra_for(extra: list[str], schedule: str) -> list[str]:
    """The flags after '--' that apply to `schedule`: the --pipemare-* ones (each with its
    value) only to pipemare's run."""
    kept, skip = [], False
    for word in extra:
        if skip:
            skip = False
        elif word.startswith("--pipemare-") and schedule != "pipemare":
            skip = "=" not in word
        else:
            kept.append(word)
    return kept


def _parser() -> argparse.ArgumentParser:
    p = ToolParser(description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt", "bert"), default="gpt")
    p.add_argument("--schedules", type=comma_list(run_name), default=("2bw", "flush"),
                   help="runs, each SCHEDULE[-CORRECTION][+OPTIMIZER] (2bw-ef+muon: 2bw with "
                        "--stale-weight-correction ef and --optimizer muon); the first is "
                        "compared against the second (default: 2bw,flush); "
                        f"{T2_SCHEDULE}: pipemare with its discrepancy correction T2")
    for rule, what in (("predict", "s"), ("dc", "lambda"), ("ef", "beta")):
        p.add_argument(f"--{rule}-coeff", type=positive_float, default=None,
                       help=f"2bw-{rule} runs: --stale-weight-correction-coeff ({what})")
    p.add_argument("--speedup", action="append", default=[], type=_speedup, metavar="RUN=S",
                   help="RUN's per-iteration speed over the reference run (--reference, with "
                        "Adam) measured apart (tools/bench_schedules.py, on an idle machine): "
                        "time ratios then use these speeds, not the logged ms")
    p.add_argument("--markdown", action="store_true",
                   help="also print one markdown row per run: final validation loss and the "
                        "ratios at the end of its run")
    add_model_size_flags(p, num_layers=4, micro_batch_size=4, hidden_size=128)
    p.add_argument("--global-batch-size", type=positive_int, default=16)
    p.add_argument("--lr", type=positive_float, default=3e-4,
                   help="peak learning rate (cosine decay to a tenth of it)")
    p.add_argument("--t2-decay", type=positive_float, default=0.9,
                   help=f"{T2_SCHEDULE}: --pipemare-discrepancy-decay (default 0.9)")
    p.add_argument("--corpus-chars", type=positive_int, default=DEFAULT_MAX_CHARS,
                   help="size of the embedded corpus in characters (default: the default "
                        f"corpus, {DEFAULT_MAX_CHARS}); larger sizes add the installed packages' sources "
                        "so that a long run sees every token once")
    p.add_argument("--iters", type=positive_int, default=300,
                   help="training iterations; the first tenth warm the learning rate up")
    p.add_argument("--seed", type=nonneg_int, default=1234)
    p.add_argument("--log-interval", type=positive_int, default=10)
    p.add_argument("--eval-interval", type=positive_int, default=50)
    p.add_argument("--eval-iters", type=positive_int, default=20,
                   help="validation batches per evaluation (the same batches every time)")
    p.add_argument("--reference", choices=(*SCHEDULES, T2_SCHEDULE), default="flush",
                   help="the schedule whose validation curve the others' losses are matched on "
                        "(iterations to match, time to loss; default flush)")
    p.add_argument("--out", type=writable_dir, default=None,
                   help="default: runs/convergence/MODEL")
    p.add_argument("--plot-only", action="store_true",
                   help="no training: read OUT/SCHEDULE.log of an earlier run")
    p.add_argument("--target", type=nonneg_float, default=0.02,
                   help="exit code 1 when the relative validation gap exceeds this")
    p.add_argument("extra", nargs="*", help="after '--': more flags for both runs")
    return p


def _speedup(text: str) -> tuple[str, float]:
    """RUN=S of --speedup."""
    run, _, value = text.partition("=")
    try:
        return run_name(run), positive_float(value)
    except (ValueError, argparse.ArgumentTypeError) as error:
        raise argparse.ArgumentTypeError(f"expected RUN=SPEEDUP, got {text!r} ({error})")


def read_log(path: Path, plot_only: bool) -> ParsedLog:
    """The parsed training log at ``path``; one that is missing, unreadable or holds no
    iteration line raises ToolError naming the file (and --plot-only, which asked for it)."""
    what = "--plot-only" if plot_only else str(path)
    if plot_only and not path.is_file():
        raise ToolError(what, f"no log {path} of an earlier run (run without --plot-only, "
                              "or give its --out)")
    with reading(what, path):
        log = parse_log(path.read_text())
    if not log.iterations:
        held = f"{path} holds" if plot_only else "holds"
        raise ToolError(what, f"{held} no training iteration line")
    return log


def _matches(logs: dict[str, ParsedLog], ms: dict[str, float], reference: str,
             against: str | None = None) -> list[Match]:
    """Every other run's checkpoints matched on the validation curve of the reference with
    its optimizer, or of the run ``against`` (none without it or a validation)."""
    curves = {s: validation_curve(log) for s, log in logs.items()}
    matches = []
    for s, curve in curves.items():
        mine = against or RunName.parse(s).reference(reference)
        if s != mine and curve and curves.get(mine):
            matches += match_losses(s, curve, ms[s], curves[mine], ms[mine])
    return matches


def best_reference(logs: dict[str, ParsedLog], reference: str) -> str | None:
    """The run of the reference schedule (any optimizer) whose validation ends lowest."""
    ends = {s: validation_curve(log)[-1][1] for s, log in logs.items()
            if RunName.parse(s).schedule == reference and validation_curve(log)}
    return min(ends, key=ends.get) if ends else None


def _with_speedups(ms: dict[str, float], speedups: dict[str, float], reference: str
                   ) -> dict[str, float]:
    """ms/iteration where a run's speed over the reference run is given: the reference's
    logged ms over that speed (the reference's own is 1); with speeds given, a run without one
    gets NaN (no time ratio) rather than its logged ms, which would mix two measurements."""
    if not speedups:
        return dict(ms)
    if reference not in ms:
        raise ToolError("--speedup", f"speeds are over the {reference} run, which is not among "
                                     "--schedules")
    speeds = {reference: 1.0, **speedups}
    return {run: ms[reference] / speeds[run] if run in speeds else math.nan for run in ms}


def markdown_rows(finals: dict, matches: list[Match], best: list[Match]) -> list[str]:
    """| run | final validation loss | ratio, time ratio vs its optimizer's reference | the same
    vs the lowest-ending reference |, at the end of each run; "> 1" where the run ends below
    every validation loss the reference reached."""
    def last(found: list[Match], run: str) -> str:
        mine = [m for m in found if m.schedule == run]
        if not mine:  # the reference itself
            return "- | -"
        if mine[-1].iteration_ratio is None:  # ends below every loss the reference reached
            return "> 1 | -"
        m = mine[-1]
        bound = "<=" if m.reference_bound else ""
        time_ratio = "-" if m.time_ratio is None else f"{m.time_ratio:.2f}"
        return f"{bound}{m.iteration_ratio:.2f} | {time_ratio}"

    return [f"| {run} | {f['valid']:.3f} | {last(matches, run)} | {last(best, run)} |"
            for run, f in finals.items() if f["valid"] is not None]


def _report_epochs(a: argparse.Namespace, data_prefix: str) -> float:
    """Print how many passes over the training split a run makes (a warning past one) and
    return it."""
    tokens = train_split_tokens(data_prefix, SPLIT)
    epochs = epochs_covered(a.iters, a.global_batch_size, a.seq_length, tokens)
    print(f"each run reads {a.iters * a.global_batch_size * a.seq_length} tokens of the "
          f"training split's {tokens}: {epochs:.2f} epochs")
    if epochs > 1:
        print(f"warning: the runs repeat their data ({epochs:.2f} epochs); the losses compare "
              "schedules in an over-fitting regime: give a larger --corpus-chars",
              file=sys.stderr)
    return epochs


@main_guard
def main(argv: list[str] | None = None) -> int:
    """Train (or with --plot-only read) each schedule, compare, plot; exit code 1 when the
    gap misses --target, 2 on bad input (one `error:` line)."""
    a = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    out = a.out or REPO / "runs" / "convergence" / a.model
    schedules = list(dict.fromkeys(a.schedules))
    if not a.plot_only and a.iters < a.log_interval:
        raise ToolError("--iters", f"{a.iters} iterations log no line at --log-interval "
                                   f"{a.log_interval}: give --iters >= --log-interval")
    if not a.plot_only:  # every run's flags pass the training validator before any starts
        for schedule in schedules:
            check_training_flags([*_training_flags(a, schedule), "--mock-data"], 2,
                                 f"the {schedule} run", training_parser(a.model),
                                 {"--train-iters": "--iters"})
    logs, seconds = {}, {}
    data = None if a.plot_only else _data(a)
    for schedule in schedules:
        log_path = out / f"{schedule}.log"
        if not a.plot_only:
            started = time.perf_counter()
            code = run_logged(_command(a, schedule, data), log_path)
            seconds[schedule] = time.perf_counter() - started
            if code != 0:
                raise_failed_run(f"{schedule} failed (exit code {code})", log_path,
                                 log_path.read_text())
            print(f"  {schedule}: {seconds[schedule]:.0f} s", file=sys.stderr, flush=True)
        logs[schedule] = read_log(log_path, a.plot_only)

    finals = {s: final_losses(log) for s, log in logs.items()}
    print(f"{'schedule':<16} {'iteration':>9} {'train loss':>10} {'valid loss':>10} {'wall s':>7}")
    for s, f in finals.items():
        train = "-" if f["train"] is None else f"{f['train']:.4f}"
        valid = "-" if f["valid"] is None else f"{f['valid']:.4f}"
        wall = f"{seconds[s]:.0f}" if s in seconds else "-"
        print(f"{s:<16} {f['iteration'] or '-':>9} {train:>10} {valid:>10} {wall:>7}")
    result = {"model": a.model, "finals": finals, "seconds": seconds,
              "flags": _size_flags(a) + MODEL_FLAGS + a.extra}
    if data is not None:
        result["epochs"] = _report_epochs(a, data.data_prefix)
    ms = _with_speedups({s: ms_per_iteration(log) for s, log in logs.items()},
                        dict(a.speedup), a.reference)
    matches = _matches(logs, ms, a.reference)
    if matches:
        print(format_matches(matches, a.reference, ms))
    lowest = best_reference(logs, a.reference)
    several = len({RunName.parse(s).optimizer for s in logs}) > 1
    best = _matches(logs, ms, a.reference, against=lowest) if lowest and several else []
    if best:
        print(f"against the {a.reference} run that ends lowest, {lowest}:")
        print(format_matches(best, lowest, ms))
    if a.markdown:
        print("| run | valid loss | ratio | time ratio | ratio vs best | time ratio vs best |")
        print("\n".join(markdown_rows(finals, matches, best)))
    result.update(ms_per_iteration=ms, reference=a.reference, speedups=dict(a.speedup),
                  matches=[{**asdict(m), "iteration_ratio": m.iteration_ratio,
                            "time_ratio": m.time_ratio} for m in matches],
                  best_reference=lowest,
                  matches_best=[{**asdict(m), "iteration_ratio": m.iteration_ratio,
                                 "time_ratio": m.time_ratio} for m in best])
    status = 0
    if len(schedules) >= 2:
        first, second = schedules[0], schedules[1]
        f, g = finals[first], finals[second]
        if f["valid"] is not None and g["valid"] is not None:
            gap_valid = relative_gap(f["valid"], g["valid"])
            gap_train = relative_gap(f["train"], g["train"])
            result.update(gap_valid=gap_valid, gap_train=gap_train)
            verdict = "within" if abs(gap_valid) <= a.target else "NOT within"
            print(f"relative gap {first} vs {second}: validation {gap_valid:+.2%}, training "
                  f"{gap_train:+.2%} ({verdict} the {a.target:.0%} target)")
            status = 0 if abs(gap_valid) <= a.target else 1
    title = (f"{a.model.upper()} {a.num_layers} layers, h={a.hidden_size}, s={a.seq_length}, "
             f"batch {a.global_batch_size}, lr {a.lr:g}, PP=2 on 2 CPU processes, seed {a.seed}" + (f"; {' '.join(a.extra)}" if a.extra else ""))
    png = plot(logs, out / f"convergence_{a.model}.png", title, matches, a.reference)
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    print(f"plot: {png}")
    return status


if __name__ == "__main__":
    sys.exit(main())
