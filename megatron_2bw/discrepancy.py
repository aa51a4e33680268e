"""PipeMare's discrepancy correction T2 (Yang et al., MLSys 2021) on one stage.

A backward whose forward read an older version (tau_fwd > tau_bkwd) runs with the weights
extrapolated back towards the forward's:

    w_bkwd - (tau_fwd - tau_bkwd) * delta,
    delta(t+1) = gamma * delta(t) + (1 - gamma) * (W(t+1) - W(t)),  delta(0) = 0,
    gamma = D ** (1 / s),  s = the stage's largest tau_fwd - tau_bkwd (> 0).

Invariants:
  * ``delta`` holds delta(``version``); ``track()`` folds in each newer version once, while the
    version before it is still alive in the store: call it right after a step's weights are
    written (never between ``fork`` and the optimizer's write).
  * The corrected weights live in the store's spare slot (``WeightVersions.use_derived``): the
    backwards that read them come after every forward of the call that reads the older
    version there.
"""

from __future__ import annotations

import torch

from .weights import WeightVersions

__all__ = ["DiscrepancyCorrection"]


class DiscrepancyCorrection:
    """delta over one stage's parameters, and the corrected weights of a backward."""

    def __init__(self, versions: WeightVersions, decay: float, span: int):
        if not 0.0 < decay < 1.0 or span < 1:
            raise ValueError(f"need 0 < D < 1 and a span >= 1, got D={decay}, span={span}")
        self.versions = versions
        self.gamma = decay ** (1.0 / span)
        self.delta = [torch.zeros_like(t) for t in versions.tensors_of(versions.newest)]
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
                delta.mul_(gamma).add_(new - old, alpha=1.0 - gamma)
        self.version = newest

    def use(self, version: int, scale: int) -> None:
        """Point the parameters at W(version) - scale * delta (``version`` the newest)."""
        self.track()

        def corrected(newest: list[torch.Tensor], out: list[torch.Tensor]) -> None:
            for w, delta, dst in zip(newest, self.delta, out):
                torch.sub(w, delta, alpha=scale, out=dst)

        self.versions.use_derived(version, ("corrected", scale), corrected)
