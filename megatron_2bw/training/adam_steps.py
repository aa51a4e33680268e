"""Loading megatron-core 0.16's DistributedOptimizer over torch's Adam (no Apex, no
transformer-engine: megatron/core/optimizer/__init__.py falls back to ``torch.optim.Adam`` /
``AdamW``), which keeps the Adam step count once per parameter (``state[p]["step"]``, a 0-dim
tensor) where Apex's and TE's fused Adam keep it once per parameter group.

megatron-core saves that count in the parameter groups (``DistributedOptimizer.state_dict``: the
one value all parameters share) and has two gaps when it loads it back
(megatron/core/optimizer/distrib_optimizer.py):

1. ``sharded_state_dict(is_loading=True)`` calls ``state_dict()``, which asserts that the
   parameters' step counts are one value: an optimizer that has not stepped yet has none, so
   every resume fails (AssertionError). :func:`allocate` gives such an optimizer the state
   torch's Adam makes at its first step (step 0, zero moments), without stepping it (a dummy
   step with zero gradients, megatron-core's ``_init_optimizer_states_with_dummy_values``,
   would apply weight decay to the weights).
2. ``load_state_dict`` puts ONE step tensor into every parameter's state, and its
   'dp_reshardable' parameter-state load then copies into it the step tensor the state held
   when the load was requested (0). torch's Adam increments each parameter's step in place,
   so the shared tensor advances once per parameter per step: the bias corrections
   ``1 - beta ** step`` are wrong from the first step after the resume. :func:`restore` gives
   each parameter its own tensor holding the saved count.

Both act only on a DistributedOptimizer whose inner optimizer is torch's Adam/AdamW; with
Apex's or TE's Adam (the step in the parameter groups) megatron-core's own load is left as is.
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
