"""The schedules on real megatron-core models over gloo, against single-process references.

Every run starts from the reference's initial weights (tests/reference.py ``MODEL``, GPT-2-style
or Llama-style) and its weights after 5-7 iterations must equal, to 1e-6 by ||W - W_ref|| /
||W_ref||, the single-process reference of its update rule: PP=1 gradient accumulation for
flush, gpipe, naive, zb-h1 (these also Megatron's own 1F1B), zb-v and dualpipev; 2BW's 1-stale
rule for 2bw; PipeDream's per-stage stashing for pipedream; and lie far from the other rule.
Also: d=4 runs finish within a deadline, and a failing send ends every rank with one error line.
Guards: each schedule computes its rule's update exactly. The grids, the tolerance and why
Adam's eps is 1e-6: docs/testing.md, "What each test module checks", test_schedules_exact.py.

The processes are forked from one launcher that imports torch and megatron-core once
(tests/schedule_worker.py); the torchrun test launches the ordinary way.

"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from tests import dist
from tests.dist import subprocess_env

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "schedule_worker.py"
TOLERANCE = 1e-6
DISTINCT = 1e-3  # the other update rule's result lies at least this far away
ADAM_EPS = 1e-6
SYNC_SCHEDULES = ("flush", "gpipe", "naive", "zb-h1")


@dataclass(frozen=True)
class Case:
    """One pipeline run and the reference it must match."""

    schedule: str
    d: int
    m: int
    w: int
    iters: int
    recompute: bool = False
    tp: int = 1
    tie: bool = True
    deferred: bool = True
    """2bw: the optimizer step deferred to its first reader (clipping and tied embeddings
    are on unless tie=False), or where the loop calls it."""
    warmup: int = 0
    """LR warm-up iterations: each step has its own lr, which a deferred step must keep."""
    flags: tuple[str, ...] = ()
    """More Megatron-LM flags of the run (the reference is the same)."""
    decay: float | None = None
    """pipemare: --pipemare-discrepancy-decay (T2), in the run and its reference."""
    sync_iters: int = 0
    """pipemare: --pipemare-sync-iters, in the run and its reference."""
    lr_warmup_steps: int = 0
    """pipemare: --pipemare-lr-warmup-steps (T1), in the run and its reference."""
    drains: tuple[int, ...] = ()
    """Iterations after which the run drains (as before an evaluation); the reference has
    none: the schedules' weights do not depend on drains."""
    layers: int = 4
    """Transformer layers (d x V must divide them)."""
    round_trip: bool = False
    """At each drain the weight versions are saved as a checkpoint holds them, spoilt in
    memory and loaded back (tests/schedule_worker.py)."""
    llama: bool = False
    """Llama-style layers (tests/reference.py ``Model.llama``), in the run and its reference."""
    optimizer: str = "adam"
    """"muon": Muon for the hidden layers' weights (tests/test_optimizers_exact.py)."""
    correction: str = "none"
    """2bw's --stale-weight-correction, in the run and its reference."""
    coeff: float = 1.0
    """--stale-weight-correction-coeff."""
    moe: tuple = ()
    """Mixture of Experts: (megatron-core MoE config field, value) pairs, in the run (as
    Megatron-LM's flags) and its reference (tests/reference.py ``Model.moe``)."""
    tag: str = ""
    """Names the MoE model in the run's and the reference's names (tests/test_moe_exact.py)."""
    ep: int = 1
    """--expert-model-parallel-size of the run (the reference holds every expert)."""
    clip: float | None = None
    """--clip-grad, in the run and its reference (None: ``MODEL.clip_grad``)."""
    split: tuple[int, ...] | None = None
    """The layers per virtual stage (model order) that ``flags`` split unevenly, as the test
    states them: the run's chunks load and report their layers by it (tests/
    test_layouts_exact.py)."""

    @property
    def pipemare_flags(self) -> tuple[str, ...]:
        return ((("--pipemare-discrepancy-decay", str(self.decay)) if self.decay else ())
                + (("--pipemare-sync-iters", str(self.sync_iters)) if self.sync_iters else ())
                + (("--pipemare-lr-warmup-steps", str(self.lr_warmup_steps))
                   if self.lr_warmup_steps else ()))

    @property
    def model(self) -> dict:
        return {"adam_eps": ADAM_EPS, "lr_warmup_iters": self.warmup, "num_layers": self.layers,
                **({"llama": True} if self.llama else {}),
                **({"optimizer": "muon", "tensor_parallel": self.tp}
                   if self.optimizer == "muon" else {}),
                **({"correction": self.correction, "correction_coeff": self.coeff}
                   if self.correction != "none" else {}),
                **({"moe": dict(self.moe)} if self.moe else {}),
                **({"clip_grad": self.clip} if self.clip is not None else {})}

    @property
    def _update_suffix(self) -> str:
        """The optimizer and correction in names (none for Adam without a correction)."""
        return (f"{'-muon' if self.optimizer == 'muon' else ''}"
                f"{f'-{self.correction}{self.coeff:g}' if self.correction != 'none' else ''}"
                f"{f'-{self.tag}' if self.tag else ''}"
                f"{f'-clip{self.clip:g}' if self.clip is not None else ''}")

    @property
    def name(self) -> str:
        return (f"{self.schedule}-d{self.d}-m{self.m}-w{self.w}-tp{self.tp}"
                f"{'-recompute' if self.recompute else ''}{'' if self.tie else '-untied'}"
                f"{'' if self.deferred else '-sync-step'}"
                f"{f'-warmup{self.warmup}' if self.warmup else ''}"
                f"{''.join(self.flags + self.pipemare_flags).replace('--', '-')}"
                f"{''.join(f'-drain{t}' for t in self.drains)}-i{self.iters}"
                f"{f'-L{self.layers}' if self.layers != 4 else ''}{'-llama' if self.llama else ''}"
                f"{self._update_suffix}{f'-ep{self.ep}' if self.ep > 1 else ''}"
                f"{f'-split{self.split_label}' if self.split else ''}"
                ).replace("|", "_").replace("*", "x")  # layout strings, in directory names

    @property
    def split_label(self) -> str:
        return "-".join(map(str, self.split or ()))

    @property
    def world(self) -> int:
        return self.d * self.w * self.tp

    def reference(self, rule: str | None = None) -> str:
        rule = rule or self.rule
        options = self.pipemare_options(rule)
        muon_tp = f"-tp{self.tp}" if self.optimizer == "muon" and self.tp > 1 else ""
        return (f"{rule}{f'-d{self.d}' if rule in PER_STAGE else ''}-w{self.w}-m{self.m}"
                f"-i{self.iters}{'' if self.tie else '-untied'}"
                f"{f'-warmup{self.warmup}' if self.warmup else ''}"
                f"{''.join(f'-{k}{v}' for k, v in options.items())}"
                f"{f'-L{self.layers}' if self.layers != 4 else ''}{'-llama' if self.llama else ''}"
                f"{self._update_suffix}{muon_tp}"
                f"{f'-split{self.split_label}' if self.split and rule in PER_STAGE else ''}")

    def pipemare_options(self, rule: str) -> dict:
        """The reference's pipemare options (none for the other rules)."""
        if rule != "pipemare":
            return {}
        return {**({"discrepancy_decay": self.decay} if self.decay else {}),
                **({"sync_iters": self.sync_iters} if self.sync_iters else {}),
                **({"lr_warmup_steps": self.lr_warmup_steps} if self.lr_warmup_steps else {})}

    @property
    def rule(self) -> str:
        """The update rule of tests/reference.py the schedule follows."""
        return self.schedule if self.schedule in ("2bw", *PER_STAGE) else "sync"

    def run(self) -> dict:
        return {"name": self.name, "schedule": self.schedule, "tp": self.tp, "pp": self.d,
                "m": self.m, "iters": self.iters, "recompute": self.recompute, "tie": self.tie,
                "deferred": self.deferred, "model": self.model,
                "flags": list(self.flags + self.pipemare_flags + (
                    ("--expert-model-parallel-size", str(self.ep)) if self.ep > 1 else ())),
                "drains": list(self.drains),
                "round_trip": self.round_trip,
                **({"split": list(self.split)} if self.split else {})}


SYNC_CASES = [Case(s, d=2, m=4, w=2, iters=5) for s in (*SYNC_SCHEDULES, "megatron")]
ZBH1_CASES = [  # with SYNC_CASES' m=4 and d=4 below
    Case("zb-h1", d=2, m=2, w=2, iters=5),
    # DDP's hooks launch the bucket reductions: the last I (norms, biases, embeddings) and the
    # last W (the linear weights) together complete the batch's gradients
    Case("zb-h1", d=2, m=4, w=2, iters=5, flags=("--overlap-grad-reduce", "--ddp-bucket-size",
                                                 "2000")),
]
PER_STAGE = ("pipedream", "pipemare")
"""Rules of tests/reference.py that hold weights per stage (they need the depth)."""
TWO_CHUNKS = ("--num-virtual-stages-per-pipeline-rank", "2")
OVERLAP = ("--overlap-grad-reduce", "--ddp-bucket-size", "2000")
GATHER = ("--use-distributed-optimizer", "--overlap-param-gather") + OVERLAP
INTERLEAVED_CASES = [  # virtual stages: chunk c of stage s holds layers of virtual stage cd + s
    Case("flush", d=2, m=4, w=2, iters=5, flags=TWO_CHUNKS),
    Case("flush", d=4, m=4, w=1, iters=5, flags=TWO_CHUNKS, layers=8),
    # each chunk's bucket reductions launched at its last backward (from DDP's hooks, or
    # after it with --align-grad-reduce's grad_sync_func), as megatron-core's interleaved 1F1B
    Case("flush", d=2, m=4, w=2, iters=5, flags=TWO_CHUNKS + OVERLAP),
    Case("flush", d=2, m=4, w=2, iters=5,
         flags=TWO_CHUNKS + OVERLAP + ("--no-align-grad-reduce",)),
    # the distributed optimizer's all-gathers launched ahead as megatron-core's interleaved
    # 1F1B launches them: chunks 0 and 1 as the call begins, chunk 2 at chunk 1's first forward
    Case("flush", d=2, m=4, w=2, iters=5, layers=6,
         flags=("--num-virtual-stages-per-pipeline-rank", "3") + GATHER),
    Case("2bw", d=2, m=4, w=2, iters=6, flags=TWO_CHUNKS + GATHER, deferred=False),
    Case("2bw", d=2, m=4, w=1, iters=6, flags=TWO_CHUNKS),  # the deferred step over 2 chunks
    Case("2bw", d=2, m=4, w=1, iters=6, flags=TWO_CHUNKS, deferred=False),
    Case("2bw", d=4, m=8, w=1, iters=6, flags=TWO_CHUNKS, layers=8),  # m V >= 2(d-1) + d
]
TWOBW_CASES = [
    Case("2bw", d=2, m=2, w=1, iters=6, warmup=3),
    Case("2bw", d=2, m=2, w=1, iters=6, warmup=3, deferred=False),
    Case("2bw", d=2, m=4, w=1, iters=6, recompute=True, tie=False),
    Case("2bw", d=2, m=2, w=2, iters=6),
    Case("2bw", d=2, m=4, w=2, iters=6, recompute=True),
    Case("2bw", d=4, m=4, w=1, iters=6, recompute=True),
    Case("2bw", d=4, m=8, w=1, iters=6),
    Case("2bw", d=2, m=2, w=1, iters=6, recompute=True, tp=2),
    Case("2bw", d=4, m=4, w=2, iters=6),
    # the optimizer writes its shard into megatron-core's parameter buffer, all-gathers into it
    Case("2bw", d=2, m=2, w=2, iters=6, flags=("--use-distributed-optimizer",)),
    Case("2bw", d=2, m=2, w=2, iters=6, deferred=False,
         flags=("--use-distributed-optimizer", "--overlap-grad-reduce",
                "--overlap-param-gather", "--ddp-bucket-size", "2000")),
]
PIPEDREAM_CASES = [
    Case("pipedream", d=2, m=2, w=1, iters=6),
    Case("pipedream", d=2, m=4, w=2, iters=6, tie=False),
    Case("pipedream", d=4, m=4, w=1, iters=6, recompute=True),
    Case("pipedream", d=4, m=8, w=1, iters=6, deferred=False),
    # PipeDream's own setting, an update per microbatch: stage i holds d - i versions, the
    # look-ahead forwards reach 3 batches ahead, and a drain must be known 3 calls before;
    # at the drain all versions go through a checkpoint's save and load
    Case("pipedream", d=4, m=1, w=1, iters=7, drains=(3,), round_trip=True),
    # ... Llama-style (GLU's linear_fc1 goes through a ShardedTensorFactory in the round trip)
    # with the distributed optimizer (each new version written through its buffer's views)
    Case("pipedream", d=4, m=1, w=1, iters=7, drains=(3,), round_trip=True, tie=False,
         llama=True, flags=("--use-distributed-optimizer",)),
]
PIPEMARE_CASES = [  # each also lies > DISTINCT from the pipedream rule (stashed backwards)
    Case("pipemare", d=2, m=2, w=1, iters=6),
    # T2 with the deferred step (the correction tracks each step where it is applied), and a
    # drain (the refill's forwards read the version the corrected copy later replaces) ...
    Case("pipemare", d=4, m=4, w=1, iters=6, tie=False, decay=0.5, drains=(2,)),
    # ... and with the loop's step; two synchronous (flush) iterations first
    Case("pipemare", d=2, m=4, w=1, iters=6, deferred=False, decay=0.5, sync_iters=2),
    Case("pipemare", d=4, m=8, w=1, iters=6),
    # forward delays up to 3 steps: T1 scales stage i's first steps by 1/tau_i ** (1 - k/K)
    Case("pipemare", d=4, m=1, w=1, iters=6, tie=False, lr_warmup_steps=4),
]
V_CASES = [  # two chunks per stage in a V (stage s holds layers s and 3 - s), untied embeddings;
    # with TWOBW_CASES' untied d=2 m=4 run in its processes, sharing its references
    Case("zb-v", d=2, m=4, w=1, iters=6, tie=False),
    Case("dualpipev", d=2, m=4, w=1, iters=6, tie=False),
    # Llama-style, two replicas, the distributed optimizer (one buffer per chunk); DualPipeV
    # with both overlaps: each chunk's reductions launched after its last W, its all-gathers
    # as a call begins
    Case("zb-v", d=2, m=4, w=2, iters=6, tie=False, llama=True,
         flags=("--use-distributed-optimizer",)),
    Case("dualpipev", d=2, m=4, w=2, iters=6, tie=False, llama=True, flags=GATHER),
]
PIPEMARE_ONE_STAGE = Case("pipemare", d=1, m=2, w=1, iters=6, decay=0.5, sync_iters=1)
"""Its reference only: with one stage nothing is in flight, so it is the "sync" rule's."""
FOUR_STAGE_CASES = [Case(s, d=4, m=4, w=1, iters=10) for s in ("2bw", *SYNC_SCHEDULES)]
FAILURES = {  # group -> (run, stage whose send fails, which send of that process)
    "send-fails": (Case("2bw", d=4, m=4, w=1, iters=3), 1, 3),
    "send-fails-later": (Case("2bw", d=4, m=4, w=1, iters=3), 2, 11),  # in call 1
}


GROUP_DEADLINE_S = 150
"""A launch group's deadline (a hang's bound), and at least RUN_DEADLINE_S per run in it."""
RUN_DEADLINE_S = 10


def _groups() -> dict:
    """Launch groups: runs sharing a world size run one after another in one process group."""
    groups: dict = {}
    interleaved_sync = [case for case in INTERLEAVED_CASES if case.rule == "sync"]
    interleaved_2bw = [case for case in INTERLEAVED_CASES if case.rule != "sync"]
    for label, cases in (("sync", SYNC_CASES + ZBH1_CASES + interleaved_sync),
                         ("2bw", TWOBW_CASES + PIPEDREAM_CASES + PIPEMARE_CASES
                          + interleaved_2bw + V_CASES)):
        for case in cases:
            group = groups.setdefault(f"{label}-world{case.world}",
                                      {"world": case.world, "runs": []})
            group["runs"].append(case.run())
            group["timeout_s"] = max(GROUP_DEADLINE_S, RUN_DEADLINE_S * len(group["runs"]))
    groups["four-stages"] = {"world": 4, "timeout_s": GROUP_DEADLINE_S,
                             "runs": [case.run() for case in FOUR_STAGE_CASES]}
    for group, (case, stage, send) in FAILURES.items():
        # the survivors wait for the failed rank's receives at most 0.2 minutes, as under NCCL
        # (gloo would notice the closed connection; strict mode, like NCCL, does not)
        groups[group] = {"world": case.world, "timeout_s": 60, "timeout_minutes": 0.2,
                         "waits": True,
                         "runs": [{**case.run(), "fail": {"stage": stage, "send": send}}]}
    return groups


def reference_job(case: Case, rule: str) -> dict:
    """The tests/reference.py job of ``case``'s model and batches under ``rule``."""
    return {"rule": rule, "replicas": case.w, "microbatches": case.m, "iterations": case.iters,
            "tie": case.tie, "model": case.model, "depth": case.d}


def groups_by_world(cases: list[Case], prefix: str = "world") -> dict:
    """Launch groups of ``cases``: those of one world size one after another in one group."""
    groups: dict = {}
    for case in cases:
        group = groups.setdefault(f"{prefix}{case.world}", {"world": case.world, "runs": []})
        group["runs"].append(case.run())
        group["timeout_s"] = max(GROUP_DEADLINE_S, RUN_DEADLINE_S * len(group["runs"]))
    return groups


def _far_references(case: Case) -> dict[str, tuple[str, float]]:
    """What a run must lie far from: label -> (reference job, least relative distance). The
    other rule; for pipemare also the stashing rule and the same run without its T2 or W."""
    far = {(other := "sync" if case.rule == "2bw" else "2bw"): (case.reference(other), DISTINCT)}
    if case.rule == "pipemare":
        far["pipedream"] = (case.reference("pipedream"), DISTINCT)
        if case.decay:
            far["pipemare without T2"] = (replace(case, decay=None).reference(), 1e-4)
        if case.sync_iters:
            far["pipemare without W"] = (replace(case, sync_iters=0).reference(), 1e-4)
        if case.lr_warmup_steps:
            far["pipemare without T1"] = (replace(case, lr_warmup_steps=0).reference(), 1e-4)
    return far


def _pipemare_variants(case: Case) -> list[Case]:
    """The case without each of its PipeMare options (their references: `_far_references`)."""
    return ([replace(case, decay=None)] if case.decay else []) + \
        ([replace(case, sync_iters=0)] if case.sync_iters else []) + \
        ([replace(case, lr_warmup_steps=0)] if case.lr_warmup_steps else [])


def _reference_jobs_of(cases: list[Case]) -> dict:
    """The reference jobs `cases` are checked against (`_check_against_reference`)."""
    jobs = {}
    for case in cases:
        for rule in {"sync", "2bw", case.rule, *(["pipedream"] if case.rule == "pipemare" else [])}:
            jobs[case.reference(rule)] = {
                **reference_job(case, rule), **case.pipemare_options(rule),
                **({"split": list(case.split)} if case.split and rule in PER_STAGE else {})}
    return jobs


def _reference_jobs() -> dict:
    jobs = _reference_jobs_of(
        SYNC_CASES + ZBH1_CASES + TWOBW_CASES + PIPEDREAM_CASES + FOUR_STAGE_CASES
        + INTERLEAVED_CASES + PIPEMARE_CASES + V_CASES
        + [v for c in PIPEMARE_CASES for v in _pipemare_variants(c)])
    one = PIPEMARE_ONE_STAGE
    jobs[one.reference()] = {"rule": "pipemare", "replicas": one.w, "microbatches": one.m,
                             "iterations": one.iters, "tie": one.tie, "model": one.model,
                             "depth": one.d, **one.pipemare_options("pipemare")}
    jobs[one.reference("sync")] = {**jobs[one.reference()], "rule": "sync", "depth": 1,
                                   "discrepancy_decay": None, "sync_iters": 0}
    return jobs


def _env(**extra: str) -> dict:
    return subprocess_env(PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", **extra)


def _run_bounded(command: list[str], timeout_s: float, **env: str) -> tuple[int, str, float]:
    """Run `command` in its own session; kill the whole session at the deadline. The
    launcher (`python tests/schedule_worker.py SPEC`, no variables of its own) is forked from
    the tests' pre-imported process (tests/prefork.py), which has imported what it would."""
    started = time.monotonic()
    if command[0] == sys.executable and command[1] == str(WORKER) and not env:
        try:
            done = dist.python(command[1:], timeout=timeout_s)
        except TimeoutError as error:
            pytest.fail(str(error))
        return done.returncode, done.output, time.monotonic() - started
    proc = subprocess.Popen(command, cwd=REPO, env=_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(command)} still running after {timeout_s} s:\n{output[-4000:]}")
    return proc.returncode, output, time.monotonic() - started


@dataclass
class Launch:
    out: Path
    summary: dict
    output: str

    def log(self, group: str, lines: int = 40) -> str:
        texts = []
        for log in sorted((self.out / group).glob("rank*.log")):
            texts.append(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-lines:]))
        return "\n".join(texts)

    def group(self, name: str) -> dict:
        assert name in self.summary, f"group {name} did not run:\n{self.output[-4000:]}"
        return self.summary[name]

    def finished(self, name: str) -> None:
        result = self.group(name)
        ok = not result["timed_out"] and all(code == 0 for code in result["exit_codes"])
        assert ok, f"group {name}: {result}\n{self.log(name)}"


def launch_worker(out: Path, reference_jobs: dict, groups: dict, timeout_s: float) -> Launch:
    """Run tests/schedule_worker.py on a spec of these reference jobs and launch groups."""
    spec = {"out": str(out), "init": str(out / "init.pt"), "timeout_minutes": 1.0,
            "reference": reference_jobs, "groups": groups}
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    code, output, seconds = _run_bounded([sys.executable, str(WORKER), str(out / "spec.json")],
                                         timeout_s=timeout_s)
    assert code == 0, f"launcher exited with {code}:\n{output[-4000:]}"
    summary = json.loads((out / "launch.json").read_text())
    assert summary["reference"]["exit_codes"] == [0], \
        f"reference failed:\n{Launch(out, summary, output).log('reference')}"
    print(f"\nlauncher: {seconds:.1f} s; " + ", ".join(
        f"{name} {result['seconds']:.1f} s" for name, result in summary.items()))
    return Launch(out, summary, output)


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Launch:
    return launch_worker(tmp_path_factory.mktemp("schedules_exact"), _reference_jobs(),
                         _groups(), timeout_s=600)


# ---- gathering a run's weights back into the PP=1, TP=1 model ---------------------------------

def _gather(out: Path, case: Case) -> tuple[dict, dict]:
    """{name: tensor} of data-parallel replica 0, and {replica: losses} of the last stages.

    Checks on the way: replicas hold identical weights, tensor-parallel ranks identical copies
    of replicated parameters, the last stage's tied output layer equals the word embeddings."""
    shards = [torch.load(path) for path in sorted((out / case.name).glob("rank*.pt"))]
    assert len(shards) == case.world, f"{case.name}: {len(shards)} of {case.world} ranks wrote"
    replicas: dict = {}
    losses = {s["dp"]: s["losses"] for s in shards if s["losses"]}
    for shard in shards:
        pieces = replicas.setdefault(shard["dp"], {})
        for name, (tensor, dim) in shard["params"].items():
            pieces.setdefault(name, {})[shard["tp"]] = (tensor, dim)
    gathered = {}
    for dp, pieces in replicas.items():
        weights = {}
        for name, by_tp in pieces.items():
            parts = [by_tp[t] for t in sorted(by_tp)]
            assert len(parts) == case.tp, f"{case.name}: {name} has {len(parts)} TP parts"
            dim = parts[0][1]
            if dim is None:
                for tensor, _ in parts[1:]:
                    assert torch.equal(tensor, parts[0][0]), \
                        f"{case.name}: replicated {name} differs across TP ranks"
                weights[name] = parts[0][0]
            else:
                weights[name] = torch.cat([tensor for tensor, _ in parts], dim=dim)
        tied = weights.pop("tied:output_layer.weight", None)
        if tied is not None:
            assert torch.equal(tied, weights["embedding.word_embeddings.weight"]), \
                f"{case.name}: the last stage's tied output layer left the word embeddings"
        gathered[dp] = weights
    assert sorted(gathered) == list(range(case.w))
    merged = dict(gathered[0])
    for dp in range(1, case.w):
        for name, tensor in gathered[dp].items():  # experts: each replica holds its EP rank's
            if name not in merged:
                merged[name] = tensor
            assert torch.equal(tensor, merged[name]), \
                f"{case.name}: data-parallel replica {dp} differs in {name}"
        dense = [name for name in gathered[0] if EXPERT not in name]
        assert all(name in gathered[dp] for name in dense), \
            f"{case.name}: replica {dp} lacks dense parameters"
    return merged, losses


EXPERT = ".experts.local_experts."
"""In the name of an expert's parameter (expert parallelism splits these over replicas)."""


def relative_error(weights: dict, reference: dict) -> float:
    """||W - W_ref|| / ||W_ref|| over all parameters (float64)."""
    assert sorted(weights) == sorted(reference), \
        f"parameter names differ: {sorted(set(weights) ^ set(reference))}"
    diff = sum(float((weights[n].double() - reference[n].double()).norm()) ** 2 for n in reference)
    norm = sum(float(reference[n].double().norm()) ** 2 for n in reference)
    return math.sqrt(diff / norm)


def _worst_tensor(weights: dict, reference: dict) -> str:
    name = max(reference, key=lambda n: float((weights[n] - reference[n]).norm()))
    error = float((weights[name] - reference[name]).abs().max())
    return f"largest difference in {name}: {error:.3g}"


def _reference(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}.pt")


def _check_against_reference(launch: Launch, case: Case) -> float:
    """The run's weights and losses match its reference; the other rule's result is far."""
    weights, losses = _gather(launch.out, case)
    ref = _reference(launch.out, case.reference())
    error = relative_error(weights, ref["weights"])
    assert error <= TOLERANCE, (f"{case.name}: relative error {error:.3g} > {TOLERANCE} against "
                                f"{case.reference()}; {_worst_tensor(weights, ref['weights'])}")
    distances = {}
    for other, (job, least) in _far_references(case).items():
        distances[other] = relative_error(weights, _reference(launch.out, job)["weights"])
        assert distances[other] > least, \
            f"{case.name}: {distances[other]:.3g} from the {other} reference {job}"
    assert sorted(losses) == list(range(case.w))
    for replica, seen in losses.items():
        expected = [batch[replica] for batch in ref["losses"]]
        assert len(seen) == case.iters and all(math.isfinite(x) for x in seen)
        assert max(abs(a - b) for a, b in zip(seen, expected)) < 1e-5, \
            f"{case.name}: replica {replica} losses {seen}, reference {expected}"
    far = ", ".join(f"the {other} rule: {d:.2e}" for other, d in distances.items())
    print(f"\n{case.name}: relative error {error:.2e} ({far})")
    return error


# ---- 1. synchronous schedules -----------------------------------------------------------------

def test_synchronous_schedules_match_reference_and_megatron(launch):
    """flush, gpipe and naive equal the PP=1 gradient-accumulation reference and Megatron's
    own 1F1B (which is checked against the same reference first)."""
    group = f"sync-world{SYNC_CASES[0].world}"
    launch.finished(group)
    megatron = SYNC_CASES[-1]
    _check_against_reference(launch, megatron)
    megatron_weights, megatron_losses = _gather(launch.out, megatron)
    for case in SYNC_CASES[:-1]:
        _check_against_reference(launch, case)
        weights, losses = _gather(launch.out, case)
        error = relative_error(weights, megatron_weights)
        print(f"{case.name}: relative error {error:.2e} against Megatron's schedule")
        assert error <= TOLERANCE, f"{case.name} vs megatron: {error:.3g}"
        for replica, seen in losses.items():
            assert seen == pytest.approx(megatron_losses[replica], rel=1e-6, abs=0)


@pytest.mark.parametrize("case", ZBH1_CASES, ids=lambda case: case.name)
def test_zbh1_matches_gradient_accumulation(launch, case):
    """ZB-H1 with m = d: each W runs after its I, most of them after later microbatches'
    forwards; the parameter gradients still sum once per microbatch (DDP's hooks fire in W
    only), so the weights are the PP=1 gradient-accumulation reference's."""
    launch.finished(f"sync-world{case.world}")
    _check_against_reference(launch, case)


# ---- 2. 2BW ------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", TWOBW_CASES, ids=lambda case: case.name)
def test_2bw_matches_delayed_update_reference(launch, case):
    """Every case clips (MODEL.clip_grad), so every stage defers its step unless told not to;
    the reference applies each step at once."""
    launch.finished(f"2bw-world{case.world}")
    modes = {torch.load(path)["step_mode"] for path in (launch.out / case.name).glob("rank*.pt")}
    expected = "deferred" if case.deferred else \
        "at the loop's optimizer.step() (--no-deferred-step)"
    assert modes == {expected}, f"{case.name}: optimizer step {modes}"
    _check_against_reference(launch, case)


# ---- 2b. PipeDream with weight stashing -----------------------------------------------------

@pytest.mark.parametrize("case", PIPEDREAM_CASES, ids=lambda case: case.name)
def test_pipedream_matches_per_stage_update_reference(launch, case):
    """Each stage's step after its own backwards of a batch; the look-ahead forwards of the
    batch read the stage's previous version (tests/reference.py's "pipedream" rule)."""
    launch.finished(f"2bw-world{case.world}")
    _check_against_reference(launch, case)


# ---- 2c. virtual stages (interleaved) ---------------------------------------------------------

@pytest.mark.parametrize("case", INTERLEAVED_CASES, ids=lambda case: case.name)
def test_interleaved_schedules_match_their_references(launch, case):
    """Two model chunks per stage (chunk c of stage s holds layer 2c + s of the PP=1 model):
    interleaved flush gives the gradient-accumulation reference's weights, 2BW-interleaved the
    1-stale reference's, its step deferred over both chunks (clipping and tied embeddings) or
    run where the loop calls it."""
    launch.finished(f"{'sync' if case.rule == 'sync' else '2bw'}-world{case.world}")
    if case.schedule == "2bw":
        modes = {torch.load(path)["step_mode"]
                 for path in (launch.out / case.name).glob("rank*.pt")}
        assert modes == ({"deferred"} if case.deferred else
                         {"at the loop's optimizer.step() (--no-deferred-step)"}), modes
    _check_chunk_overlaps(launch, case)
    _check_against_reference(launch, case)


def _check_chunk_overlaps(launch: Launch, case: Case) -> None:
    """Runs of several chunks per stage: with --no-align-grad-reduce each chunk's last backward
    launched its own reductions (from DDP's hooks); with --overlap-param-gather the schedule
    launched every chunk's all-gathers once per call, none after a pre-hook had."""
    if "--no-align-grad-reduce" in case.flags:
        assert all(torch.load(path)["hooks_reduced"]
                   for path in (launch.out / case.name).glob("rank*.pt"))
    if "--overlap-param-gather" in case.flags:
        for path in (launch.out / case.name).glob("rank*.pt"):
            gathers = torch.load(path)["param_gathers"]
            assert gathers == [{"launched": case.iters, "late": 0}] * len(gathers) \
                and len(gathers) > 1, (path, gathers)


# ---- 2d. V-shape schedules (ZB-V, DualPipeV) ---------------------------------------------------

@pytest.mark.parametrize("case", V_CASES, ids=lambda case: case.name)
def test_v_schedules_match_gradient_accumulation(launch, case):
    """Stage 0 embeds (chunk 0) and computes the loss (chunk 1); stage 1 turns the V without a
    transfer. Split backwards, W's from a queue (DualPipeV) or by order (ZB-V): the weights
    are the PP=1 gradient-accumulation reference's, the losses its losses, seen on stage 0;
    with two replicas each chunk's gradients are reduced (reduce-scattered, and its shard's
    update all-gathered, under the distributed optimizer) once its last I and W are done."""
    launch.finished(f"2bw-world{case.world}")
    shards = [torch.load(path) for path in (launch.out / case.name).glob("rank*.pt")]
    assert {s["pp"] for s in shards if s["losses"]} == {0}
    _check_chunk_overlaps(launch, case)
    _check_against_reference(launch, case)


# ---- 2e. PipeMare (no weight stashing) ---------------------------------------------------------

@pytest.mark.parametrize("case", PIPEMARE_CASES, ids=lambda case: case.name)
def test_pipemare_matches_its_reference(launch, case):
    """The look-ahead forwards read the stage's previous version and their backwards the
    newest (tests/reference.py's "pipemare" rule); the stashing rule (pipedream) is far."""
    launch.finished(f"2bw-world{case.world}")
    _check_against_reference(launch, case)


def test_pipemare_reference_with_one_stage_is_the_synchronous_one(launch):
    """tests/reference.py's "pipemare" rule (here with T2 and W) at d=1: no look-ahead
    forward, every pass reads W(t), so it gives the "sync" rule's weights."""
    one = PIPEMARE_ONE_STAGE
    error = relative_error(_reference(launch.out, one.reference())["weights"],
                           _reference(launch.out, one.reference("sync"))["weights"])
    assert error <= TOLERANCE, f"{one.reference()}: {error:.3g} from the sync rule"


# ---- 3. four stages, every schedule -------------------------------------------------------------

def test_four_stage_runs_of_every_schedule_finish(launch):
    """Each schedule finishes 10 iterations on 4 stages within the group's deadline, with
    finite losses on the last stage; the weights also match the references."""
    launch.finished("four-stages")
    for case in FOUR_STAGE_CASES:
        _, losses = _gather(launch.out, case)
        assert len(losses[0]) == case.iters and all(math.isfinite(x) for x in losses[0]), losses
        _check_against_reference(launch, case)


# ---- 4. a failing send ends every rank ----------------------------------------------------------

ERROR_LINE = re.compile(r"^error: pipeline stage (\d+) failed at step (\{[^}]*\}|\S+) ",
                        re.MULTILINE)


@pytest.mark.parametrize("group", sorted(FAILURES))
def test_failed_send_ends_every_rank_with_an_error(launch, group):
    """No launcher kills anyone here: each rank must end by itself, non-zero, and print the
    executor's error line and its action grid with the failing action marked."""
    case, stage, _ = FAILURES[group]
    result = launch.group(group)
    assert not result["timed_out"], f"{group}: ranks still running at the deadline: {result}\n" \
                                    f"{launch.log(group)}"
    assert all(code not in (0, None) for code in result["exit_codes"]), result
    for rank in range(case.world):
        text = (launch.out / group / f"rank{rank}.log").read_text()
        errors = ERROR_LINE.findall(text)
        assert errors and int(errors[0][0]) == rank, f"rank {rank} of {group}:\n{text[-3000:]}"
        assert "<-- ERROR HERE" in text
    failing = (launch.out / group / f"rank{stage}.log").read_text()
    assert "injected failure" in failing
    print(f"\n{group}: all {case.world} ranks ended in {result['seconds']:.1f} s")


def test_failed_send_under_torchrun_returns_nonzero(launch, tmp_path):
    """The same failure under torchrun: it returns non-zero soon after the failure (start-up of
    4 processes takes most of the time on 2 cores) and its output holds the error line."""
    case, stage, send = FAILURES["send-fails"]
    spec = {"out": str(tmp_path), "init": str(launch.out / "init.pt"), "timeout_minutes": 1.0,
            "groups": {"fail": {"world": case.world,
                                "runs": [{**case.run(), "fail": {"stage": stage, "send": send}}]}}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={case.world}", str(WORKER), str(tmp_path / "spec.json"),
               "--group", "fail"]
    code, output, seconds = _run_bounded(command, timeout_s=240)
    ended = time.time()
    assert code != 0, output[-4000:]
    match = re.search(rf"^error: pipeline stage {stage} failed at step \{{sa2:2 rg0:2\}} ",
                      output, re.MULTILINE)
    assert match, output[-4000:]
    failed_at = float(re.search(r"injected failure at unix time ([\d.]+)", output).group(1))
    print(f"\ntorchrun: exit code {code} after {seconds:.1f} s, "
          f"{ended - failed_at:.1f} s after the failure")
    assert ended - failed_at < 60, f"torchrun ended {ended - failed_at:.1f} s after the failure"


# ---- 5. a stalled peer ends its neighbours within --distributed-timeout-minutes --------------

def test_stalled_peer_ends_its_neighbour_with_one_line(launch, tmp_path):
    """Stage 1 of a 2-stage 2BW run freezes (SIGSTOP) at its 6th exchange. Stage 0 waits for it
    at most --distributed-timeout-minutes (0.1 here, 6 s), then ends by itself, non-zero, with
    one error line naming the peer (rank 1, stage 1) and the transfers it waited for. The
    launcher kills the frozen process once it is the only one left."""
    case = Case("2bw", d=2, m=2, w=1, iters=3)
    spec = {"out": str(tmp_path), "init": str(launch.out / "init.pt"), "timeout_minutes": 0.1,
            "groups": {"stall": {"world": 2, "timeout_s": 40,
                                 "runs": [{**case.run(), "stall": {"stage": 1, "exchange": 6}}]}}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    # strict mode off: its rendezvous would end stage 0's send before the batch is issued, and
    # this test is about the wait on the issued transfers (as under NCCL)
    code, output, _ = _run_bounded([sys.executable, str(WORKER), str(tmp_path / "spec.json")],
                                   timeout_s=180, MEGATRON_2BW_STRICT="0")
    assert code == 0, output[-4000:]
    result = json.loads((tmp_path / "launch.json").read_text())["stall"]
    assert result["exit_codes"][0] == 1 and result["exit_codes"][1] == -9, result
    waiting = (tmp_path / "stall" / "rank0.log").read_text()
    stopped = (tmp_path / "stall" / "rank1.log").read_text()
    line = re.search(r"^error: pipeline stage 0 failed at step (\{[^}]*\}) .*$", waiting,
                     re.MULTILINE)
    assert line and "stopping at" in stopped, waiting[-3000:]
    assert "waiting on rank 1 (stage 1)" in line.group(0), line.group(0)
    assert "--distributed-timeout-minutes 0.1" in line.group(0), line.group(0)
    print(f"\nstage 0: {line.group(0)[:300]}")
