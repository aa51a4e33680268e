"""Draw pipeline timelines (PNG in the style of the PipeDream-2BW paper's Figures 1-3, and Chrome
trace JSON for chrome://tracing or ui.perfetto.dev), simulated or recorded from a real run.

    python tools/timeline.py --simulate --schedule 2bw --depth 4 --microbatches 4 --batches 3 \
        --png runs/timeline/sim_2bw.png --chrome-trace runs/timeline/sim_2bw.json
    python tools/timeline.py run --nproc 4 --out runs/timeline/2bw_d4 --png OUT.png -- <flags>
    torchrun --nproc-per-node 4 tools/timeline.py record --out DIR -- <flags>   # on a cluster
    python tools/timeline.py --records DIR --png OUT.png

``run`` starts ``torchrun`` with ``record`` on every rank, which runs ``pretrain_gpt_2bw.py``'s
``main()`` with the executor's timeline on and writes ``OUT/rank{R}.jsonl`` (merged on the wall
clock: ``megatron_2bw.trace``), then draws; ``--batches A:B`` draws batches A..B-1 only.
Invariant: every schedule but ``megatron`` records. Why a real run wants --log-interval =
--train-iters, and the full example: docs/schedules.md, "Timelines of real runs".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megatron_2bw import trace  # noqa: E402
from megatron_2bw.cli import (ToolError, ToolParser, check_training_flags,  # noqa: E402
                              existing_dir, main_guard, nonneg_float, output_file, positive_float,
                              positive_int, reading, writable_dir)
from megatron_2bw.runtime.ports import free_port  # noqa: E402
from megatron_2bw.schedules import SCHEDULES  # noqa: E402


# --- drawing ------------------------------------------------------------------------------------

def _draw_parser() -> argparse.ArgumentParser:
    p = ToolParser(
        description="Draw a pipeline timeline (PNG, Chrome trace) from a simulation or from "
                    "the records of a real run. Subcommands: 'record' (under torchrun) and "
                    "'run' (torchrun + draw); see the module docstring.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--simulate", action="store_true", help="simulate a schedule")
    source.add_argument("--records", metavar="DIR", type=existing_dir,
                        help="per-rank *.jsonl files of a real run")
    p.add_argument("--schedule", default="2bw", choices=sorted(SCHEDULES),
                   help="the schedule to simulate (--simulate)")
    p.add_argument("--depth", type=positive_int, default=4, help="pipeline stages d (--simulate)")
    p.add_argument("--microbatches", type=positive_int, default=4,
                   help="microbatches per batch m")
    p.add_argument("--batches", default="3", metavar="N | A:B",
                   help="--simulate: number of batches N; --records: draw batches A..B-1")
    p.add_argument("--forward", type=positive_float, default=1.0,
                   help="forward time (--simulate)")
    p.add_argument("--backward", type=positive_float, default=2.0,
                   help="backward time (--simulate)")
    p.add_argument("--weight-grad", type=positive_float, default=None,
                   help="the weight-gradient part of --backward, for split backwards (zb-h1; "
                        "--simulate; default: half of it)")
    p.add_argument("--p2p", type=nonneg_float, default=0.0,
                   help="transfer latency (--simulate)")
    _add_outputs(p)
    return p


def _add_outputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--png", type=output_file, help="write the timeline picture here")
    p.add_argument("--chrome-trace", type=output_file, help="write Chrome trace JSON here")
    p.add_argument("--title", help="picture title (default: what was drawn)")


def _require_outputs(args: argparse.Namespace) -> None:
    """At least one of --png and --chrome-trace, checked before any work."""
    if not args.png and not args.chrome_trace:
        raise ToolError("--png", "nothing to write: give --png and/or --chrome-trace")


def _batch_count(text: str) -> int:
    """--batches N of a simulation: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise ToolError("--batches", f"--simulate needs a number of batches >= 1, got {text!r}")
    return int(text)


def _batch_window(text: str | None) -> tuple[int, int] | None:
    """--batches A:B of recorded runs (A defaults to 0, B to the end): 0 <= A < B."""
    if not text:
        return None
    first, sep, last = text.partition(":")
    try:
        window = int(first or 0), int(last) if last else 1 << 62
    except ValueError:
        window = None
    if not sep or window is None or not 0 <= window[0] < window[1]:
        raise ToolError("--batches", f"expected A:B with integers 0 <= A < B, got {text!r}")
    return window


def _select_batches(records, microbatches: int, window: tuple[int, int] | None):
    """Records of batches window[0]..window[1]-1 (a step belongs to the batch it applies)."""
    if window is None:
        return records

    def batch(r):
        return r.version - 1 if r.kind == "S" else r.microbatch // microbatches

    chosen = [r for r in records if window[0] <= batch(r) < window[1]]
    if not chosen:
        recorded = max(batch(r) for r in records) + 1
        raise ToolError("--batches", f"no records in batches {window[0]}:{window[1]} (the "
                                     f"records hold batches 0:{recorded})")
    return chosen


def _write(records, png: str | None, chrome: str | None, title: str, real: bool) -> None:
    for path in (png, chrome):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if chrome:
        trace.to_chrome_trace(records, chrome, time_scale=1e6 if real else 1e3)
        print(f"wrote {chrome}" + ("" if real else " (1 time unit = 1 ms)"))
    if png:
        trace.to_png(records, png, title, time_scale=1e3 if real else 1.0,
                     time_label="time (ms)" if real else "time (forward = 1)")
        print(f"wrote {png}")


def _print_summary(records, real: bool) -> None:
    scale, unit = (1e3, "ms") if real else (1.0, "")
    for stage, s in trace.stage_summary(records).items():
        busy = s["busy"]
        split = "".join(f"{k} {busy[k] * scale:.1f}{unit}  " for k in "IW" if busy[k])
        print(f"stage {stage}: F {busy['F'] * scale:.1f}{unit}  B {busy['B'] * scale:.1f}{unit}  "
              f"{split}S {busy['S'] * scale:.1f}{unit}  idle {s['idle'] * scale:.1f}{unit} of "
              f"{s['span'] * scale:.1f}{unit}  (longest gap {s['longest_gap'] * scale:.1f}{unit})")


def _load_run(folder: str) -> tuple[list, str, list[dict]]:
    """(merged records, how they were aligned, per-rank headers) of a folder of *.jsonl
    record files; a folder without them or an unreadable file raises ToolError (--records)."""
    paths = sorted(Path(folder).glob("*.jsonl"))
    if not paths:
        raise ToolError("--records", f"{folder} holds no *.jsonl record files")
    headers = []
    for path in paths:
        with reading("--records", path):
            headers.append(trace.load_records(path)[0])
    with reading("--records", folder):
        records, how = trace.merge_records(paths)
    return records, how, headers


def _simulate(args: argparse.Namespace) -> int:
    """Simulate --schedule and draw it."""
    from megatron_2bw.schedules import Costs, pipeline_actions, placement_of, simulate

    batches = _batch_count(args.batches)
    try:
        actions = pipeline_actions(args.schedule, args.depth, args.microbatches, batches)
    except ValueError as err:  # e.g. 2bw with fewer microbatches than stages
        raise ToolError("--microbatches", str(err)) from None
    if args.weight_grad is not None and args.weight_grad >= args.backward:
        raise ToolError("--weight-grad", f"{args.weight_grad:g} must be less than --backward "
                                         f"{args.backward:g}, of which it is a part")
    result = simulate(actions, Costs(args.forward, args.backward, p2p=args.p2p,
                                     weight_grad=args.weight_grad),
                      placement=placement_of(args.schedule, args.depth))
    records = trace.records_from_simulation(result)
    title = args.title or (f"{args.schedule}: d={args.depth}, m={args.microbatches}, "
                           f"{batches} batches (simulated; bubble {result.bubble:.0%})")
    _print_summary(records, real=False)
    _write(records, args.png, args.chrome_trace, title, real=False)
    return 0


def draw(argv: list[str]) -> int:
    """Draw a simulated schedule (--simulate) or a real run's records (--records)."""
    args = _draw_parser().parse_args(argv)
    _require_outputs(args)
    if args.simulate:
        return _simulate(args)
    window = _batch_window(args.batches) if ":" in (args.batches or "") else None
    records, how, headers = _load_run(args.records)
    microbatches = next((h["microbatches"] for h in headers if "microbatches" in h),
                        args.microbatches)
    schedule = next((h["schedule"] for h in headers if "schedule" in h), "?")
    records = _select_batches(records, microbatches, window)
    depth = 1 + max(r.stage for r in records)
    shown = f", batches {window[0]}:{window[1]}" if window else ""
    title = args.title or (f"{schedule}: d={depth}, m={microbatches}{shown} "
                           f"(recorded, {len(headers)} ranks, aligned by {how})")
    _print_summary(records, real=True)
    _write(records, args.png, args.chrome_trace, title, real=True)
    return 0


# --- recording a real run -----------------------------------------------------------------------

def _parse_with_flags(parser: argparse.ArgumentParser,
                      argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(this tool's parsed flags, the training flags after '--'); this tool's flags are
    parsed first (so --help works), then a missing '--' is refused."""
    i = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:i])
    if i == len(argv):
        raise ToolError("--", "put the training flags after '--'")
    return args, argv[i + 1:]


def record(argv: list[str]) -> int:
    """One rank (under torchrun): train with pretrain_gpt_2bw.py's main(), the executor's
    timeline on, and write OUT/rank{R}.jsonl at the end, also when training fails."""
    p = ToolParser(prog="timeline.py record")
    p.add_argument("--out", type=writable_dir, required=True,
                   help="directory for rank{R}.jsonl")
    args, flags = _parse_with_flags(p, argv)
    rank = int(os.environ.get("RANK", "0"))
    Path(args.out).mkdir(parents=True, exist_ok=True)

    from megatron_2bw.arguments import parse_args
    from megatron_2bw.schedules import executor

    header = {}
    try:
        parsed = parse_args(flags)
        header = {"schedule": parsed.pipeline_schedule, "microbatches": parsed.num_microbatches}
    except Exception:  # pretrain_gpt_2bw reports bad flags itself
        pass
    runners = []
    original = executor.forward_backward_func_for

    def recording(schedule: str):
        runner = original(schedule)
        if runner.timeline is None:
            runner.timeline = []
            runners.append(runner)
        return runner

    executor.forward_backward_func_for = recording  # patch.py looks it up at every call
    import pretrain_gpt_2bw

    try:
        pretrain_gpt_2bw.main(flags)
    finally:
        records = [r for runner in runners for r in runner.timeline]
        if records:
            path = Path(args.out) / f"rank{rank}.jsonl"
            trace.save_records(records, path, rank=rank, extra=header)
            print(f"rank {rank}: wrote {len(records)} timeline records to {path}", flush=True)
        elif header.get("schedule") == "megatron":
            print("note: --pipeline-schedule megatron (Megatron's own 1F1B) records no timeline",
                  file=sys.stderr, flush=True)
    return 0


def run(argv: list[str]) -> int:
    """torchrun --nproc-per-node N this-file record ..., then draw the records."""
    p = ToolParser(prog="timeline.py run")
    p.add_argument("--nproc", type=positive_int, required=True,
                   help="processes (ranks) to start")
    p.add_argument("--out", type=writable_dir, required=True,
                   help="directory for the per-rank records")
    p.add_argument("--batches", default=None, metavar="A:B", help="draw batches A..B-1 only")
    _add_outputs(p)
    args, flags = _parse_with_flags(p, argv)
    _batch_window(args.batches)
    has_data = "--data-path" in flags or "--mock-data" in flags
    check_training_flags(flags if has_data else [*flags, "--mock-data"], args.nproc,
                         f"the training flags after '--' on --nproc {args.nproc}")
    if not has_data:
        from megatron_2bw.data.default import prepare_default_data

        data = prepare_default_data()
        flags = ["--data-path", data.data_prefix, "--tokenizer-model", data.tokenizer_model,
                 *flags]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("rank*.jsonl"):
        stale.unlink()
    command = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node",
               str(args.nproc), "--master-port", str(free_port()), str(Path(__file__).resolve()),
               "record", "--out", str(out), "--", *flags]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print("running:", " ".join(command), flush=True)
    started = time.perf_counter()
    code = subprocess.call(command, env=env)
    print(f"training finished with exit code {code} after {time.perf_counter() - started:.0f} s")
    if code != 0 or not any(out.glob("*.jsonl")):
        return code or 1
    draw_args = ["--records", str(out)]
    for flag, value in (("--png", args.png), ("--chrome-trace", args.chrome_trace),
                        ("--title", args.title), ("--batches", args.batches)):
        if value:
            draw_args += [flag, str(value)]
    if args.png or args.chrome_trace:
        return draw(draw_args)
    return 0


@main_guard
def main(argv: list[str] | None = None) -> int:
    """Dispatch to record, run or draw; bad input ends it with one `error:` line, exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "record":
        return record(argv[1:])
    if argv and argv[0] == "run":
        return run(argv[1:])
    return draw(argv)


if __name__ == "__main__":
    sys.exit(main())
