"""Every command-line tool under tools/ turns bad input into ONE line on stderr,
``error: <flag or file>: <what is wrong>``, with exit code 2: no traceback, no argparse usage
block (megatron_2bw/cli.py).

Each case runs the tool as its own process, as a user would. Most fail while parsing flags,
before torch or megatron-core is imported (~0.1 s each); the few that need the data pipeline
(a bad JSONL line, sentencepiece refusing a vocabulary) import megatron-core first. Children
run without the tests' strict NCCL mode (it imports torch at interpreter start; these runs
make no collective calls). Each tool also has a cheap valid twin (``--help`` and a few real
runs) that exits 0, so a tool that refuses everything fails here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "128"]
PLAN = [*MODEL, "--global-batch-size", "16", "--no-profile"]
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A folder of bad (and a few good) input files the cases name as ``{d}/...``."""
    d = tmp_path_factory.mktemp("tool_inputs")
    (d / "bad.json").write_text("{not json")
    (d / "list.json").write_text("[1, 2]")
    (d / "wrong_kind.json").write_text(json.dumps({"format": "megatron-2bw layer profile v1"}))
    (d / "empty.log").write_text("")
    (d / "junk.log").write_text("hello\nthis is no training log\n")
    (d / "binary.log").write_bytes(bytes(range(128, 256)))
    (d / "header_only.log").write_text(" training 2bw schedule on 2 cpu processes: TP=1 PP=2 "
                                       "DP=1, 8 microbatches per batch\n")
    (d / "empty.jsonl").write_text("")
    (d / "words.jsonl").write_text('{"text": "hello world, this is some text"}\n')
    (d / "ids.jsonl").write_text('{"text": "1 2 3"}\nnot json\n')
    (d / "nokey.jsonl").write_text('{"body": "x"}\n')
    (d / "no_records").mkdir()
    (d / "bad_records").mkdir()
    (d / "bad_records" / "rank0.jsonl").write_text('{"rank": 0}\n')
    (d / "garbled_records").mkdir()
    (d / "garbled_records" / "rank0.jsonl").write_text("{{{\n")
    (d / "old_run").mkdir()
    for schedule in ("2bw", "flush"):
        (d / "old_run" / f"{schedule}.log").write_text("no iterations here\n")
    return d


# id: (tool and its arguments, the flag or file the error line starts with, a fragment of it)
CASES = {
    # tools/plan.py (plan, profile, report)
    "plan-zero-nodes": (["plan.py", *PLAN, "--nodes", "0"], "--nodes", ">= 1"),
    "plan-memory-fraction": (["plan.py", *PLAN, "--memory-fraction", "1.5"],
                             "--memory-fraction", "(0, 1]"),
    "plan-nan-memory": (["plan.py", *PLAN, "--gpu-memory-gib", "nan"], "--gpu-memory-gib",
                        "finite"),
    "plan-missing-model-flags": (["plan.py", "--num-layers", "4"], "--hidden-size", "required"),
    "plan-heads-do-not-divide": (["plan.py", *PLAN, "--num-attention-heads", "3"],
                                 "--hidden-size", "not divisible"),
    "plan-unknown-cluster": (["plan.py", *PLAN, "--cluster", "moon"], "--cluster", "moon"),
    "plan-query-groups": (["plan.py", *PLAN, "--group-query-attention", "--num-query-groups",
                           "3"], "--num-query-groups", "do not split into 3 groups"),
    "plan-bad-schedule": (["plan.py", *PLAN, "--schedules", "2bw,1f1b"], "--schedules",
                          "1f1b"),
    "plan-micro-batches": (["plan.py", *PLAN, "--micro-batch-sizes", "1,0"],
                           "--micro-batch-sizes", ">= 1"),
    "plan-profile-missing": (["plan.py", *MODEL, "--global-batch-size", "16", "--profile",
                              "{d}/nope.json"], "--profile", "nope.json"),
    "plan-profile-not-json": (["plan.py", *MODEL, "--global-batch-size", "16", "--profile",
                               "{d}/bad.json"], "--profile", "not valid JSON"),
    "plan-profile-a-list": (["plan.py", *MODEL, "--global-batch-size", "16", "--profile",
                             "{d}/list.json"], "--profile", "list.json"),
    "plan-out-under-a-file": (["plan.py", *PLAN, "--out", "{d}/bad.json/plan"], "--out",
                              "bad.json"),
    "plan-unknown-flag": (["plan.py", *PLAN, "--nodez", "2"], "--nodez", "unknown flag"),
    "plan-profile-zero-repeats": (["plan.py", "profile", *MODEL, "--repeats", "0"], "--repeats",
                                  ">= 1"),
    "plan-profile-bad-layout": (["plan.py", "profile", *MODEL, "--end-to-end", "--layouts",
                                 "t1d2w1b3:2bw"], "--layouts", "not a multiple"),
    "plan-report-wrong-kind": (["plan.py", "report", "--measured", "{d}/wrong_kind.json",
                                "--profile", "{d}/wrong_kind.json"], "--measured",
                               "layer profile"),
    "plan-report-missing-flag": (["plan.py", "report", "--measured", "{d}/bad.json"],
                                 "--profile", "required"),
    # tools/preprocess_data.py
    "preprocess-missing-input": (["preprocess_data.py", "--input", "{d}/nope.jsonl",
                                  "--output-prefix", "{d}/out/x", *NULL_TOKENIZER], "--input",
                                 "nope.jsonl"),
    "preprocess-input-is-folder": (["preprocess_data.py", "--input", "{d}", "--output-prefix",
                                    "{d}/out/x", *NULL_TOKENIZER], "--input", "folder"),
    "preprocess-zero-workers": (["preprocess_data.py", "--input", "{d}/words.jsonl",
                                 "--output-prefix", "{d}/out/x", *NULL_TOKENIZER, "--workers",
                                 "0"], "--workers", ">= 1"),
    "preprocess-unwritable-output": (["preprocess_data.py", "--input", "{d}/words.jsonl",
                                      "--output-prefix", "{d}/words.jsonl/x",
                                      *NULL_TOKENIZER], "--output-prefix", "words.jsonl"),
    "preprocess-bad-json-line": (["preprocess_data.py", "--input", "{d}/ids.jsonl",
                                  "--output-prefix", "{d}/out/x", *NULL_TOKENIZER], "--input",
                                 "ids.jsonl:2 is not valid JSON"),
    # tools/train_tokenizer.py
    "tokenizer-missing-input": (["train_tokenizer.py", "--input", "{d}/nope.jsonl",
                                 "--model-prefix", "{d}/tok/t", "--vocab-size", "64"], "--input",
                                "nope.jsonl"),
    "tokenizer-zero-vocab": (["train_tokenizer.py", "--input", "{d}/words.jsonl",
                              "--model-prefix", "{d}/tok/t", "--vocab-size", "0"],
                             "--vocab-size", ">= 1"),
    "tokenizer-bad-model-type": (["train_tokenizer.py", "--input", "{d}/words.jsonl",
                                  "--model-prefix", "{d}/tok/t", "--vocab-size", "64",
                                  "--model-type", "wordpiece"], "--model-type", "wordpiece"),
    "tokenizer-unwritable-prefix": (["train_tokenizer.py", "--input", "{d}/words.jsonl",
                                     "--model-prefix", "/sys/tok/t", "--vocab-size", "64"],
                                    "--model-prefix", "/sys"),
    "tokenizer-vocab-too-large": (["train_tokenizer.py", "--input", "{d}/words.jsonl",
                                   "--model-prefix", "{d}/tok/t", "--vocab-size", "4096"],
                                  "--vocab-size", "sentencepiece"),
    # tools/compare.py
    "compare-missing-log": (["compare.py", "--from-logs", "a={d}/nope.log"], "--from-logs",
                            "nope.log"),
    "compare-log-without-label": (["compare.py", "--from-logs", "{d}/junk.log"], "--from-logs",
                                  "LABEL=PATH"),
    "compare-empty-log": (["compare.py", "--from-logs", "a={d}/empty.log"], "--from-logs",
                          "empty.log"),
    "compare-garbage-log": (["compare.py", "--from-logs", "a={d}/junk.log"], "--from-logs",
                            "junk.log"),
    "compare-binary-log": (["compare.py", "--from-logs", "a={d}/binary.log"], "--from-logs",
                           "binary.log"),
    "compare-log-without-iterations": (["compare.py", "--from-logs", "a={d}/header_only.log"],
                                       "--from-logs", "no log line after"),
    "compare-zero-nproc": (["compare.py", "--nproc", "0"], "--nproc", ">= 1"),
    "compare-bad-entry": (["compare.py", "--entry", "x:2bw:0:2"], "--entry", ">= 1"),
    "compare-layers-vs-stages": (["compare.py", "--num-layers", "3"], "--num-layers",
                                 "pipeline stages"),
    "compare-unknown-reference": (["compare.py", "--reference", "Nope"], "--reference", "Nope"),
    "compare-json-is-folder": (["compare.py", "--json", "{d}"], "--json", "folder"),
    # tools/convergence.py
    "convergence-no-earlier-logs": (["convergence.py", "--plot-only", "--out",
                                     "{d}/no_records"], "--plot-only", "2bw.log"),
    "convergence-logs-without-iterations": (["convergence.py", "--plot-only", "--out",
                                             "{d}/old_run"], "--plot-only", "no training"),
    "convergence-unknown-schedule": (["convergence.py", "--schedules", "2bw,1f1b"],
                                     "--schedules", "1f1b"),
    "convergence-zero-iters": (["convergence.py", "--iters", "0"], "--iters", ">= 1"),
    "convergence-iters-below-log-interval": (["convergence.py", "--iters", "2"], "--iters",
                                             "log no line at --log-interval 10"),
    "convergence-bad-training-flag": (["convergence.py", "--", "--lr", "-1"], "--lr",
                                      "the 2bw run"),
    "convergence-out-is-file": (["convergence.py", "--out", "{d}/bad.json"], "--out", "file"),
    # tools/timeline.py (draw, record, run)
    "timeline-no-output": (["timeline.py", "--simulate"], "--png", "--chrome-trace"),
    "timeline-zero-depth": (["timeline.py", "--simulate", "--png", "{d}/t.png", "--depth", "0"],
                            "--depth", ">= 1"),
    "timeline-unknown-schedule": (["timeline.py", "--simulate", "--png", "{d}/t.png",
                                   "--schedule", "1f1b"], "--schedule", "1f1b"),
    "timeline-2bw-too-few-microbatches": (["timeline.py", "--simulate", "--png", "{d}/t.png",
                                           "--microbatches", "2"], "--microbatches", "m=2"),
    "timeline-negative-forward": (["timeline.py", "--simulate", "--png", "{d}/t.png",
                                   "--forward", "-1"], "--forward", "(0, inf)"),
    "timeline-no-source": (["timeline.py", "--png", "{d}/t.png"], "--simulate", "--records"),
    "timeline-records-missing": (["timeline.py", "--records", "{d}/nope", "--png", "{d}/t.png"],
                                 "--records", "no such folder"),
    "timeline-records-empty": (["timeline.py", "--records", "{d}/no_records", "--png",
                                "{d}/t.png"], "--records", "no *.jsonl"),
    "timeline-records-no-header": (["timeline.py", "--records", "{d}/bad_records", "--png",
                                    "{d}/t.png"], "--records", "rank0.jsonl"),
    "timeline-records-not-json": (["timeline.py", "--records", "{d}/garbled_records", "--png",
                                   "{d}/t.png"], "--records", "not valid JSON"),
    "timeline-trace-under-a-file": (["timeline.py", "--simulate", "--chrome-trace",
                                     "{d}/bad.json/t.json"], "--chrome-trace", "bad.json"),
    "timeline-record-without-flags": (["timeline.py", "record", "--out", "{d}/rec"], "--",
                                      "after '--'"),
    "timeline-run-zero-nproc": (["timeline.py", "run", "--nproc", "0", "--out", "{d}/rec", "--"],
                                "--nproc", ">= 1"),
    "timeline-run-bad-window": (["timeline.py", "run", "--nproc", "2", "--out", "{d}/rec",
                                 "--batches", "5:2", "--"], "--batches", "'5:2'"),
    "timeline-run-unwritable-out": (["timeline.py", "run", "--nproc", "2", "--out", "/sys/rec",
                                     "--"], "--out", "cannot write"),
    # tools/bench_schedules.py
    "bench-zero-depth": (["bench_schedules.py", "--depth", "0"], "--depth", ">= 1"),
    "bench-unknown-schedule": (["bench_schedules.py", "--schedules", "2bw,foo"], "--schedules",
                               "foo"),
    "bench-empty-schedules": (["bench_schedules.py", "--schedules", ","], "--schedules", "list"),
    "bench-nice-out-of-range": (["bench_schedules.py", "--nice", "40"], "--nice", "-20..19"),
    "bench-dualpipev-below-2d-microbatches": (
        ["bench_schedules.py", "--depth", "4", "--schedules", "2bw,dualpipev"],
        "--microbatches", "m >= 2 x pipeline depth = 8"),
    "bench-timeline-dir-unwritable": (["bench_schedules.py", "--timeline-dir", "/sys/t"],
                                      "--timeline-dir", "cannot write"),
    "bench-json-is-folder": (["bench_schedules.py", "--json", "{d}"], "--json", "folder"),
    "bench-split-does-not-add-up": (
        ["bench_schedules.py", "--decoder-last-pipeline-num-layers", "9"],
        "--decoder-last-pipeline-num-layers", "leave -1"),
    "bench-unknown-split": (["bench_schedules.py", "--splits", "even,best"], "--splits", "best"),
}


def run_tool(argv: list[str], inputs: Path) -> subprocess.CompletedProcess:
    """``python tools/<argv[0]> argv[1:]`` from the repository root, ``{d}`` -> ``inputs``."""
    args = [a.replace("{d}", str(inputs)) for a in argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATRON_2BW_STRICT="0")
    return subprocess.run([sys.executable, str(REPO / "tools" / args[0]), *args[1:]],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv, what, fragment", CASES.values(), ids=CASES.keys())
def test_bad_input_ends_with_one_error_line_and_exit_code_2(argv, what, fragment, inputs):
    done = run_tool(argv, inputs)
    shown = f"exit code {done.returncode}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 2, shown
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], shown
    assert errors[0].startswith(f"error: {what}: "), shown
    assert fragment in errors[0], shown
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, shown
    assert not any(line.startswith("usage:") for line in done.stderr.splitlines()), shown


def test_cases_cover_every_tool_at_least_three_times():
    tools = [argv[0] for argv, _, _ in CASES.values()]
    for tool in ("plan.py", "preprocess_data.py", "train_tokenizer.py", "compare.py",
                 "convergence.py", "timeline.py", "bench_schedules.py"):
        assert tools.count(tool) >= 3, tool
    assert len(CASES) >= 30


GOOD = {
    "plan-help": ["plan.py", "--help"],
    "plan-profile-help": ["plan.py", "profile", "--help"],
    "plan-report-help": ["plan.py", "report", "--help"],
    "plan-closed-form": ["plan.py", *PLAN, "--closed-form", "--no-scripts", "--out",
                         "{d}/plan"],
    "preprocess-help": ["preprocess_data.py", "--help"],
    "tokenizer-help": ["train_tokenizer.py", "--help"],
    "compare-help": ["compare.py", "--help"],
    "convergence-help": ["convergence.py", "--help"],
    "timeline-help": ["timeline.py", "--help"],
    "timeline-record-help": ["timeline.py", "record", "--help"],
    "timeline-run-help": ["timeline.py", "run", "--help"],
    "timeline-simulate-chrome-trace": ["timeline.py", "--simulate", "--chrome-trace",
                                       "{d}/sim/t.json"],
    "bench-help": ["bench_schedules.py", "--help"],
}


@pytest.mark.parametrize("argv", GOOD.values(), ids=GOOD.keys())
def test_valid_twins_exit_0(argv, inputs):
    done = run_tool(argv, inputs)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "error:" not in done.stderr, done.stderr[-3000:]


def test_the_guard_keeps_a_bug_a_traceback():
    """Only user errors become one line: a Python bug keeps its traceback."""
    from megatron_2bw.cli import ToolError, main_guard

    @main_guard
    def buggy(argv=None):
        raise ZeroDivisionError("a bug")

    @main_guard
    def refuses(argv=None):
        raise ToolError("--flag", "bad value")

    with pytest.raises(ZeroDivisionError):
        buggy()
    with pytest.raises(SystemExit) as exit_info:
        refuses()
    assert exit_info.value.code == 2


def test_subparsers_are_tool_parsers_too(capsys):
    """A subcommand's flag error is one FlagError naming the flag, not argparse's usage exit."""
    from megatron_2bw.cli import FlagError, ToolParser, positive_int

    parser = ToolParser(prog="tool")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("draw").add_argument("--depth", type=positive_int)
    with pytest.raises(FlagError) as info:
        parser.parse_args(["draw", "--depth", "-3"])
    assert str(info.value) == "--depth: expected an integer >= 1, got '-3'"
    assert capsys.readouterr().err == ""
