#!/usr/bin/env python
"""A sweep of what a new user gets wrong: bad flags, bad data and tokenizer files, bad tool
inputs, and faults (a killed rank, SIGTERM/Ctrl-C, divergence, damaged checkpoints).

    python scripts/try_bad_inputs.py --jobs 2 --keep-going
    python scripts/try_bad_inputs.py --only tool- --keep-going
    python scripts/try_bad_inputs.py --list

Each case runs one command from the repository root in its own session, killed with it at the
case's timeout, every output pointed into a temporary folder; its output is classified as
OK_ONE_LINE, OK_EXPECTED, or a failure (TRACEBACK, HANG, SILENT, MULTI_LINE, NO_ERROR_LINE,
WRONG_MESSAGE, FAILED, SETUP_FAILED).
Invariants: nothing is written into the checkout; without --keep-going no new case starts after
the first one that is not OK_*; the exit code is 0 only when every case that ran is OK_*.
Each outcome's rule: docs/checkpoints_and_faults.md, "The sweep of bad inputs".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_2bw.runtime.ports import free_port  # noqa: E402

PY = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# ---- command building blocks ----------------------------------------------------------------

SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
         "--train-iters", "2", "--lr", "1e-3", "--cpu", "--eval-iters", "0"]
MOCK = [*SMALL, "--mock-data"]
DATA = [*SMALL, "--data-path", "{data}", "--tokenizer-model", "{tok}",
        "--data-cache-path", "{tmp}/index-cache"]
BERT_DATA = [*SMALL, "--data-path", "{bert_data}", "--tokenizer-type", "SentencePieceTokenizer",
             "--tokenizer-model", "{tok}", "--data-cache-path", "{tmp}/index-cache"]
# a 2-stage 2BW run over 2 processes, as tests/test_faults.py runs it
FAULT = ["--cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--lr", "1e-3",
         "--micro-batch-size", "4", "--global-batch-size", "16",
         "--mock-data", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
         "--log-interval", "1", "--eval-iters", "0", "--distributed-timeout-minutes", "1"]


def gpt(*flags: str) -> list[str]:
    return [PY, "pretrain_gpt_2bw.py", *flags]


def bert(*flags: str) -> list[str]:
    return [PY, "pretrain_bert_2bw.py", *flags]


def torchrun(script: str, *flags: str, nproc: int = 2) -> list[str]:
    return [TORCHRUN, "--nnodes", "1", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", "{port}", script, *flags]


def tool(name: str, *args: str) -> list[str]:
    return [PY, f"tools/{name}", *args]


PLAN = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--global-batch-size", "16", "--cluster", "dgx-a100",
        "--nodes", "1", "--no-profile", "--out", "{tmp}/plan", "--no-scripts"]
PLAN_PROFILE = ["profile", "--num-layers", "2", "--hidden-size", "32",
                "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "128",
                "--cpu", "--out", "{tmp}/profile.json", "--no-calibrate", "--no-links"]
CMP = ["--out", "{tmp}/cmp", "--iters", "2", "--rounds", "1", "--data", "mock"]
CONV = ["--out", "{tmp}/conv", "--iters", "2"]
BENCH = ["--iters", "1", "--warmup", "1", "--rounds", "1", "--json", "{tmp}/bench.json"]


# ---- fixtures shared by cases (built once, lazily, under a lock) ---------------------------

_DATA_BUILDER = r"""
import json, sys
from megatron_2bw.data.corpus import build_corpus
from megatron_2bw.data.preprocess import preprocess_jsonl
from megatron_2bw.data.tokenizer import train_sentencepiece
root = sys.argv[1]
corpus = f"{root}/corpus.jsonl"
assert build_corpus(corpus, max_chars=200_000) > 0
model = train_sentencepiece(corpus, f"{root}/tokenizer", 512)
gpt = preprocess_jsonl(corpus, f"{root}/gpt", "GPTSentencePieceTokenizer", model,
                       append_eod=True)["text"]
bert = preprocess_jsonl(corpus, f"{root}/bert", "SentencePieceTokenizer", model,
                        split_sentences=True)["text"]
small_corpus = f"{root}/small.jsonl"
with open(small_corpus, "w") as f:
    for i in range(40):
        f.write(json.dumps({"text": f"document {i}: def f(x): return x + {i}\n"}) + "\n")
small = preprocess_jsonl(small_corpus, f"{root}/small", "GPTSentencePieceTokenizer", model,
                         append_eod=True)["text"]
print(json.dumps({"data": gpt, "tok": model, "bert_data": bert, "small_data": small,
                  "corpus": corpus}))
"""


class Shared:
    """Fixtures: ``data`` (GPT/BERT indexed datasets, a 512-piece tokenizer, a 40-document
    dataset, the JSONL corpus) and ``ckpt`` (a single-process run saved at iterations 2 and 4)."""

    def __init__(self, root: Path):
        self.root = root
        self.vars: dict[str, str] = {}
        self._locks = {"data": threading.Lock(), "ckpt": threading.Lock()}
        self._built: dict[str, str | None] = {}  # name -> None (ok) or the failure text

    def need(self, name: str) -> None:
        with self._locks[name]:
            if name not in self._built:
                try:
                    getattr(self, f"_build_{name}")()
                    self._built[name] = None
                except Exception as error:  # noqa: BLE001 - reported as SETUP_FAILED
                    self._built[name] = f"fixture {name}: {error}"
            if self._built[name] is not None:
                raise RuntimeError(self._built[name])

    def _build_data(self) -> None:
        folder = self.root / "fixture-data"
        folder.mkdir()
        result = subprocess.run([PY, "-c", _DATA_BUILDER, str(folder)], cwd=REPO, env=base_env(),
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(result.stdout[-2000:] + result.stderr[-3000:])
        self.vars.update(json.loads(result.stdout.strip().splitlines()[-1]))

    def _build_ckpt(self) -> None:
        root = self.root / "fixture-ckpt"
        env = base_env(WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        result = subprocess.run(gpt(*MOCK, "--train-iters", "4",
                                    "--hidden-dropout", "0", "--attention-dropout", "0",
                                    "--save", str(root), "--save-interval", "2"),
                                cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        saved = sorted(p.name for p in root.glob("iter_*")) if root.is_dir() else []
        if result.returncode != 0 or saved != ["iter_0000002", "iter_0000004"]:
            raise RuntimeError(f"exit {result.returncode}, saved {saved}:\n"
                               + (result.stdout + result.stderr)[-3000:])
        self.vars["ckpt_master"] = str(root)


def base_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "MEGATRON_2BW_STRICT_DIR"):
        env.pop(name, None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["MEGATRON_2BW_STRICT"] = "0"
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *path])
    env.update(extra)
    return env


# ---- set-ups: each gets (tmp folder, shared fixtures) and returns more placeholders ---------

def blocker(tmp: Path, sh: Shared) -> dict:
    """``{tmp}/a-file``: a regular file, so anything below it cannot be created."""
    (tmp / "a-file").write_text("not a folder\n")
    return {}


def write(name: str, content: str | bytes) -> Callable:
    def setup(tmp: Path, sh: Shared) -> dict:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        return {}
    return setup


def mkdir(name: str) -> Callable:
    def setup(tmp: Path, sh: Shared) -> dict:
        (tmp / name).mkdir(parents=True, exist_ok=True)
        return {}
    return setup


def chain(*setups: Callable) -> Callable:
    def setup(tmp: Path, sh: Shared) -> dict:
        out: dict = {}
        for s in setups:
            out.update(s(tmp, sh) or {})
        return out
    return setup


def data_copy(damage: Callable[[str], None] | None = None, source: str = "data") -> Callable:
    """Copy a fixture dataset to ``{tmp}/copy_text_document`` (placeholder ``{p}``), then
    ``damage(prefix)``."""
    def setup(tmp: Path, sh: Shared) -> dict:
        prefix = str(tmp / "copy_text_document")
        for suffix in (".bin", ".idx"):
            shutil.copyfile(sh.vars[source] + suffix, prefix + suffix)
        if damage:
            damage(prefix)
        return {"p": prefix}
    return setup


def _truncate(path: str, keep: float) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def _garbage_idx(prefix: str) -> None:
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"this is no index file, it is garbage" * 4)


def _random_bin(prefix: str) -> None:
    size = os.path.getsize(prefix + ".bin")
    with open(prefix + ".bin", "wb") as f:
        f.write(random.Random(0).randbytes(size))


def _empty_files(prefix: str) -> None:
    for suffix in (".bin", ".idx"):
        open(prefix + suffix, "wb").close()


def copy_ckpt(damage: Callable[[Path], None] | None = None) -> Callable:
    """Copy the fixture checkpoints (iterations 2 and 4) to ``{tmp}/ckpt`` (``{ck}``)."""
    def setup(tmp: Path, sh: Shared) -> dict:
        root = tmp / "ckpt"
        shutil.copytree(sh.vars["ckpt_master"], root)
        if damage:
            damage(root)
        return {"ck": str(root)}
    return setup


def _empty_newest(root: Path) -> None:
    shutil.rmtree(root / "iter_0000004")
    (root / "iter_0000004").mkdir()


def _only_empty(root: Path) -> None:
    for path in root.glob("iter_*"):
        shutil.rmtree(path)
    (root / "iter_0000004").mkdir()


# ---- actions run while a case runs (faults) ------------------------------------------------

def _wait_for(log: Path, pattern: str, process: subprocess.Popen, limit: float) -> bool:
    deadline = time.monotonic() + limit
    regex = re.compile(pattern)
    while time.monotonic() < deadline and process.poll() is None:
        if regex.search(log.read_text(errors="replace")):
            return True
        time.sleep(0.2)
    return False


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return sorted(int(p) for p in out.split())


def signal_worker(sig: int, which: str) -> Callable:
    """Once iteration 5 is logged, send ``sig`` to one torchrun worker (``min``/``max`` pid)."""
    def action(process: subprocess.Popen, log: Path) -> str:
        if not _wait_for(log, r"iteration +5/", process, 150):
            return "iteration 5 never logged"
        workers = _children(process.pid)
        if not workers:
            return "no worker processes found"
        target = min(workers) if which == "min" else max(workers)
        os.kill(target, sig)
        return f"sent {signal.Signals(sig).name} to worker {target} of {workers}"
    return action


def signal_self(sig: int, group: bool = False) -> Callable:
    """Once iteration 5 is logged, send ``sig`` to the process (or its whole group: Ctrl-C)."""
    def action(process: subprocess.Popen, log: Path) -> str:
        if not _wait_for(log, r"iteration +5/", process, 150):
            return "iteration 5 never logged"
        if group:
            os.killpg(process.pid, sig)
        else:
            os.kill(process.pid, sig)
        return f"sent {signal.Signals(sig).name} to {'group' if group else 'pid'} {process.pid}"
    return action


# ---- the cases -------------------------------------------------------------------------------

@dataclass
class Case:
    id: str
    cmd: list[str]
    expect: str = "error"          # "error", "ok" or "either" (one error line, or ok + match)
    setup: Callable | None = None
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 60
    needs: tuple[str, ...] = ()    # shared fixtures: "data", "ckpt"
    match: str | tuple[str, ...] | None = None  # regex(es): all in the output (ok) / in the
                                                # error line (error)
    action: Callable | None = None
    heavy: bool = False            # started first (long runs)

    @property
    def under_torchrun(self) -> bool:
        return self.cmd[0] == TORCHRUN


def W(n: int = 1) -> dict[str, str]:
    return {"WORLD_SIZE": str(n)}


def build_cases() -> list[Case]:
    C = Case
    cases = [
        # ---- (a) pretrain_gpt_2bw.py flags, one plain process -------------------------------
        C("gpt-num-layers-zero", gpt(*MOCK, "--num-layers", "0"), env=W()),
        C("gpt-num-layers-negative", gpt(*MOCK, "--num-layers", "-3"), env=W()),
        C("gpt-num-layers-float", gpt(*MOCK, "--num-layers", "2.5"), env=W()),
        C("gpt-num-layers-huge", gpt(*MOCK, "--num-layers", "10" * 12), env=W()),
        C("gpt-hidden-size-word", gpt(*MOCK, "--hidden-size", "abc"), env=W()),
        C("gpt-hidden-size-huge", gpt(*MOCK, "--hidden-size", "4" + "0" * 12), env=W()),
        C("gpt-hidden-not-divisible-by-heads", gpt(*MOCK, "--hidden-size", "30"), env=W()),
        C("gpt-heads-nan", gpt(*MOCK, "--num-attention-heads", "nan"), env=W()),
        C("gpt-ffn-hidden-negative", gpt(*MOCK, "--ffn-hidden-size", "-1"), env=W()),
        C("gpt-seq-length-zero", gpt(*MOCK, "--seq-length", "0"), env=W()),
        C("gpt-seq-length-gt-max-positions",
          gpt(*MOCK, "--seq-length", "32", "--max-position-embeddings", "16"), env=W()),
        C("gpt-max-positions-huge", gpt(*MOCK, "--max-position-embeddings", "1" + "0" * 15),
          env=W()),
        C("gpt-micro-batch-zero", gpt(*MOCK, "--micro-batch-size", "0"), env=W()),
        C("gpt-global-batch-negative", gpt(*MOCK, "--global-batch-size", "-8"), env=W()),
        C("gpt-global-batch-lt-micro", gpt(*MOCK, "--global-batch-size", "1"), env=W()),
        C("gpt-train-iters-zero", gpt(*MOCK, "--train-iters", "0"), env=W()),
        C("gpt-train-iters-sci-notation", gpt(*MOCK, "--train-iters", "1e3"), env=W()),
        C("gpt-train-iters-huge", gpt(*MOCK, "--train-iters", "1" + "0" * 30), env=W()),
        C("gpt-lr-zero", gpt(*MOCK, "--lr", "0"), env=W()),
        C("gpt-lr-nan", gpt(*MOCK, "--lr", "nan"), env=W()),
        C("gpt-lr-minus-inf", gpt(*MOCK, "--lr=-inf"), env=W()),
        C("gpt-lr-word", gpt(*MOCK, "--lr", "fast"), env=W()),
        C("gpt-min-lr-above-lr", gpt(*MOCK, "--lr", "1e-4", "--min-lr", "1e-2"), env=W()),
        C("gpt-warmup-longer-than-decay", gpt(*MOCK, "--lr-warmup-iters", "10"), env=W()),
        C("gpt-lr-decay-iters-negative", gpt(*MOCK, "--lr-decay-iters", "-5"), env=W()),
        C("gpt-weight-decay-inf", gpt(*MOCK, "--weight-decay", "inf"), env=W()),
        C("gpt-clip-grad-negative", gpt(*MOCK, "--clip-grad", "-1"), env=W()),
        C("gpt-adam-beta1-negative", gpt(*MOCK, "--adam-beta1", "-0.5"), env=W()),
        C("gpt-adam-beta2-one", gpt(*MOCK, "--adam-beta2", "1.0"), env=W()),
        C("gpt-adam-eps-nan", gpt(*MOCK, "--adam-eps", "nan"), env=W()),
        C("gpt-hidden-dropout-above-one", gpt(*MOCK, "--hidden-dropout", "1.5"), env=W()),
        C("gpt-attention-dropout-nan", gpt(*MOCK, "--attention-dropout", "nan"), env=W()),
        C("gpt-init-std-negative", gpt(*MOCK, "--init-method-std", "-0.02"), env=W()),
        C("gpt-seed-huge", gpt(*MOCK, "--seed", "99999999999"), env=W()),
        C("gpt-seed-word", gpt(*MOCK, "--seed", "lucky"), env=W()),
        C("gpt-fp16-and-bf16", gpt(*MOCK, "--fp16", "--bf16"), env=W()),
        C("gpt-fp16-loss-scale-negative", gpt(*MOCK, "--fp16", "--loss-scale", "-128"), env=W()),
        C("gpt-fp16-min-scale-above-initial",
          gpt(*MOCK, "--fp16", "--initial-loss-scale", "1", "--min-loss-scale", "1024"), env=W()),
        C("gpt-hysteresis-nan", gpt(*MOCK, "--hysteresis", "nan"), env=W()),
        C("gpt-recompute-method-without-granularity",
          gpt(*MOCK, "--recompute-method", "uniform"), env=W()),
        C("gpt-recompute-full-without-method",
          gpt(*MOCK, "--recompute-granularity", "full"), env=W()),
        C("gpt-recompute-num-layers-too-many",
          gpt(*MOCK, "--recompute-granularity", "full", "--recompute-method", "block",
              "--recompute-num-layers", "5"), env=W()),
        C("gpt-recompute-selective-with-method",
          gpt(*MOCK, "--recompute-granularity", "selective", "--recompute-method", "uniform"),
          env=W()),
        C("gpt-unknown-flag", gpt(*MOCK, "--no-such-flag", "3"), env=W()),
        C("gpt-misspelled-flag", gpt(*MOCK, "--num-layer", "2"), env=W()),
        C("gpt-abbreviated-flag", gpt(*MOCK, "--hidden", "32"), env=W()),
        C("gpt-megatron-lm-only-flag", gpt(*MOCK, "--moe-use-upcycling"), env=W()),
        C("gpt-flag-missing-value", gpt(*MOCK, "--lr"), env=W()),
        C("gpt-stray-positional", gpt(*MOCK, "extra-word"), env=W()),
        C("gpt-unknown-schedule", gpt(*MOCK, "--pipeline-schedule", "interleaved"), env=W()),
        C("gpt-unknown-optimizer", gpt(*MOCK, "--optimizer", "adamw"), env=W()),
        C("gpt-unknown-decay-style", gpt(*MOCK, "--lr-decay-style", "exponential"), env=W()),
        C("gpt-unknown-tokenizer-type", gpt(*DATA, "--tokenizer-type", "GPT2BPETokenizer"),
          env=W(), needs=("data",)),
        C("gpt-log-interval-nan", gpt(*MOCK, "--log-interval", "nan"), env=W()),
        C("gpt-eval-interval-zero", gpt(*MOCK, "--eval-iters", "1", "--eval-interval", "0"),
          env=W()),
        C("gpt-exit-interval-negative", gpt(*MOCK, "--exit-interval", "-1"), env=W()),
        C("gpt-dist-timeout-zero", gpt(*MOCK, "--distributed-timeout-minutes", "0"), env=W()),
        C("gpt-dist-timeout-inf", gpt(*MOCK, "--distributed-timeout-minutes", "inf"), env=W()),
        C("gpt-tp-zero", gpt(*MOCK, "--tensor-model-parallel-size", "0"), env=W()),
        C("gpt-vocab-divisible-negative", gpt(*MOCK, "--make-vocab-size-divisible-by", "-1"),
          env=W()),
        C("gpt-world-size-env-not-tp-x-pp", gpt(*MOCK, "--tensor-model-parallel-size", "2"),
          env=W(3)),
        C("gpt-save-interval-without-save", gpt(*MOCK, "--save-interval", "1"), env=W()),
        C("gpt-ckpt-keep-zero", gpt(*MOCK, "--save", "{tmp}/ck", "--ckpt-keep", "0"), env=W()),
        C("gpt-save-below-a-file", gpt(*MOCK, "--save", "{tmp}/a-file/ck"), env=W(),
          setup=blocker),
        C("gpt-save-is-a-file", gpt(*MOCK, "--save", "{tmp}/a-file"), env=W(), setup=blocker),
        C("gpt-tensorboard-below-a-file", gpt(*MOCK, "--tensorboard-dir", "{tmp}/a-file/tb"),
          env=W(), setup=blocker),
        C("gpt-load-nonexistent-dir", gpt(*MOCK, "--load", "{tmp}/no-such-checkpoints"),
          env=W()),
        C("gpt-load-a-file", gpt(*MOCK, "--load", "{tmp}/a-file"), env=W(), setup=blocker),
        C("gpt-no-data-path", gpt(*SMALL, "--tokenizer-model", "{tok}"), env=W(),
          needs=("data",)),
        C("gpt-no-tokenizer-model", gpt(*SMALL, "--data-path", "{data}"), env=W(),
          needs=("data",)),
        C("gpt-split-word", gpt(*DATA, "--split", "abc"), env=W(), needs=("data",)),
        C("gpt-split-all-zero", gpt(*DATA, "--split", "0,0,0"), env=W(), needs=("data",)),
        C("gpt-split-negative", gpt(*DATA, "--split=-1,50,51"), env=W(), needs=("data",)),
        C("gpt-split-four-parts", gpt(*DATA, "--split", "1,1,1,1"), env=W(), needs=("data",)),
        C("gpt-null-tokenizer-vocab-zero",
          gpt(*MOCK, "--tokenizer-type", "NullTokenizer", "--vocab-size", "0"), env=W()),
        C("gpt-null-tokenizer-without-vocab-size",
          gpt(*SMALL, "--data-path", "{data}", "--tokenizer-type", "NullTokenizer",
              "--data-cache-path", "{tmp}/index-cache"), env=W(), needs=("data",)),
        C("gpt-null-tokenizer-vocab-smaller-than-data",
          gpt(*SMALL, "--data-path", "{data}", "--tokenizer-type", "NullTokenizer",
              "--vocab-size", "16", "--data-cache-path", "{tmp}/index-cache"),
          env=W(), needs=("data",), timeout=90),
        C("gpt-data-cache-below-a-file",
          gpt(*SMALL, "--data-path", "{data}", "--tokenizer-model", "{tok}",
              "--data-cache-path", "{tmp}/a-file/cache"),
          env=W(), setup=blocker, needs=("data",)),

        # ---- (a) conflicts that need several ranks: torchrun, 2 processes -------------------
        C("torchrun-world-not-tp-x-pp",
          torchrun("pretrain_gpt_2bw.py", *MOCK, "--tensor-model-parallel-size", "2",
                   "--pipeline-model-parallel-size", "2"), timeout=90),
        C("torchrun-pp3-on-2-processes",
          torchrun("pretrain_gpt_2bw.py", *MOCK, "--num-layers", "3",
                   "--pipeline-model-parallel-size", "3"), timeout=90),
        C("torchrun-tp-not-dividing-heads",
          torchrun("pretrain_gpt_2bw.py", *MOCK, "--tensor-model-parallel-size", "2",
                   "--num-attention-heads", "3", "--hidden-size", "48"), timeout=90),
        C("torchrun-pp-not-dividing-layers",
          torchrun("pretrain_gpt_2bw.py", *MOCK, "--num-layers", "3",
                   "--pipeline-model-parallel-size", "2"), timeout=90),
        C("torchrun-global-batch-not-divisible",
          torchrun("pretrain_gpt_2bw.py", *MOCK, "--micro-batch-size", "3",
                   "--global-batch-size", "8"), timeout=90),
        C("torchrun-2bw-too-few-microbatches",
          torchrun("pretrain_gpt_2bw.py", *MOCK, "--pipeline-model-parallel-size", "2",
                   "--pipeline-schedule", "2bw", "--global-batch-size", "2"), timeout=90),
        C("torchrun-2bw-distributed-optimizer",
          torchrun("pretrain_gpt_2bw.py", *MOCK, "--pipeline-model-parallel-size", "2",
                   "--pipeline-schedule", "2bw", "--global-batch-size", "8",
                   "--use-distributed-optimizer"), timeout=90),
        C("torchrun-missing-data-file",
          torchrun("pretrain_gpt_2bw.py", *SMALL, "--data-path", "{tmp}/no-such-prefix",
                   "--tokenizer-model", "{tok}"), timeout=90, needs=("data",)),

        # ---- (a) pretrain_bert_2bw.py ---------------------------------------------------------
        C("bert-mask-prob-zero", bert(*MOCK, "--mask-prob", "0"), env=W()),
        C("bert-mask-prob-above-one", bert(*MOCK, "--mask-prob", "1.5"), env=W()),
        C("bert-short-seq-prob-nan", bert(*MOCK, "--short-seq-prob", "nan"), env=W()),
        C("bert-num-layers-zero", bert(*MOCK, "--num-layers", "0"), env=W()),
        C("bert-unknown-flag", bert(*MOCK, "--bert-binary-head"), env=W()),
        C("bert-fp16-and-bf16", bert(*MOCK, "--fp16", "--bf16"), env=W()),
        C("bert-gpt-tokenizer-type",
          bert(*BERT_DATA, "--tokenizer-type", "GPTSentencePieceTokenizer"), env=W(),
          needs=("data",)),
        C("bert-seq-length-4", bert(*BERT_DATA, "--seq-length", "4"), env=W(),
          needs=("data",)),
        C("bert-no-tokenizer-model",
          bert(*SMALL, "--data-path", "{bert_data}", "--tokenizer-type",
               "SentencePieceTokenizer"), env=W(), needs=("data",)),
        C("bert-idx-garbage",
          bert(*SMALL, "--data-path", "{p}", "--tokenizer-type", "SentencePieceTokenizer",
               "--tokenizer-model", "{tok}"), env=W(), needs=("data",),
          setup=data_copy(_garbage_idx, "bert_data")),
        C("bert-tokenizer-is-text",
          bert(*SMALL, "--data-path", "{bert_data}", "--tokenizer-type",
               "SentencePieceTokenizer", "--tokenizer-model", "{tmp}/fake.model"),
          env=W(), needs=("data",), setup=write("fake.model", "not a sentencepiece model\n")),
        C("bert-gpt-document-data",
          bert(*SMALL, "--data-path", "{small_data}", "--tokenizer-type",
               "SentencePieceTokenizer", "--tokenizer-model", "{tok}",
               "--data-cache-path", "{tmp}/index-cache"), env=W(), needs=("data",)),
        C("torchrun-bert-pp-not-dividing-layers",
          torchrun("pretrain_bert_2bw.py", *MOCK, "--num-layers", "3",
                   "--pipeline-model-parallel-size", "2"), timeout=90),

        # ---- (b) bad data and tokenizer files -----------------------------------------------
        C("data-bin-truncated", gpt(*SMALL, "--data-path", "{p}", "--tokenizer-model", "{tok}"),
          env=W(), needs=("data",), setup=data_copy(lambda p: _truncate(p + ".bin", 0.5))),
        C("data-bin-random-bytes",
          gpt(*SMALL, "--data-path", "{p}", "--tokenizer-model", "{tok}",
              "--data-cache-path", "{tmp}/index-cache"),
          env=W(), needs=("data",), setup=data_copy(_random_bin), timeout=90),
        C("data-idx-garbage", gpt(*SMALL, "--data-path", "{p}", "--tokenizer-model", "{tok}"),
          env=W(), needs=("data",), setup=data_copy(_garbage_idx)),
        C("data-idx-truncated", gpt(*SMALL, "--data-path", "{p}", "--tokenizer-model", "{tok}"),
          env=W(), needs=("data",), setup=data_copy(lambda p: _truncate(p + ".idx", 0.7))),
        C("data-bin-missing", gpt(*SMALL, "--data-path", "{p}", "--tokenizer-model", "{tok}"),
          env=W(), needs=("data",), setup=data_copy(lambda p: os.remove(p + ".bin"))),
        C("data-idx-missing", gpt(*SMALL, "--data-path", "{p}", "--tokenizer-model", "{tok}"),
          env=W(), needs=("data",), setup=data_copy(lambda p: os.remove(p + ".idx"))),
        C("data-empty-files", gpt(*SMALL, "--data-path", "{p}", "--tokenizer-model", "{tok}"),
          env=W(), needs=("data",), setup=data_copy(_empty_files)),
        C("data-path-with-bin-suffix",
          gpt(*SMALL, "--data-path", "{data}.bin", "--tokenizer-model", "{tok}"),
          env=W(), needs=("data",)),
        C("data-path-with-idx-suffix",
          gpt(*SMALL, "--data-path", "{data}.idx", "--tokenizer-model", "{tok}"),
          env=W(), needs=("data",)),
        C("data-path-is-a-directory",
          gpt(*SMALL, "--data-path", "{tmp}/a-dir", "--tokenizer-model", "{tok}"),
          env=W(), needs=("data",), setup=mkdir("a-dir")),
        C("data-path-nonexistent",
          gpt(*SMALL, "--data-path", "{tmp}/no-such-prefix", "--tokenizer-model", "{tok}"),
          env=W(), needs=("data",)),
        C("data-blend-negative-weight",
          gpt(*SMALL, "--data-path", "-1", "{data}", "2", "{data}", "--tokenizer-model", "{tok}",
              "--data-cache-path", "{tmp}/index-cache"), env=W(), needs=("data",)),
        C("data-blend-zero-weights",
          gpt(*SMALL, "--data-path", "0", "{data}", "0", "{data}", "--tokenizer-model", "{tok}",
              "--data-cache-path", "{tmp}/index-cache"), env=W(), needs=("data",)),
        C("data-blend-odd-count",
          gpt(*SMALL, "--data-path", "0.5", "{data}", "0.5", "--tokenizer-model", "{tok}",
              "--data-cache-path", "{tmp}/index-cache"), env=W(), needs=("data",)),
        C("data-blend-nan-weight",
          gpt(*SMALL, "--data-path", "nan", "{data}", "1", "{data}", "--tokenizer-model", "{tok}",
              "--data-cache-path", "{tmp}/index-cache"), env=W(), needs=("data",)),
        C("data-corpus-too-small-for-split",
          gpt(*SMALL, "--eval-iters", "1", "--data-path", "{small_data}", "--split",
              "969,30,1", "--tokenizer-model", "{tok}", "--data-cache-path",
              "{tmp}/index-cache"),
          env=W(), needs=("data",)),
        C("data-tokenizer-is-text",
          gpt(*SMALL, "--data-path", "{data}", "--tokenizer-model", "{tmp}/fake.model"),
          env=W(), needs=("data",), setup=write("fake.model", "not a sentencepiece model\n")),
        C("data-tokenizer-is-empty",
          gpt(*SMALL, "--data-path", "{data}", "--tokenizer-model", "{tmp}/empty.model"),
          env=W(), needs=("data",), setup=write("empty.model", b"")),
        C("data-tokenizer-is-a-directory",
          gpt(*SMALL, "--data-path", "{data}", "--tokenizer-model", "{tmp}/a-dir"),
          env=W(), needs=("data",), setup=mkdir("a-dir")),
        C("data-tokenizer-nonexistent",
          gpt(*SMALL, "--data-path", "{data}", "--tokenizer-model", "{tmp}/nope.model"),
          env=W(), needs=("data",)),
        C("data-tokenizer-is-the-vocab-file",
          gpt(*SMALL, "--data-path", "{data}", "--tokenizer-model", "{tokvocab}"),
          env=W(), needs=("data",),
          setup=lambda tmp, sh: {"tokvocab": sh.vars["tok"][:-len(".model")] + ".vocab"}),

        # ---- (c) tools/preprocess_data.py ---------------------------------------------------
        C("tool-preprocess-no-input",
          tool("preprocess_data.py", "--tokenizer-type", "GPTSentencePieceTokenizer",
               "--tokenizer-model", "{tok}", "--output-prefix", "{tmp}/out"), needs=("data",)),
        C("tool-preprocess-input-nonexistent",
          tool("preprocess_data.py", "--input", "{tmp}/nope.jsonl", "--tokenizer-type",
               "GPTSentencePieceTokenizer", "--tokenizer-model", "{tok}", "--output-prefix",
               "{tmp}/out"), needs=("data",)),
        C("tool-preprocess-input-empty",
          tool("preprocess_data.py", "--input", "{tmp}/empty.jsonl", "--tokenizer-type",
               "GPTSentencePieceTokenizer", "--tokenizer-model", "{tok}", "--output-prefix",
               "{tmp}/out"), needs=("data",), setup=write("empty.jsonl", "")),
        C("tool-preprocess-input-non-json-line",
          tool("preprocess_data.py", "--input", "{tmp}/bad.jsonl", "--tokenizer-type",
               "GPTSentencePieceTokenizer", "--tokenizer-model", "{tok}", "--output-prefix",
               "{tmp}/out"), needs=("data",),
          setup=write("bad.jsonl", '{"text": "fine"}\nthis line is not json\n{"text": "x"}\n')),
        C("tool-preprocess-input-no-text-key",
          tool("preprocess_data.py", "--input", "{tmp}/nokey.jsonl", "--tokenizer-type",
               "GPTSentencePieceTokenizer", "--tokenizer-model", "{tok}", "--output-prefix",
               "{tmp}/out"), needs=("data",),
          setup=write("nokey.jsonl", '{"body": "hello"}\n{"body": "world"}\n')),
        C("tool-preprocess-text-not-a-string",
          tool("preprocess_data.py", "--input", "{tmp}/num.jsonl", "--tokenizer-type",
               "GPTSentencePieceTokenizer", "--tokenizer-model", "{tok}", "--output-prefix",
               "{tmp}/out"), needs=("data",),
          setup=write("num.jsonl", '{"text": 42}\n{"text": ["a", "b"]}\n')),
        C("tool-preprocess-input-binary",
          tool("preprocess_data.py", "--input", "{tmp}/bin.jsonl", "--tokenizer-type",
               "GPTSentencePieceTokenizer", "--tokenizer-model", "{tok}", "--output-prefix",
               "{tmp}/out"), needs=("data",),
          setup=write("bin.jsonl", bytes(range(256)) * 8)),
        C("tool-preprocess-input-is-a-directory",
          tool("preprocess_data.py", "--input", "{tmp}/a-dir", "--tokenizer-type",
               "GPTSentencePieceTokenizer", "--tokenizer-model", "{tok}", "--output-prefix",
               "{tmp}/out"), needs=("data",), setup=mkdir("a-dir")),
        C("tool-preprocess-tokenizer-is-text",
          tool("preprocess_data.py", "--input", "{corpus}", "--tokenizer-type",
               "GPTSentencePieceTokenizer", "--tokenizer-model", "{tmp}/fake.model",
               "--output-prefix", "{tmp}/out"), needs=("data",),
          setup=write("fake.model", "not a sentencepiece model\n")),
        C("tool-preprocess-output-below-a-file",
          tool("preprocess_data.py", "--input", "{corpus}", "--tokenizer-type",
               "GPTSentencePieceTokenizer", "--tokenizer-model", "{tok}", "--output-prefix",
               "{tmp}/a-file/out"), needs=("data",), setup=blocker),
        C("tool-preprocess-workers-zero",
          tool("preprocess_data.py", "--input", "{corpus}", "--tokenizer-type",
               "GPTSentencePieceTokenizer", "--tokenizer-model", "{tok}", "--output-prefix",
               "{tmp}/out", "--workers", "0"), needs=("data",)),
        C("tool-preprocess-workers-word",
          tool("preprocess_data.py", "--input", "{corpus}", "--tokenizer-type",
               "GPTSentencePieceTokenizer", "--tokenizer-model", "{tok}", "--output-prefix",
               "{tmp}/out", "--workers", "many"), needs=("data",)),
        C("tool-preprocess-unknown-tokenizer-type",
          tool("preprocess_data.py", "--input", "{corpus}", "--tokenizer-type",
               "GPT2BPETokenizer", "--tokenizer-model", "{tok}", "--output-prefix",
               "{tmp}/out"), needs=("data",)),
        C("tool-preprocess-null-without-vocab",
          tool("preprocess_data.py", "--input", "{corpus}", "--tokenizer-type",
               "NullTokenizer", "--output-prefix", "{tmp}/out"), needs=("data",)),

        # ---- (c) tools/train_tokenizer.py ---------------------------------------------------
        C("tool-tokenizer-no-vocab-size",
          tool("train_tokenizer.py", "--input", "{corpus}", "--model-prefix", "{tmp}/tok"),
          needs=("data",)),
        C("tool-tokenizer-vocab-zero",
          tool("train_tokenizer.py", "--input", "{corpus}", "--model-prefix", "{tmp}/tok",
               "--vocab-size", "0"), needs=("data",)),
        C("tool-tokenizer-vocab-word",
          tool("train_tokenizer.py", "--input", "{corpus}", "--model-prefix", "{tmp}/tok",
               "--vocab-size", "big"), needs=("data",)),
        C("tool-tokenizer-vocab-too-large",
          tool("train_tokenizer.py", "--input", "{tmp}/tiny.jsonl", "--model-prefix",
               "{tmp}/tok", "--vocab-size", "5000"),
          setup=write("tiny.jsonl", '{"text": "hello world"}\n{"text": "hello there"}\n'),
          timeout=90),
        C("tool-tokenizer-input-empty",
          tool("train_tokenizer.py", "--input", "{tmp}/empty.jsonl", "--model-prefix",
               "{tmp}/tok", "--vocab-size", "64"), setup=write("empty.jsonl", "")),
        C("tool-tokenizer-input-non-json",
          tool("train_tokenizer.py", "--input", "{tmp}/bad.jsonl", "--model-prefix",
               "{tmp}/tok", "--vocab-size", "64"),
          setup=write("bad.jsonl", '{"text": "fine"}\n{not json\n')),
        C("tool-tokenizer-input-nonexistent",
          tool("train_tokenizer.py", "--input", "{tmp}/nope.jsonl", "--model-prefix",
               "{tmp}/tok", "--vocab-size", "64")),
        C("tool-tokenizer-prefix-below-a-file",
          tool("train_tokenizer.py", "--input", "{corpus}", "--model-prefix",
               "{tmp}/a-file/tok", "--vocab-size", "64"), needs=("data",), setup=blocker),
        C("tool-tokenizer-threads-zero",
          tool("train_tokenizer.py", "--input", "{corpus}", "--model-prefix", "{tmp}/tok",
               "--vocab-size", "64", "--num-threads", "0"), needs=("data",)),
        C("tool-tokenizer-sentence-size-negative",
          tool("train_tokenizer.py", "--input", "{corpus}", "--model-prefix", "{tmp}/tok",
               "--vocab-size", "64", "--input-sentence-size", "-1"), needs=("data",)),
        C("tool-tokenizer-json-key-missing",
          tool("train_tokenizer.py", "--input", "{corpus}", "--model-prefix", "{tmp}/tok",
               "--vocab-size", "64", "--json-key", "body"), needs=("data",)),

        # ---- (c) tools/plan.py ------------------------------------------------------------------
        C("tool-plan-missing-required", tool("plan.py", "--num-layers", "4")),
        C("tool-plan-nodes-zero", tool("plan.py", *PLAN, "--nodes", "0")),
        C("tool-plan-global-batch-negative", tool("plan.py", *PLAN, "--global-batch-size", "-1")),
        C("tool-plan-gpu-memory-nan", tool("plan.py", *PLAN, "--gpu-memory-gib", "nan")),
        C("tool-plan-unknown-cluster", tool("plan.py", *PLAN, "--cluster", "tpu-v5")),
        C("tool-plan-memory-fraction-above-one",
          tool("plan.py", *PLAN, "--memory-fraction", "1.5")),
        C("tool-plan-hidden-not-divisible-by-heads",
          tool("plan.py", *PLAN, "--hidden-size", "100", "--num-attention-heads", "3")),
        C("tool-plan-unknown-schedule", tool("plan.py", *PLAN, "--schedules", "2bw,pipedream")),
        C("tool-plan-micro-batch-list-words",
          tool("plan.py", *PLAN, "--micro-batch-sizes", "a,b")),
        C("tool-plan-profile-is-text",
          tool("plan.py", *PLAN[:-4], "--profile", "{tmp}/p.json", "--out", "{tmp}/plan"),
          setup=write("p.json", "this is not json\n")),
        C("tool-plan-profile-wrong-json",
          tool("plan.py", *PLAN[:-4], "--profile", "{tmp}/p.json", "--out", "{tmp}/plan"),
          setup=write("p.json", "[1, 2, 3]\n")),
        C("tool-plan-profile-nonexistent",
          tool("plan.py", *PLAN[:-4], "--profile", "{tmp}/nope.json", "--out", "{tmp}/plan")),
        C("tool-plan-out-below-a-file",
          tool("plan.py", *PLAN[:-3], "--out", "{tmp}/a-file/plan", "--no-scripts"),
          setup=blocker),
        C("tool-plan-unknown-subcommand", tool("plan.py", "frobnicate", *PLAN)),
        C("tool-plan-report-missing-measured",
          tool("plan.py", "report", "--profile", "{tmp}/p.json"),
          setup=write("p.json", "{}\n")),
        C("tool-plan-report-measured-garbage",
          tool("plan.py", "report", "--measured", "{tmp}/m.json", "--profile", "{tmp}/p.json"),
          setup=chain(write("m.json", "garbage\n"), write("p.json", "{}\n"))),
        C("tool-plan-profile-num-layers-zero",
          tool("plan.py", *PLAN_PROFILE, "--num-layers", "0")),
        C("tool-plan-profile-layouts-garbage",
          tool("plan.py", *PLAN_PROFILE, "--end-to-end", "--layouts", "t1d2:2bw",
               "--global-batch-size", "8")),

        # ---- (c) tools/compare.py -----------------------------------------------------------
        C("tool-compare-log-nonexistent",
          tool("compare.py", *CMP, "--from-logs", "a={tmp}/nope.log")),
        C("tool-compare-log-not-a-log",
          tool("compare.py", *CMP, "--from-logs", "a={tmp}/notes.txt"),
          setup=write("notes.txt", "hello, this is not a training log\n")),
        C("tool-compare-log-empty",
          tool("compare.py", *CMP, "--from-logs", "a={tmp}/empty.log"),
          setup=write("empty.log", "")),
        C("tool-compare-log-without-label",
          tool("compare.py", *CMP, "--from-logs", "{tmp}/notes.txt"),
          setup=write("notes.txt", "x\n")),
        C("tool-compare-entry-malformed", tool("compare.py", *CMP, "--entry", "x:2bw:1")),
        C("tool-compare-entry-unknown-schedule",
          tool("compare.py", *CMP, "--entry", "x:pipedream:1:2")),
        C("tool-compare-nproc-zero", tool("compare.py", *CMP, "--nproc", "0")),
        C("tool-compare-iters-zero", tool("compare.py", *CMP, "--iters", "0")),
        C("tool-compare-out-below-a-file",
          tool("compare.py", *CMP, "--out", "{tmp}/a-file/cmp"), setup=blocker),
        C("tool-compare-bad-training-flag-after-dashes",
          tool("compare.py", *CMP, "--", "--num-layers", "0")),
        C("tool-compare-unknown-reference",
          tool("compare.py", *CMP, "--entry", "a:2bw:1:2", "--reference", "zzz")),

        # ---- (c) tools/convergence.py -------------------------------------------------------
        C("tool-convergence-plot-only-no-logs", tool("convergence.py", *CONV, "--plot-only")),
        C("tool-convergence-plot-only-garbage-logs",
          tool("convergence.py", *CONV, "--plot-only"),
          setup=chain(write("conv/2bw.log", "garbage\n"), write("conv/flush.log", "x\n"))),
        C("tool-convergence-iters-zero", tool("convergence.py", *CONV, "--iters", "0")),
        C("tool-convergence-one-schedule", tool("convergence.py", *CONV, "--schedules", "2bw"),
          timeout=120),
        C("tool-convergence-unknown-schedule",
          tool("convergence.py", *CONV, "--schedules", "2bw,pipedream")),
        C("tool-convergence-target-negative",
          tool("convergence.py", *CONV, "--target", "-1")),
        C("tool-convergence-out-below-a-file",
          tool("convergence.py", "--out", "{tmp}/a-file/conv", "--iters", "2"), setup=blocker),
        C("tool-convergence-bad-training-flag-after-dashes",
          tool("convergence.py", *CONV, "--", "--hidden-dropout", "2")),

        # ---- (c) tools/timeline.py ----------------------------------------------------------
        C("tool-timeline-no-mode", tool("timeline.py", "--png", "{tmp}/t.png")),
        C("tool-timeline-simulate-and-records",
          tool("timeline.py", "--simulate", "--records", "{tmp}", "--png", "{tmp}/t.png")),
        C("tool-timeline-records-nonexistent",
          tool("timeline.py", "--records", "{tmp}/nope", "--png", "{tmp}/t.png")),
        C("tool-timeline-records-empty-dir",
          tool("timeline.py", "--records", "{tmp}/recs", "--png", "{tmp}/t.png"),
          setup=mkdir("recs")),
        C("tool-timeline-records-garbage",
          tool("timeline.py", "--records", "{tmp}/recs", "--png", "{tmp}/t.png"),
          setup=write("recs/rank0.jsonl", "not json at all\n{\"half\": \n")),
        C("tool-timeline-depth-zero",
          tool("timeline.py", "--simulate", "--schedule", "2bw", "--depth", "0",
               "--png", "{tmp}/t.png")),
        C("tool-timeline-megatron-schedule",
          tool("timeline.py", "--simulate", "--schedule", "megatron", "--png", "{tmp}/t.png")),
        C("tool-timeline-batches-reversed",
          tool("timeline.py", "--records", "{tmp}/recs", "--batches", "5:2",
               "--png", "{tmp}/t.png"), setup=mkdir("recs")),
        C("tool-timeline-forward-negative",
          tool("timeline.py", "--simulate", "--schedule", "2bw", "--forward", "-1",
               "--png", "{tmp}/t.png")),
        C("tool-timeline-png-below-a-file",
          tool("timeline.py", "--simulate", "--schedule", "2bw", "--png", "{tmp}/a-file/t.png"),
          setup=blocker),
        C("tool-timeline-run-bad-training-flag",
          tool("timeline.py", "run", "--nproc", "2", "--out", "{tmp}/recs", "--",
               "--num-layers", "0", "--mock-data")),
        C("tool-timeline-run-nproc-zero",
          tool("timeline.py", "run", "--nproc", "0", "--out", "{tmp}/recs", "--",
               *MOCK)),

        # ---- (c) tools/bench_schedules.py ---------------------------------------------------
        C("tool-bench-depth-zero", tool("bench_schedules.py", *BENCH, "--depth", "0")),
        C("tool-bench-rounds-zero", tool("bench_schedules.py", *BENCH, "--rounds", "0")),
        C("tool-bench-iters-negative", tool("bench_schedules.py", *BENCH, "--iters", "-2")),
        C("tool-bench-unknown-schedule",
          tool("bench_schedules.py", *BENCH, "--schedules", "2bw,pipedream")),
        C("tool-bench-json-below-a-file",
          tool("bench_schedules.py", "--json", "{tmp}/a-file/b.json", "--rounds", "1"),
          setup=blocker),
        C("tool-bench-nice-word", tool("bench_schedules.py", *BENCH, "--nice", "very")),
        C("tool-bench-2bw-too-few-microbatches",
          tool("bench_schedules.py", *BENCH, "--depth", "2", "--microbatches", "1",
               "--schedules", "2bw")),
        C("tool-bench-heads-not-dividing-hidden",
          tool("bench_schedules.py", *BENCH, "--hidden-size", "30",
               "--num-attention-heads", "4")),
        C("tool-bench-timeline-dir-below-a-file",
          tool("bench_schedules.py", *BENCH, "--timeline-dir", "{tmp}/a-file/tl"),
          setup=blocker),

        # ---- (d) faults ---------------------------------------------------------------------
        C("fault-kill-9-one-rank",
          torchrun("pretrain_gpt_2bw.py", *FAULT, "--train-iters", "100000", "--lr", "1e-4",
                   "--save", "{tmp}/ck", "--save-interval", "3"),
          action=signal_worker(signal.SIGKILL, "min"), timeout=120, heavy=True),
        C("fault-sigterm-one-rank",
          torchrun("pretrain_gpt_2bw.py", *FAULT, "--train-iters", "100000", "--lr", "1e-4",
                   "--save", "{tmp}/ck", "--save-interval", "100000"),
          expect="ok", match=(r"stopping at iteration \d+", r"saved checkpoint at iteration \d+ to "),
          action=signal_worker(signal.SIGTERM, "max"), timeout=120, heavy=True),
        C("fault-ctrl-c-torchrun-group",
          torchrun("pretrain_gpt_2bw.py", *FAULT, "--train-iters", "100000", "--lr", "1e-4",
                   "--save", "{tmp}/ck", "--save-interval", "100000"),
          expect="ok", match=r"stopping at iteration \d+",
          action=signal_self(signal.SIGINT, group=True), timeout=120, heavy=True),
        C("fault-sigterm-single-process",
          gpt(*MOCK, "--train-iters", "100000", "--log-interval", "1", "--save", "{tmp}/ck",
              "--save-interval", "100000"), env=W(),
          expect="ok", match=r"saved checkpoint at iteration \d+ to ",
          action=signal_self(signal.SIGTERM), timeout=120, heavy=True),
        C("fault-diverge-lr-1e30-torchrun",
          torchrun("pretrain_gpt_2bw.py", *FAULT, "--train-iters", "20", "--lr", "1e30",
                   "--save", "{tmp}/ck", "--save-interval", "2"),
          match=r"not finite", timeout=120, heavy=True),
        C("fault-diverge-lr-1e30-single",
          gpt(*MOCK, "--train-iters", "20", "--lr", "1e30", "--log-interval", "1"), env=W(),
          match=r"not finite", timeout=90),
        C("ckpt-newest-metadata-missing",
          gpt(*MOCK, "--train-iters", "4", "--load", "{ck}"), env=W(), needs=("ckpt",),
          setup=copy_ckpt(lambda r: (r / "iter_0000004" / "metadata.json").unlink()),
          expect="ok", match=r"warning: skipped unreadable checkpoint", timeout=90),
        C("ckpt-newest-metadata-truncated",
          gpt(*MOCK, "--train-iters", "4", "--load", "{ck}"), env=W(), needs=("ckpt",),
          setup=copy_ckpt(lambda r: (r / "iter_0000004" / ".metadata").write_bytes(b"")),
          expect="ok", match=r"warning: skipped unreadable checkpoint", timeout=90),
        C("ckpt-newest-iter-dir-empty",
          gpt(*MOCK, "--train-iters", "4", "--load", "{ck}"), env=W(), needs=("ckpt",),
          setup=copy_ckpt(_empty_newest),
          expect="ok", match=r"warning: skipped unreadable checkpoint", timeout=90),
        C("ckpt-only-iter-dir-empty",
          gpt(*MOCK, "--train-iters", "4", "--load", "{ck}"), env=W(), needs=("ckpt",),
          setup=copy_ckpt(_only_empty), timeout=90),
        C("ckpt-tracker-garbage",
          gpt(*MOCK, "--train-iters", "4", "--load", "{ck}"), env=W(), needs=("ckpt",),
          setup=copy_ckpt(lambda r: (r / "latest_checkpointed_iteration.txt")
                          .write_text("garbage\x00\x01")),
          match=r"invalid tracker file", timeout=90),
        C("ckpt-tracker-names-missing-iteration",
          gpt(*MOCK, "--train-iters", "4", "--load", "{ck}"), env=W(), needs=("ckpt",),
          setup=copy_ckpt(lambda r: (r / "latest_checkpointed_iteration.txt").write_text("9")),
          expect="either", match=r"warning:", timeout=90),
        C("ckpt-load-other-model-shape",
          gpt(*MOCK, "--train-iters", "4", "--hidden-size", "64", "--load", "{ck}"), env=W(),
          needs=("ckpt",), setup=copy_ckpt(), timeout=90),
        C("ckpt-load-typo-while-save-holds-a-run",
          gpt(*MOCK, "--train-iters", "4", "--load", "{tmp}/typo", "--save", "{ck}"), env=W(),
          needs=("ckpt",), setup=copy_ckpt(), timeout=90),
        C("ckpt-no-load-optim-word", gpt(*MOCK, "--no-load-optim", "yes"), env=W()),
    ]
    ids = [c.id for c in cases]
    duplicates = [i for i, n in Counter(ids).items() if n > 1]
    assert not duplicates, duplicates
    return cases


# ---- running and classifying -----------------------------------------------------------------

_TORCHRUN_LOG = re.compile(r"^([WEI]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ .*torch/distributed/"
                           r"|(WARNING|ERROR|INFO):torch\.distributed\.)")


def strip_torchrun(lines: list[str]) -> list[str]:
    """Leave out torchrun's ``ChildFailedError`` summary (its traceback and the ``=====`` block
    after it) and torchrun's own ``torch.distributed`` log lines."""
    lines = list(lines)
    while True:
        marks = [i for i, line in enumerate(lines) if "ChildFailedError" in line]
        if not marks:
            break
        c = marks[0]
        start = next((i for i in range(c, -1, -1)
                      if lines[i].startswith("Traceback (most recent call last)")), c)
        end, bars = c, 0
        for j in range(c + 1, len(lines)):
            if lines[j].startswith("====="):
                bars += 1
                end = j
                if bars == 2:
                    break
        del lines[start:end + 1]
    return [line for line in lines if not _TORCHRUN_LOG.search(line)]


@dataclass
class Result:
    case: Case
    cls: str
    rc: int | None
    seconds: float
    line: str
    output: str
    command: str
    note: str = ""


def classify(case: Case, rc: int | None, hung: bool, output: str) -> tuple[str, str]:
    lines = output.splitlines()
    if case.under_torchrun:
        lines = strip_torchrun(lines)
    text = "\n".join(lines)
    nonempty = [line.rstrip() for line in lines if line.strip()]
    last = nonempty[-1] if nonempty else ""
    errors = list(dict.fromkeys(line.strip() for line in nonempty
                                if line.strip().startswith("error:")))
    usage = any(re.match(r"\s*usage: ", line) for line in nonempty)
    traceback = "Traceback (most recent call last)" in text
    shown = last if last.startswith("error:") else (errors[-1] if errors else last)
    patterns = (case.match,) if isinstance(case.match, str) else (case.match or ())
    hits = [re.search(p, text, re.MULTILINE) for p in patterns]
    matched = bool(patterns) and all(hits)
    if hung:
        return "HANG", shown
    if traceback:
        return "TRACEBACK", shown
    if case.expect == "ok" or (case.expect == "either" and rc == 0):
        if rc != 0:
            return ("FAILED" if errors else "NO_ERROR_LINE"), shown
        if not matched:
            return "WRONG_MESSAGE", shown
        found = [next((line.strip() for line in nonempty if hit.group(0) in line),
                      hit.group(0)) for hit in hits]
        return "OK_EXPECTED", " | ".join(found)
    if rc == 0:
        return "SILENT", shown
    if usage or len(errors) > 1:
        return "MULTI_LINE", shown
    if not last.startswith("error:"):
        return "NO_ERROR_LINE", shown
    if patterns and case.expect == "error" and not all(re.search(p, last) for p in patterns):
        return "WRONG_MESSAGE", shown
    return "OK_ONE_LINE", shown


def run_case(case: Case, shared: Shared, root: Path) -> Result:
    tmp = Path(tempfile.mkdtemp(prefix=f"{case.id}-", dir=root))
    values = {"tmp": str(tmp), "port": str(free_port())}
    try:
        for name in case.needs:
            shared.need(name)
        values.update(shared.vars)
        if case.setup:
            values.update(case.setup(tmp, shared) or {})
        command = [part.format(**values) for part in case.cmd]
        env = base_env(**{k: v.format(**values) for k, v in case.env.items()},
                       MEGATRON_2BW_DATA_CACHE=str(root / "default-data-cache"))
    except Exception as error:  # noqa: BLE001
        shown = f"{type(error).__name__}: {error}"
        return Result(case, "SETUP_FAILED", None, 0.0, shown.splitlines()[0] if shown else "",
                      shown, " ".join(case.cmd))
    env_shown = " ".join(f"{k}={v}" for k, v in case.env.items())
    command_text = (env_shown + " " if env_shown else "") + shlex.join(
        [os.path.relpath(c, REPO) if c in (PY, TORCHRUN) else c for c in command])
    log = tmp / "output.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    note: list[str] = []
    watcher = None
    if case.action:
        watcher = threading.Thread(target=lambda: note.append(case.action(process, log)),
                                   daemon=True)
        watcher.start()
    hung = False
    try:
        rc = process.wait(timeout=case.timeout)
    except subprocess.TimeoutExpired:
        hung = True
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        rc = process.wait()
    seconds = time.monotonic() - started
    try:  # whatever of the session's group is left (a stray worker) goes with it
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if watcher:
        watcher.join(timeout=5)
    output = log.read_text(errors="replace")
    cls, line = classify(case, None if hung else rc, hung, output)
    return Result(case, cls, None if hung else rc, seconds, line, output, command_text,
                  "; ".join(n for n in note if n))


def row(r: Result) -> str:
    rc = "-" if r.rc is None else str(r.rc)
    line = r.line.strip().replace("\t", " ")
    if len(line) > 160:
        line = line[:157] + "..."
    return f"{r.case.id:<46} {r.cls:<13} {rc:>4} {r.seconds:6.1f}  {line}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1, help="cases run in parallel")
    parser.add_argument("--only", default=None, metavar="SUBSTR",
                        help="run only the cases whose id contains SUBSTR")
    parser.add_argument("--keep-going", action="store_true",
                        help="run every case; by default no case is started after the first "
                             "that is not OK_*")
    parser.add_argument("--keep-tmp", action="store_true",
                        help="keep the temporary folder (outputs of every case)")
    parser.add_argument("--tail", type=int, default=15,
                        help="lines of output shown for each case that is not OK_*")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")

    cases = [c for c in build_cases() if not args.only or args.only in c.id]
    if args.list:
        for c in cases:
            print(f"{c.id:<46} expect={c.expect:<6} {shlex.join(c.cmd)}")
        print(f"{len(cases)} cases")
        return 0
    if not cases:
        print(f"no case id contains {args.only!r}", file=sys.stderr)
        return 2

    root = Path(tempfile.mkdtemp(prefix="try-bad-inputs-"))
    shared = Shared(root)
    order = sorted(cases, key=lambda c: not c.heavy)  # long runs first, beside the quick ones
    results: dict[str, Result] = {}
    stop = threading.Event()
    started = time.monotonic()
    print(f"{len(cases)} cases, {args.jobs} at a time; temporary folder {root}", flush=True)

    def one(case: Case) -> Result | None:
        if stop.is_set():
            return None
        result = run_case(case, shared, root)
        if not result.cls.startswith("OK_") and not args.keep_going:
            stop.set()
        return result

    try:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(one, c) for c in order]
            for future in as_completed(futures):
                result = future.result()
                if result is None:
                    continue
                results[result.case.id] = result
                print(f"[{len(results):3d}/{len(cases)} {time.monotonic() - started:5.0f}s] "
                      + row(result), file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        stop.set()

    print()
    print(f"{'case':<46} {'class':<13} {'exit':>4} {'sec':>6}  error line")
    print("-" * 150)
    for case in cases:
        if case.id in results:
            print(row(results[case.id]))
        else:
            print(f"{case.id:<46} {'NOT_RUN':<13}")
    counts = Counter(r.cls for r in results.values())
    not_run = len(cases) - len(results)
    print("-" * 150)
    summary = ", ".join(f"{cls} {n}" for cls, n in sorted(counts.items()))
    print(f"counts: {summary}" + (f", NOT_RUN {not_run}" if not_run else "")
          + f"  ({len(results)} run, {time.monotonic() - started:.0f} s)")

    bad = [results[c.id] for c in cases if c.id in results
           and not results[c.id].cls.startswith("OK_")]
    for r in bad:
        print()
        print(f"=== {r.case.id}: {r.cls} (exit {r.rc}, {r.seconds:.1f} s"
              + (f", {r.note}" if r.note else "") + ")")
        print(f"$ {r.command}")
        lines = r.output.splitlines()
        print("\n".join(lines[-args.tail:]))
        if r.case.under_torchrun:
            own = strip_torchrun(lines)
            if own[-args.tail:] != lines[-args.tail:]:
                print(f"--- the same without torchrun's own summary and log lines "
                      f"(last {min(args.tail, 8)}):")
                print("\n".join(own[-min(args.tail, 8):]))
    if args.keep_tmp:
        print(f"\noutputs kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if not bad and not not_run else 1


if __name__ == "__main__":
    sys.exit(main())
