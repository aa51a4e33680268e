"""``ef``, ``dc`` and ``predict`` on the fp32 master copies of 16-bit weights, against plain torch.

A megatron-core transformer layer in bf16 or fp16 with megatron-core's mixed-precision Adam and
2BW's version store with ``ErrorFeedback`` (or ``DelayCompensation``) bound to the optimizer
takes 4 steps on fixed gradients, one of them optionally skipped for an inf. The reference steps
fp32 masters with torch.optim.Adam and applies the correction rule itself. Prints one JSON line:
the masters' relative error against the reference, their distance from the uncorrected
reference, the steps skipped, and whether the 16-bit weights are the masters rounded
(``predict``: how far the store's 16-bit R(4) lies from the reference's). The set-up and the
rules written out: docs/testing.md, "What each test module checks", master_ef_worker.py.

    python tests/master_ef_worker.py [bf16|fp16] [SKIPPED_STEP|-] [ef|dc|predict]
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BETA, LAMBDA, SCALE, STEPS = 2.0, 1e3, 1.0, 4


def _megatron_layer(precision: str):
    """(DDP-wrapped bf16 layer, its optimizer), one process on the CPU."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from megatron_2bw.planner import ModelSpec, measure
    from megatron_2bw.runtime.device import select_device
    from megatron_2bw.runtime.ports import free_port
    from megatron_2bw.training import build

    select_device(True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    model = ModelSpec("gpt", 1, 32, 4, 16, 64, dropout=False)
    args = measure._training_args(model, precision, cpu=True)
    args.clip_grad, args.weight_decay, args.lr, args.loss_scale = 0.0, 0.0, 1e-2, 1.0
    block, config = measure._block(args, model, "cpu", 1, False)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        Float16Module(config, block))
    return ddp, build.build_optimizer(args, [ddp]), args


def main() -> None:
    import torch

    from megatron_2bw.corrections import DelayCompensation, ErrorFeedback
    from megatron_2bw.deferred import members
    from megatron_2bw.weights import WeightVersions

    precision = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    skipped = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "-" else None
    rule = sys.argv[3] if len(sys.argv) > 3 else "ef"
    ddp, optimizer, args = _megatron_layer(precision)
    if rule == "predict":
        return _predict(ddp, optimizer, args, precision, skipped)
    inner = members(optimizer)[0]
    weights = [p for group in inner.float16_groups for p in group]
    masters = [p for group in inner.fp32_from_float16_groups for p in group]
    versions = WeightVersions(list(ddp.parameters()), keep_from=lambda v: v - 1)
    if rule == "ef":
        ErrorFeedback(versions, optimizer, BETA)
    else:
        DelayCompensation(versions, optimizer, LAMBDA)
    corrected = [m.detach().clone() for m in masters]
    plain = [m.detach().clone() for m in masters]
    references = [(corrected, torch.optim.Adam(corrected, lr=args.lr,
                                               betas=(args.adam_beta1, args.adam_beta2),
                                               eps=args.adam_eps), BETA),
                  (plain, torch.optim.Adam(plain, lr=args.lr,
                                           betas=(args.adam_beta1, args.adam_beta2),
                                           eps=args.adam_eps), 0.0)]
    step_of = _reference_step if rule == "ef" else _reference_dc_step
    last, taken, skips = [None, None], 0, []
    generator = torch.Generator().manual_seed(7)
    for t in range(STEPS):
        grads, succeeded = _megatron_step(versions, ddp, optimizer, weights, generator, t,
                                          skipped)
        skips.append(not succeeded)
        if not succeeded:
            continue
        for k, (params, adam, beta) in enumerate(references):
            last[k] = step_of(params, adam, grads, beta, last[k], taken)
        taken += 1
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    print(json.dumps({
        "error": _relative(masters, corrected),
        "from_plain": _relative(corrected, plain), "skipped": skips,
        "rounded": all(torch.equal(w, m.to(dtype)) for w, m in zip(weights, masters))}))


def _megatron_step(versions, ddp, optimizer, weights, generator, t: int, skipped: int | None):
    """Step ``t`` of megatron-core's optimizer on a new version, from fixed random gradients
    (an inf in step ``skipped``'s): (the gradients, whether it stepped)."""
    import torch

    versions.fork(t + 1)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    grads = [torch.randn(w.shape, generator=generator) * 1e-2 for w in weights]
    if t == skipped:
        grads[0].view(-1)[0] = float("inf")
    for w, g in zip(weights, grads):
        w.main_grad.copy_(g)
    succeeded, _, _ = optimizer.step()
    return grads, succeeded


def _predict(ddp, optimizer, args, precision: str, skipped: int | None) -> None:
    """predict's R(4) from the fp32 masters against the plain-torch reference's."""
    import torch

    from megatron_2bw.corrections import PredictedVersions
    from megatron_2bw.deferred import members

    inner = members(optimizer)[0]
    weights = [p for group in inner.float16_groups for p in group]
    versions = PredictedVersions(list(ddp.parameters()), lambda v: v - 1, SCALE).watch(optimizer)
    reference = [m.detach().clone() for group in inner.fp32_from_float16_groups for m in group]
    adam = torch.optim.Adam(reference, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                            eps=args.adam_eps)
    generator, skips = torch.Generator().manual_seed(7), []
    for t in range(STEPS):
        older16 = [w.detach().clone() for w in weights]
        before = [m.detach().clone() for m in reference]
        grads, succeeded = _megatron_step(versions, ddp, optimizer, weights, generator, t,
                                          skipped)
        versions.after_update()
        skips.append(not succeeded)
        if succeeded:
            for m, g in zip(reference, grads):
                m.grad = g.clone()
            adam.step()
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    expected = [((1 + SCALE) * m - SCALE * b).to(dtype) for m, b in zip(reference, before)]
    index = {id(p): i for i, p in enumerate(versions.params)}
    made = [versions.tensors_of(versions.newest)[index[id(w)]] for w in weights]
    from_16_bit = [((1 + SCALE) * w.float() - SCALE * o.float()).to(dtype)
                   for w, o in zip(weights, older16)]
    print(json.dumps({
        "mismatched": _mismatched(made, expected),
        "mismatched_16_bit": _mismatched(from_16_bit, expected),
        "from_weights": _relative(made, weights), "skipped": skips}))


def _mismatched(ours, reference) -> float:
    """The fraction of elements of ``ours`` not equal to ``reference``'s."""
    return sum(int((a != b).sum()) for a, b in zip(ours, reference)) / \
        sum(b.numel() for b in reference)


def _reference_step(params, adam, grads, beta: float, last, t: int):
    """One Adam step of the reference, then ef's correction from the second step taken on
    (``t`` steps taken before it); returns U_t."""
    import torch

    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    adam.step()
    update = [b - p.detach() for b, p in zip(before, params)]
    if t >= 1:
        with torch.no_grad():
            for p, u, u_last in zip(params, update, last):
                p.sub_(u - u_last, alpha=beta)
    return update


def _reference_dc_step(params, adam, grads, on: float, last, t: int):
    """DC-ASGD's gradient g + lambda g * g * (W(t) - W(t-1)) from the second step taken on
    (``last``: W(t-1), the weights the last step taken started from), then one Adam step;
    returns W(t). ``on``: 0 for the uncorrected reference."""
    import torch

    before = [p.detach().clone() for p in params]
    for p, g, older in zip(params, grads, last or [None] * len(params)):
        p.grad = g.clone()
        if on and t >= 1:
            with torch.no_grad():
                p.grad.addcmul_(g * (p - older), g, value=LAMBDA)
    adam.step()
    return before


def _relative(ours, reference) -> float:
    diff = sum(float((a.double() - b.double()).norm()) ** 2 for a, b in zip(ours, reference))
    return math.sqrt(diff / sum(float(b.double().norm()) ** 2 for b in reference))


if __name__ == "__main__":
    main()
