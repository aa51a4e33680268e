"""PipeDream-2BW's double-buffered weights (Narayanan et al., ICML 2021, Section 3.1).

Each stage keeps at most two weight versions: the newest, and the one still read by the
microbatches in flight. The 2BW update is

    W(t+1) = W(t) - lr * grad f(W(t-1))

so the optimizer step after batch t reads the newest version W(t) and writes W(t+1), while
batch t+1's microbatches, already forwarded with W(t), keep reading W(t) until their
backward passes are done.

Invariants:
  * Two storages per parameter ("slots"); a version lives in one slot; ``use(v)`` points every
    parameter's ``.data`` at ``v``'s slot. Forward, recomputation and backward of a microbatch
    all run after ``use(version)`` (megatron's linear layers read ``p.data`` in backward).
  * The new version is always made in slot 0, the "home" slot: the parameters' own storage at
    construction, which megatron-core's buffers alias (with the distributed optimizer, each
    DDP bucket's ``param_data``, the optimizer's fp32 shard views of it and the parameter
    all-gather into it). ``fork(v_new)`` retires every version older than the newest, copies
    the newest (always in slot 0) out to slot 1 and points the parameters at slot 0: the
    optimizer then writes ``v_new`` there, through the parameters or through views of the
    buffers, without touching storage an in-flight microbatch reads (those of the newest
    version now read slot 1).
  * ``use_derived`` fills the spare slot with weights derived from the newest version
    (PipeMare's discrepancy-corrected backward weights) and retires the older version there.
  * An optimizer that updates a Parameter in place bumps its autograd version counter, which
    in-flight backward passes would take for a modification of what they saved. The counters
    are reset to their pre-step values (``after_step``): the storage those passes saved was not
    written.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

__all__ = ["WeightVersions"]

HOME = 0
"""The slot every new version is made in: the parameters' storage at construction."""


class WeightVersions:
    """Two weight slots for one pipeline stage's parameters."""

    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.params = [p for p in params]
        self.slots: list[list[torch.Tensor] | None] = [[p.data for p in self.params], None]
        self.slot_of: dict[int, int] = {0: 0}  # version -> slot
        self.pointed_slot = 0
        self._counters: list[int] | None = None
        self.derived: tuple[int, object] | None = None  # (version, key) the spare slot holds

    @property
    def newest(self) -> int:
        return max(self.slot_of)

    @property
    def alive(self) -> list[int]:
        return sorted(self.slot_of)

    def use(self, version: int) -> None:
        """Point the parameters at ``version`` (a no-op when they already are)."""
        if version not in self.slot_of:
            raise KeyError(f"weight version {version} is not alive (alive: {self.alive})")
        self._point(self.slot_of[version])

    def tensors_of(self, version: int) -> list[torch.Tensor]:
        """The tensors holding ``version`` (alive)."""
        if version not in self.slot_of:
            raise KeyError(f"weight version {version} is not alive (alive: {self.alive})")
        return self.slots[self.slot_of[version]]

    def use_derived(self, version: int, key: object,
                    make: Callable[[list[torch.Tensor], list[torch.Tensor]], None]) -> None:
        """Point the parameters at weights derived from ``version``, the newest (PipeMare's
        corrected backward weights): ``make(newest, spare)`` writes them into the spare slot
        once per (version, key). The older version that slot held is retired: call only once
        no pass reads it any more (the next ``fork`` refills the slot)."""
        if version != self.newest:
            raise ValueError(f"weights derived from version {version}: only from the newest "
                             f"({self.newest})")
        if self.derived != (version, key):
            spare = self.spare_tensors()
            self.slot_of = {version: HOME}
            with torch.no_grad():
                make(self.slots[HOME], spare)
            self.derived = (version, key)
        self._point(1 - HOME)

    def _point(self, slot: int) -> None:
        """Point every parameter's ``.data`` at ``slot``'s tensors (a no-op when it is)."""
        if slot != self.pointed_slot:
            for p, data in zip(self.params, self.slots[slot]):
                p.data = data
            self.pointed_slot = slot

    def fork(self, new_version: int) -> None:
        """Make room for ``new_version`` in the home slot: keep only the newest version, move it
        (a copy) to slot 1, and point the parameters at slot 0 for the optimizer step to
        overwrite."""
        newest = self.newest
        if new_version != newest + 1:
            raise ValueError(f"fork({new_version}) after version {newest}: versions must be "
                             "made in order")
        if self.slot_of[newest] != HOME:
            raise RuntimeError(f"weight version {newest} is not in the home slot")
        self.use(newest)
        moved_out = self.spare_tensors()
        with torch.no_grad():
            for dst, src in zip(moved_out, self.slots[HOME]):
                dst.copy_(src)
        self.slot_of = {newest: 1 - HOME, new_version: HOME}
        self.derived = None
        self._counters = [p._version for p in self.params]

    def after_step(self) -> None:
        """Undo the autograd version-counter bumps of an in-place optimizer step (see the
        module docstring); call once after the step, before any backward pass."""
        if self._counters is None:
            return
        torch._C._autograd._unsafe_set_version_counter(tuple(self.params), tuple(self._counters))
        self._counters = None

    # ---- checkpoints -------------------------------------------------------------------
    def older_version(self) -> tuple[int, list[torch.Tensor]] | None:
        """The older alive version and its tensors (None when only one version is alive)."""
        if len(self.slot_of) < 2:
            return None
        older = min(self.slot_of)
        return older, self.slots[self.slot_of[older]]

    def spare_tensors(self) -> list[torch.Tensor]:
        """The tensors of slot 1, the one that is not home (allocated on first use)."""
        spare = 1 - HOME
        if self.slots[spare] is None:
            self.slots[spare] = [torch.empty_like(p.data) for p in self.params]
        return self.slots[spare]

    def loaded(self, newest: int, older: int | None) -> None:
        """A checkpoint was read into the home slot (``newest``) and the spare one
        (``older``)."""
        if self.pointed_slot == HOME:  # the load may have given the parameters new storage
            self.slots[HOME] = [p.data for p in self.params]
        self._point(HOME)
        self.slot_of = {newest: HOME}
        self.derived = None
        if older is not None:
            self.slot_of[older] = 1 - HOME
