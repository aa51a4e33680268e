"""PipeMare's discrepancy correction T2 (Yang et al., MLSys 2021) on one stage.

A backward whose forward read an older version runs with the weights extrapolated back towards
the forward's, w_bkwd - (tau_fwd - tau_bkwd) * delta, with delta a running average of the
stage's last weight changes (gamma = D ** (1 / s)).

Invariants:
  * ``delta`` holds delta(``version``); ``track()`` folds in each newer version once, right
    after a step's weights are written (never between ``fork`` and the optimizer's write).
  * The corrected weights live in the store's spare slot (``WeightVersions.use_derived``).
  * ``delta`` is fp32 whatever the parameters' dtype, so in bf16 a learning-rate-sized step
    is not rounded away; the corrected weights are rounded to the parameters' dtype once.

The formulas and why: docs/schedules.md, "PipeMare".
"""

from __future__ import annotations

import torch

from .weights import WeightVersions

__all__ = ["DiscrepancyCorrection", "zeros_like_delta"]

DELTA_DTYPE = torch.float32


def zeros_like_delta(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """delta(0) = 0 for ``weights``: their shapes and device, in fp32."""
    return [torch.zeros_like(w, dtype=DELTA_DTYPE) for w in weights]


class DiscrepancyCorrection:
    """delta over one stage's parameters, and the corrected weights of a backward."""

    def __init__(self, versions: WeightVersions, decay: float, span: int):
        if not 0.0 < decay < 1.0 or span < 1:
            raise ValueError(f"need 0 < D < 1 and a span >= 1, got D={decay}, span={span}")
        self.versions = versions
        self.gamma = decay ** (1.0 / span)
        self.delta = zeros_like_delta(versions.tensors_of(versions.newest))
        self.version = versions.newest

    def track(self) -> None:
        """Fold W(newest) - W(newest - 1) into delta if the newest version is not in yet."""
        newest = self.versions.newest
        if newest == self.version:
            return
        if newest != self.version + 1:
            raise RuntimeError(f"discrepancy correction: delta is at version {self.version}, "
                               f"the weights at {newest} (a step was not tracked)")
        gamma = self.gamma
        with torch.no_grad():
            for delta, new, old in zip(self.delta, self.versions.tensors_of(newest),
                                       self.versions.tensors_of(newest - 1)):
                step = new.to(torch.float32, copy=True).sub_(old)  # exact: fp32 of 16-bit
                delta.mul_(gamma).add_(step, alpha=1.0 - gamma)
        self.version = newest

    def use(self, version: int, scale: int) -> None:
        """Point the parameters at W(version) - scale * delta (``version`` the newest)."""
        self.track()

        def corrected(newest: list[torch.Tensor], out: list[torch.Tensor]) -> None:
            for w, delta, dst in zip(newest, self.delta, out):
                torch.sub(w, delta, alpha=scale, out=dst)

        self.versions.use_derived(version, ("corrected", scale), corrected)
