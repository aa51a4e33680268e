"""The stale-weight corrections' rules and memory on a toy store (no processes), and the Muon
that runs without emerging-optimizers against torch.optim.Muon.

Each rule is checked against its formula written out here (megatron_2bw/corrections.py's
docstring), on a 2BW version store driven as the executor drives it: ``fork`` before a step,
the optimizer writes the home slot, ``after_update`` after it. Multi-process runs against the
single-process references are tests/test_optimizers_exact.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_2bw.corrections import StaleCorrection
from megatron_2bw.training.muon import BlockwiseMuon, newton_schulz

REPO = Path(__file__).resolve().parents[1]

STEPS = 5


def _store(rule: str, coeff: float = 0.5):
    """A 2BW store of one (3, 4) parameter under ``rule`` and its bound correction."""
    param = torch.nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
    correction = StaleCorrection(rule, coeff)
    versions = correction.versions([param], keep_from=lambda v: v - 1)  # 2BW's rule
    optimizer = SimpleNamespace(optimizer=torch.optim.SGD([param], lr=0.1))
    return param, versions, correction.bind(versions, optimizer), optimizer.optimizer


def _gradient(t: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + t))


def _step(param, versions, bound, optimizer, t: int) -> None:
    """Step t as 2BW runs it: fork, the optimizer's step, the correction after it."""
    versions.fork(t + 1)
    param.grad = _gradient(t)
    optimizer.step()
    if hasattr(bound, "after_update"):
        bound.after_update()
    versions.after_step()


def test_predict_reads_the_extrapolated_weights_from_three_slots():
    """Microbatches read R(v) = W(v) + s (W(v) - W(v-1)), R(0) = W(0); the optimizer steps W
    and evaluation reads it; three weight-sized slots in all."""
    param, versions, bound, optimizer = _store("predict", coeff=0.5)
    history = [param.detach().clone()]
    for t in range(STEPS):
        _step(param, versions, bound, optimizer, t)
        history.append(param.detach().clone())  # the optimizer's W(t+1), in the home slot
        for v in versions.alive:
            versions.use(v)
            expected = history[0] if v == 0 else history[v] + 0.5 * (history[v] - history[v - 1])
            torch.testing.assert_close(param.data, expected, rtol=0, atol=1e-6)
        versions.use_trained()
        torch.testing.assert_close(param.data, history[-1], rtol=0, atol=0)
    assert sum(slot is not None for slot in versions.slots) == 3


def test_ef_subtracts_the_change_of_the_update():
    """W(t+1) = W(t) - U_t - beta (U_t - U_{t-1}) from step 1 on, U_t = 0.1 g_t (SGD)."""
    param, versions, bound, optimizer = _store("ef", coeff=0.5)
    expected, last = param.detach().clone(), None
    for t in range(STEPS):
        _step(param, versions, bound, optimizer, t)
        update = 0.1 * _gradient(t)
        expected = expected - update - (0.5 * (update - last) if last is not None else 0)
        last = update
        torch.testing.assert_close(param.data, expected, rtol=0, atol=1e-6)
    assert sum(slot is not None for slot in versions.slots) == 2  # + U_{t-1}: one tensor more


def test_dc_compensates_the_gradient_with_the_kept_older_version():
    """The step's gradient is g + lambda g * g * (W(t) - W(t-1)); the store keeps W(t-1)
    through the step (three slots)."""
    param, versions, bound, optimizer = _store("dc", coeff=0.5)
    weights = [param.detach().clone()]
    for t in range(STEPS):
        _step(param, versions, bound, optimizer, t)
        g = _gradient(t)
        if t >= 1:
            g = g + 0.5 * g * g * (weights[t] - weights[t - 1])
        weights.append(weights[t] - 0.1 * g)
        torch.testing.assert_close(param.data, weights[-1], rtol=0, atol=1e-6)
    assert sum(slot is not None for slot in versions.slots) == 3


def test_dc_finds_a_distributed_optimizer_shard_in_its_parameter():
    """The distributed optimizer steps views of the weights' buffer: the compensation reads
    the matching elements of the older version."""
    param, versions, _, _ = _store("none")
    dc = StaleCorrection("dc", 2.0)
    versions = dc.versions([param], keep_from=lambda v: v - 1)
    shard = param.data.view(-1)[3:9]  # this rank's elements
    optimizer = torch.optim.SGD([shard], lr=0.1)
    dc.bind(versions, SimpleNamespace(optimizer=optimizer))
    before = {}
    for t in range(3):
        versions.fork(t + 1)
        before[t] = shard.detach().clone()
        shard.grad = _gradient(t).view(-1)[3:9].clone()
        g = shard.grad.clone()
        if t >= 1:
            g = g + 2.0 * g * g * (before[t] - before[t - 1])
        expected = before[t] - 0.1 * g
        optimizer.step()
        versions.after_step()
        torch.testing.assert_close(shard, expected, rtol=0, atol=1e-6)


def test_none_keeps_two_versions_and_binds_nothing():
    param, versions, bound, optimizer = _store("none")
    for t in range(STEPS):
        _step(param, versions, bound, optimizer, t)
    assert bound is None and sum(slot is not None for slot in versions.slots) == 2


# ---- Muon -------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision,bound", [("medium", 1e-6), ("high", 0.03)])
def test_blockwise_muon_is_torch_muon_with_megatron_core_momentum_and_scaling(precision, bound):
    """With shape scaling (torch's "original" learning-rate adjustment) and Nesterov, the
    update is torch.optim.Muon's: megatron-core's moving average is (1 - mu) times torch's
    momentum sum, which Newton-Schulz normalizes away. torch orthogonalizes in bf16, as this
    Muon does at medium precision (the default): the same weights but for the rounding of
    that scaling; at high precision this Muon's fp32 updates agree to bf16's precision."""
    shapes = [(16, 32), (48, 16)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
            for i, s in enumerate(shapes)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    mine = BlockwiseMuon(ours, lr=0.02, momentum_beta=0.9, use_nesterov=True, weight_decay=0.1,
                         scale_mode="shape_scaling", fp32_matmul_prec=precision)
    torch_muon = torch.optim.Muon(theirs, lr=0.02, momentum=0.9, nesterov=True,
                                  weight_decay=0.1, adjust_lr_fn="original")
    for t in range(3):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            a.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(10 * t + i))
            b.grad = a.grad.clone()
        mine.step()
        torch_muon.step()
    for a, b, w in zip(ours, theirs, start):
        moved, apart = float((b - w).detach().norm()), float((a - b).detach().norm())
        assert apart < bound * moved, (apart, moved)


def test_newton_schulz_gives_singular_values_near_one():
    """Five quintic steps put every singular value of a full-rank matrix in (0.5, 1.5)."""
    x = torch.randn(24, 40, generator=torch.Generator().manual_seed(3))
    for matrix in (x, x.t()):
        values = torch.linalg.svdvals(newton_schulz(matrix, 5))
        assert 0.5 < float(values.min()) and float(values.max()) < 1.5, values


@pytest.mark.parametrize("mode", ["duplicated", "distributed"])
def test_blockwise_muon_refuses_the_modes_that_need_emerging_optimizers(mode):
    with pytest.raises(ValueError, match="emerging-optimizers"):
        BlockwiseMuon([torch.nn.Parameter(torch.zeros(2, 2))], mode=mode)


@pytest.mark.parametrize("precision, skipped, rule", [
    ("bf16", None, "ef"), ("fp16", 0, "ef"), ("fp16", 2, "ef"), ("bf16", None, "dc"),
    ("fp16", 0, "dc"), ("bf16", None, "predict"), ("fp16", 3, "predict")])
def test_corrections_work_on_the_fp32_master_copies_of_16_bit_weights(precision, skipped, rule):
    """Under --bf16 and --fp16 ef and dc work where megatron-core's mixed-precision Adam
    steps, on the fp32 master copies (tests/master_ef_worker.py: a real layer, 4 steps on fixed
    gradients; dc keeps the masters' W(t-1) itself): they follow a plain-torch Adam reference
    with the correction applied by hand within 1e-6, lie away from the uncorrected reference,
    and the 16-bit weights are the masters rounded. A step megatron-core skips (an inf in the
    gradient, as fp16's loss scaling meets early on) changes nothing, and the correction starts
    at the second step taken: with the first step skipped, ef corrected from the second step
    made (the rule before) lay 0.26 away. predict's 16-bit R is (1 + s) W(t+1) - s W(t) of the
    masters rounded (made from the 16-bit versions, as before, 48% of its elements differ);
    after a skipped step R = W."""
    argv = [precision, "-" if skipped is None else str(skipped), rule]
    done = subprocess.run([sys.executable, str(REPO / "tests" / "master_ef_worker.py"), *argv],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if rule == "predict":
        assert result["mismatched"] < 1e-3, result
        last_skipped = skipped == 3  # R(4) = W(4): no difference to round
        assert last_skipped or result["mismatched_16_bit"] > 0.2, result
        assert (result["from_weights"] == 0) == last_skipped, result
        assert result["skipped"] == [step == skipped for step in range(4)], result
        return
    assert result["error"] < 1e-6 and result["from_plain"] > 1e-3, result
    assert result["rounded"], result
    assert result["skipped"] == [step == skipped for step in range(4)], result

