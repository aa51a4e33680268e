"""Loading megatron-core 0.16's DistributedOptimizer over torch's Adam (no Apex, no
transformer-engine), which keeps the Adam step count once per parameter
(``state[p]["step"]``) where Apex's and TE's fused Adam keep it once per parameter group.

megatron-core's load has two gaps there: an optimizer that has not stepped has no count, so
every resume fails on an assertion (:func:`allocate` gives it the state of a first step without
stepping); and the load shares ONE step tensor among all parameters, which torch's Adam then
advances once per parameter per step (:func:`restore` gives each its own tensor).

Invariant: both act only on a DistributedOptimizer whose inner optimizer is torch's
Adam/AdamW; with Apex's or TE's Adam megatron-core's own load is left as is.

The two gaps in detail: docs/checkpoints_and_faults.md, "Resuming the distributed optimizer
over torch's Adam".
"""

from __future__ import annotations

import torch

__all__ = ["allocate", "restore"]


def _torch_adam(optimizer) -> torch.optim.Optimizer | None:
    """The inner torch Adam/AdamW of a megatron-core DistributedOptimizer, else None."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(optimizer, DistributedOptimizer):
        return None
    inner = optimizer.optimizer
    return inner if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) else None


def _params(adam: torch.optim.Optimizer):
    return (p for group in adam.param_groups for p in group["params"])


def allocate(optimizer) -> None:
    """Before ``optimizer.sharded_state_dict(..., is_loading=True)``: an unstepped torch Adam
    gets the state its first step would create (step 0 as torch makes it, zero moments);
    the weights are untouched. A no-op for other optimizers and after the first step."""
    adam = _torch_adam(optimizer)
    if adam is None or len(adam.state) > 0:
        return
    for p in _params(adam):
        adam.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                         "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                         "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def restore(optimizer, saved: dict) -> None:
    """After ``optimizer.load_state_dict(saved)``: every parameter's step is its own tensor
    holding the checkpoint's count (``saved["optimizer"]["param_groups"][i]["step"]``, one value
    for all groups, as megatron-core saves it)."""
    adam = _torch_adam(optimizer)
    if adam is None:
        return
    steps = {group["step"] for group in saved["optimizer"]["param_groups"] if "step" in group}
    if len(steps) != 1:
        raise ValueError(f"the checkpoint's Adam step counts are {sorted(steps)}, not one value")
    step = float(steps.pop())
    for p in _params(adam):
        adam.state[p]["step"] = torch.tensor(step, dtype=torch.float32)
