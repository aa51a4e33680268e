"""WeightVersions and PipeMare's discrepancy correction on one tiny layer, no processes.

The layer is megatron-core's linear function (what its ColumnParallel/RowParallelLinear run):
it saves the weight Parameter itself, so a backward unpacks it at its current ``.data``, the
storage the executor points it at (torch's own ``F.linear`` saves a transposed view instead,
which keeps the forward's storage: PipeMare without stashing relies on megatron's layers).
References: the gradient of y = x W^T is dx = g W (the W the backward reads) and dW = g^T x;
delta follows its recurrence computed here by hand.
"""

from __future__ import annotations

import pytest
import torch

from megatron_2bw.discrepancy import DiscrepancyCorrection
from megatron_2bw.weights import WeightVersions


class _Linear(torch.nn.Module):
    """y = x W^T through megatron-core's linear autograd function (no bias, no TP)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.layers import (
            linear_with_grad_accumulation_and_async_allreduce as linear)

        return linear(x, self.weight, None, gradient_accumulation_fusion=False,
                      allreduce_dgrad=False, sequence_parallel=False)


def _layer() -> _Linear:
    torch.manual_seed(0)
    return _Linear()


def _step(versions: WeightVersions, layer: _Linear, new_version: int,
          shift: float) -> None:
    """An in-place optimizer step: fork, then write W + shift into the home slot."""
    versions.fork(new_version)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(shift)
    versions.after_step()


def test_a_backward_reads_the_parameters_current_storage():
    """The executor's PipeMare backward: a forward at version 0, then ``use(1)`` before the
    backward. The saved weight is unpacked at its current ``.data`` (version 1), so dx = g W1;
    dW = g^T x does not depend on W."""
    layer = _layer()
    versions = WeightVersions(layer.parameters())
    w0 = layer.weight.detach().clone()
    x = torch.randn(4, 3, requires_grad=True)
    g = torch.randn(4, 2)
    versions.fork(1)  # version 0 moves to the spare slot: the forward reads it there
    versions.use(0)
    y = layer(x)
    with torch.no_grad():
        for p in versions.tensors_of(1):
            p.add_(0.5)
    versions.use(1)
    y.backward(g)
    assert torch.allclose(x.grad, g @ (w0 + 0.5))
    assert not torch.allclose(x.grad, g @ w0)
    assert torch.allclose(layer.weight.grad, g.T @ x.detach())


def test_the_corrected_backward_reads_the_derived_weights():
    """``use_derived`` points the parameters at weights made from the newest version in the
    spare slot (the older version there is retired); a backward then reads them; ``fork``
    refills the slot with the newest version."""
    layer = _layer()
    versions = WeightVersions(layer.parameters())
    _step(versions, layer, 1, shift=0.5)
    w1 = layer.weight.detach().clone()
    x = torch.randn(4, 3, requires_grad=True)
    g = torch.randn(4, 2)
    y = layer(x)
    made = []

    def minus_quarter(newest, out):
        made.append(1)
        for w, dst in zip(newest, out):
            torch.sub(w, 0.25, out=dst)

    versions.use_derived(1, "corrected", minus_quarter)
    versions.use_derived(1, "corrected", minus_quarter)  # made once
    assert made == [1] and versions.alive == [1]
    y.backward(g)
    assert torch.allclose(x.grad, g @ (w1 - 0.25))
    versions.use(1)
    assert torch.equal(layer.weight.data, w1)
    with pytest.raises(ValueError, match="only from the newest"):
        versions.use_derived(0, "corrected", minus_quarter)
    _step(versions, layer, 2, shift=1.0)
    assert versions.alive == [1, 2]
    versions.use(1)
    assert torch.equal(layer.weight.data, w1)  # the corrected copy is gone


def test_discrepancy_delta_follows_its_recurrence():
    """delta(t+1) = gamma delta(t) + (1 - gamma) (W(t+1) - W(t)), gamma = D ** (1/s); steps of
    +0.5 then +1.0 with D = 0.25, s = 2 (gamma = 0.5): delta = 0.25, then 0.625; the corrected
    weights with scale 2 are W(2) - 1.25."""
    layer = _layer()
    versions = WeightVersions(layer.parameters())
    correction = DiscrepancyCorrection(versions, decay=0.25, span=2)
    w0 = layer.weight.detach().clone()
    _step(versions, layer, 1, shift=0.5)
    correction.track()
    correction.track()  # once per version
    assert torch.allclose(correction.delta[0], torch.full_like(w0, 0.25))
    _step(versions, layer, 2, shift=1.0)
    correction.use(2, scale=2)  # tracks version 2 first
    assert torch.allclose(correction.delta[0], torch.full_like(w0, 0.625))
    assert torch.allclose(layer.weight.data, w0 + 1.5 - 1.25)
    versions.fork(3)  # a version not tracked before the next fork: refused
    versions.after_step()
    versions.fork(4)
    with pytest.raises(RuntimeError, match="a step was not tracked"):
        correction.track()


def test_discrepancy_delta_of_bf16_weights_keeps_learning_rate_sized_steps():
    """In bf16 (the weights' dtype), delta is kept in fp32, as megatron-core keeps main
    parameters: bf16 weights moved by learning-rate-sized steps (Adam at lr 1e-4: every element
    by about lr per step), D = 0.99, s = 1 (gamma = 0.99), against the recurrence over the same
    bf16 weights computed here in fp64. A bf16 delta rounds each (1 - gamma) (W(t+1) - W(t))
    against its own rounding step (about 0.4 % of delta) and loses most of it."""
    lr, gamma, steps = 1e-4, 0.99, 60
    torch.manual_seed(0)
    weight = torch.nn.Parameter((0.02 * torch.randn(64)).to(torch.bfloat16))
    versions = WeightVersions([weight])
    correction = DiscrepancyCorrection(versions, decay=gamma, span=1)
    signs = torch.where(torch.rand(steps, 64) < 0.8, 1.0, -1.0)  # a drift, with noise
    expected = torch.zeros(64, dtype=torch.float64)
    for t in range(steps):
        before = weight.detach().double()
        versions.fork(t + 1)
        with torch.no_grad():  # an optimizer writing the new bf16 version
            weight.copy_((weight.float() - lr * signs[t]).to(torch.bfloat16))
        versions.after_step()
        correction.track()
        expected = gamma * expected + (1 - gamma) * (weight.detach().double() - before)
    assert expected.abs().max() > 1e-5  # the steps are there to keep
    torch.testing.assert_close(correction.delta[0].double(), expected, rtol=1e-5, atol=1e-9)
    assert correction.delta[0].dtype == torch.float32
    correction.use(steps, scale=2)  # the corrected weights: rounded to bf16 once
    newest = versions.tensors_of(steps)[0]
    assert weight.data.dtype == torch.bfloat16
    assert torch.equal(weight.data, (newest.float() - 2 * correction.delta[0]).to(torch.bfloat16))


def test_n_slots_keep_what_pipedream_reads_at_m_1():
    """PipeDream at m = 1 on stage 0 of d = 4 (an update per microbatch): microbatch k's
    forward and stashed backward read W(k - 3), and its backward runs before step k + 1, so
    after step v the store keeps W(v-3..v): 4 slots, each version's weights intact while newer
    ones are written (W(v) = W(0) + v here). Microbatch 4 forwards with W(1) before step 2 and
    runs its backward after step 4: it reads W(1) (dx = g W(1))."""
    layer = _layer()
    w0 = layer.weight.detach().clone()
    versions = WeightVersions(layer.parameters(), keep_from=lambda new: max(new - 3, 0))
    x, g = torch.randn(4, 3, requires_grad=True), torch.randn(4, 2)
    for v in range(1, 9):
        if v == 2:
            versions.use(1)
            y = layer(x)
        if v == 5:
            versions.use(1)
            y.backward(g)
            assert torch.allclose(x.grad, g @ (w0 + 1))
        _step(versions, layer, v, shift=1.0)
        assert versions.alive == list(range(max(v - 3, 0), v + 1)), v
        for alive in versions.alive:
            assert torch.allclose(versions.tensors_of(alive)[0], w0 + alive), (v, alive)
    assert len([slot for slot in versions.slots if slot is not None]) == 4
