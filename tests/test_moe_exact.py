"""Mixture-of-Experts GPTs under every schedule on real megatron-core models over gloo, against
single-process references, as tests/test_schedules_exact.py checks the dense models.

The reference holds every expert in one process (EP = 1, no pipeline); the runs are PP = 2 x EP
= 2 on 4 processes. Each run's weights lie within 1e-6 of its rule's reference (synchronous,
2BW's 1-stale, PipeDream's, PipeMare's) and far from the other rule's, and its losses (aux
losses included) are the reference's. Guards: expert parallelism and the dispatcher change
nothing in the update rule. The model, the variants and the extra checks: docs/testing.md, "What
each test module checks", test_moe_exact.py; docs/moe.md.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.test_schedules_exact import (Case, Launch, _check_against_reference, _far_references,
                                        groups_by_world, launch_worker, reference_job)

BASE = (("num_moe_experts", 4), ("moe_router_topk", 2), ("moe_ffn_hidden_size", 32),
        ("moe_aux_loss_coeff", 0.1), ("moe_z_loss_coeff", 0.01),
        ("moe_token_dispatcher_type", "alltoall"))
"""The MoE model of most cases (megatron-core config fields)."""
MIXED = (("num_moe_experts", 4), ("moe_router_topk", 2), ("moe_ffn_hidden_size", 32),
         ("moe_layer_freq", 2), ("moe_shared_expert_intermediate_size", 32),
         ("moe_router_load_balancing_type", "seq_aux_loss"), ("moe_aux_loss_coeff", 0.1),
         ("moe_expert_capacity_factor", 1.0), ("moe_token_dispatcher_type", "allgather"))
"""Dense and MoE layers alternating, a shared expert, the sequence-level aux loss, token
dropping at capacity factor 1, the allgather dispatcher."""
BIAS = (("num_moe_experts", 4), ("moe_router_topk", 2), ("moe_ffn_hidden_size", 32),
        ("moe_router_score_function", "sigmoid"), ("moe_router_enable_expert_bias", True),
        ("moe_router_bias_update_rate", 0.05), ("moe_router_load_balancing_type", "none"),
        ("moe_token_dispatcher_type", "alltoall"))
"""Aux-loss-free balancing: a sigmoid router whose expert bias moves after each batch."""


def _moe(schedule: str, model=BASE, tag: str = "moe", **kwargs) -> Case:
    fields = dict(d=2, m=4, w=2, iters=5 if schedule not in ("2bw", "pipedream", "pipemare")
                  else 6, ep=2, llama=True, tie=False)
    fields.update(kwargs)
    return Case(schedule, moe=model, tag=tag, **fields)


TWO_CHUNKS = ("--num-virtual-stages-per-pipeline-rank", "2")
DISTOPT = ("--use-distributed-optimizer",)
SYNC_CASES = [_moe(s) for s in ("flush", "megatron", "gpipe", "naive", "zb-h1")] + [
    _moe("zb-v"), _moe("dualpipev"),
    _moe("flush", flags=TWO_CHUNKS), _moe("megatron", flags=TWO_CHUNKS),
    _moe("flush", model=MIXED, tag="mixed"),
    _moe("zb-h1", model=MIXED, tag="mixed"),
    _moe("flush", model=BIAS, tag="bias"),
    _moe("zb-h1", model=BIAS, tag="bias"),
]
TWOBW_CASES = [
    _moe("2bw", tie=True, clip=0.3),  # deferred: the tied embedding's all-reduce, then two
    # norms (each clipping step: the norm is about 0.55)
    _moe("2bw", deferred=False),
    _moe("2bw", clip=0.0),  # deferred without clipping: no grad-norm all-reduce at all
    _moe("2bw", model=MIXED, tag="mixed"),
    _moe("2bw", flags=TWO_CHUNKS),
    _moe("2bw", flags=DISTOPT),
    _moe("pipedream"),
    _moe("pipemare"),
]
OPTIMIZER_CASES = [  # launched as a group of their own (a fresh set of processes)
    # Muon per expert matrix (megatron-core's expert optimizer over the expert groups) and on
    # the router's weight (a 2-D hidden-layer weight to megatron-core's split)
    _moe("flush", optimizer="muon"),
    _moe("2bw", optimizer="muon"),
    _moe("2bw", optimizer="muon", correction="ef", coeff=2.0),  # on both Muon members' steps
    _moe("2bw", correction="predict", flags=DISTOPT),  # the experts' versions predicted too
    _moe("2bw", correction="dc", coeff=1000.0, deferred=False),
    # Muon's state dealt out by parameter (dist_muon): at EP = 2 each replica steps its own
    # experts whole (summed with the dense parameters, predict's R added the two replicas'
    # different experts); at EP = 1 the experts are dealt over their 2 data-parallel ranks
    _moe("2bw", optimizer="muon", flags=DISTOPT, correction="predict"),
    _moe("2bw", optimizer="muon", ep=1, flags=DISTOPT, correction="ef", coeff=2.0),
]
SYNC_CASES += [case for case in OPTIMIZER_CASES if case.schedule != "2bw"]
TWOBW_CASES += [case for case in OPTIMIZER_CASES if case.schedule == "2bw"]
CASES = SYNC_CASES + TWOBW_CASES


def _chain_length(case: Case) -> int:
    """Optimizers in megatron-core's chain: Adam for the dense and the expert parameters, or
    Muon for the dense and the expert matrices and Adam for the rest (no expert among them)."""
    return 3 if case.optimizer == "muon" else 2


def _reference_jobs() -> dict:
    jobs = {}
    for case in CASES:
        jobs[case.reference()] = reference_job(case, case.rule)
        for job in (job for job, _ in _far_references(case).values()):
            rule = job.split("-")[0]
            jobs[job] = reference_job(case, rule)
    return jobs


FROM_SEED = _moe("flush", iters=1, tag="moe-from-seed")
"""Built from --seed (no initial weights loaded): its experts as drawn."""
A2A = _moe("zb-h1", iters=2, tag="moe-a2a")
"""zb-h1 whose all-to-alls are counted by the pass that issues them."""


def _kind(case: Case) -> str:
    """The launch group's name part of ``case``: groups of fewer runs each start fresh
    processes (each run there leaves ~50 gloo threads behind, and a group of all the cases
    slowed from 3 s to 18 s a run)."""
    if case in OPTIMIZER_CASES:
        return "optimizers-"
    return "stale-" if case in TWOBW_CASES else ""


def _group(case: Case) -> str:
    """The launch group ``case`` runs in."""
    return f"moe-{_kind(case)}world{case.world}"


def _groups() -> dict:
    groups: dict = {}
    for kind in ("", "stale-", "optimizers-"):
        groups.update(groups_by_world([c for c in CASES if _kind(c) == kind],
                                      f"moe-{kind}world"))
    runs = groups[f"moe-world{FROM_SEED.world}"]["runs"]
    runs.append({**FROM_SEED.run(), "from_seed": True})
    runs.append({**A2A.run(), "count_all_to_alls": True})  # last: its counters stay installed
    return groups


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Launch:
    return launch_worker(tmp_path_factory.mktemp("moe_exact"), _reference_jobs(), _groups(),
                         timeout_s=600)


@pytest.mark.parametrize("case", SYNC_CASES, ids=lambda case: case.name)
def test_synchronous_moe_runs_match_gradient_accumulation(launch, case):
    """PP = 2 x EP = 2: the weights and losses of the single-process gradient-accumulation
    reference (the run's experts gathered from both expert-parallel ranks)."""
    launch.finished(_group(case))
    _check_against_reference(launch, case)


@pytest.mark.parametrize("case", TWOBW_CASES, ids=lambda case: case.name)
def test_stale_moe_runs_match_their_rules(launch, case):
    """2BW's 1-stale update, PipeDream's and PipeMare's per-stage rules, with the expert and
    router weights in the version store. Under 2BW the step is deferred over the chain of the
    dense and the expert optimizer (and Muon's): with clipping each stage launches, per step,
    one norm all-reduce per chain member (each over its own grad-stats group; one for both with the
    distributed optimizer, whose members share the world as theirs); without clipping none
    (megatron-core's chain would all-reduce both norms every step)."""
    launch.finished(_group(case))
    shards = [torch.load(path) for path in sorted((launch.out / case.name).glob("rank*.pt"))]
    if case.schedule == "2bw":
        modes = {shard["step_mode"] for shard in shards}
        assert modes == ({"deferred"} if case.deferred else
                         {"at the loop's optimizer.step() (--no-deferred-step)"}), modes
        for shard in shards if case.deferred else ():
            norms = {what: n for what, n in shard["deferred_launched"].items()
                     if "grad-norm" in what}
            expected = {} if case.clip == 0.0 else {
                f"the grad-norm all-reduce over the grad-stats group (optimizer {i} of the "
                f"chain)": case.iters for i in range(_chain_length(case))}
            if "--use-distributed-optimizer" in case.flags and case.clip != 0.0:
                # megatron-core's distributed optimizers share one grad-stats group (all ranks)
                expected = {"the grad-norm all-reduce over the grad-stats group": case.iters}
            assert norms == expected, (shard["pp"], norms)
    _check_against_reference(launch, case)


def test_experts_start_alike_whatever_the_expert_parallel_size(launch):
    """An EP = 2 model built from --seed: each expert-parallel rank holds different experts,
    and every expert equals the one an EP = 1, PP = 1 model from the same seed draws (the
    reference's initial weights): drawn by global index, not by expert-parallel rank. With
    megatron-core's CPU initialization alone, experts 0 and 2 (local expert 0 of each rank)
    would be equal."""
    from tests.reference import Model, init_prefix, initial_weights_of

    launch.finished(f"moe-world{FROM_SEED.world}")
    init = initial_weights_of(torch.load(launch.out / "init.pt"),
                              Model(**{**FROM_SEED.model, "moe": dict(BASE)}))
    experts: dict = {}
    for path in sorted((launch.out / FROM_SEED.name).glob("rank*.pt")):
        for name, (tensor, _) in torch.load(path)["initial_params"].items():
            if ".experts.local_experts." in name:
                assert name not in experts or torch.equal(experts[name], tensor), name
                experts[name] = tensor
    assert init_prefix(Model(moe=dict(BASE), llama=True)).startswith("moe")
    expected = {n: t for n, t in init.items() if ".experts.local_experts." in n}
    assert sorted(experts) == sorted(expected) and len(experts) == 4 * 4 * 2  # layers x E x fc
    for name, tensor in experts.items():
        assert torch.equal(tensor, expected[name]), f"{name} differs from the EP = 1 draw"
    for layer in range(4):
        for fc in ("linear_fc1", "linear_fc2"):
            weights = [experts[f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{fc}.weight"]
                       for e in range(4)]
            assert all(not torch.equal(weights[a], weights[b])
                       for a in range(4) for b in range(a + 1, 4)), (layer, fc)


LOGGED = [case for case in CASES if case.schedule in ("flush", "2bw", "zb-v") and not case.flags
          and case.deferred and case.tag != "bias"]


@pytest.mark.parametrize("case", LOGGED, ids=lambda case: case.name)
def test_load_balancing_losses_are_logged_as_megatron_lm_logs_them(launch, case):
    """Each iteration's logged load-balancing and z losses (training.moe.moe_metrics, as the
    training loop logs them) equal the reference's for that batch: per MoE layer the mean over
    the batch's microbatches, summed over the layers and divided by their number; averaged
    over the data-parallel replicas for the load-balancing losses (their router's reduce
    group has none), the logging replica's own for z_loss (megatron-core reduces it over the
    pipeline only). Under 2bw a call runs forwards of the next batch too; the values are still
    the batch's (booked by batch, not by call)."""
    launch.finished(_group(case))
    expected = torch.load(launch.out / f"{case.reference()}.pt")["aux_losses"]
    shards = [torch.load(path) for path in sorted((launch.out / case.name).glob("rank*.pt"))]
    logged = {shard["dp"]: shard["logged"] for shard in shards if shard["logged"]}
    assert sorted(logged) == list(range(case.w)) and len(expected) == case.iters
    names = set(expected[0][0])
    assert names == set(logged[0][0]) - {"lm loss"}, (names, logged[0][0])
    for replica, run in logged.items():
        assert len(run) == case.iters
        for t, (seen, replicas) in enumerate(zip(run, expected)):
            for name in names:
                want = replicas[replica][name] if name == "z_loss" else \
                    sum(r[name] for r in replicas) / len(replicas)
                assert seen[name] == pytest.approx(want, rel=1e-5), (t, name, seen, want)
    print(f"\n{case.name}: " + ", ".join(f"{n} {logged[0][-1][n]:.6f}" for n in sorted(names)))


def test_zero_bubble_keeps_the_all_to_alls_in_the_input_gradient_pass(launch):
    """zb-h1 on the MoE model: the weight-gradient passes (W) run the experts' GEMMs (every
    local expert's fc1 and fc2 of each microbatch) and no collective; the token dispatch's
    all-to-alls of the backward run in the input-gradient passes (I), as many as the forwards
    issue: 3 per MoE layer and microbatch in megatron-core 0.16.1's alltoall dispatcher (the
    tokens and their routing probabilities dispatched, the experts' outputs combined)."""
    launch.finished(f"moe-world{A2A.world}")
    for path in sorted((launch.out / A2A.name).glob("rank*.pt")):
        counts = torch.load(path)["all_to_alls"]
        microbatches = A2A.m * A2A.iters
        layers = 4 // A2A.d  # every layer an MoE layer, this stage's
        assert counts["W"] == 0, counts
        assert counts["I"] == counts["other"] == 3 * layers * microbatches, counts
        # each W ran its stage's experts' fc1 and fc2 GEMMs (2 local experts x 2 per layer)
        assert counts["W_expert_gemms"] == layers * 2 * 2 * microbatches, counts
