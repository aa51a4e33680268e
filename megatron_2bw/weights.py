"""A pipeline stage's weight versions: PipeDream-2BW's double buffer (Narayanan et al., ICML
2021, Section 3.1) and its N-slot generalisation for PipeDream's weight stashing at m < d.

`WeightVersions` keeps one storage ("slot") per alive version; `use(v)` points every
parameter's ``.data`` at v's slot, and `fork(v_new)` retires the versions no pass reads any
more, copies the newest out of slot 0 when it is kept, and leaves the parameters on slot 0.

Invariants: the new version is always made in slot 0, the parameters' own storage, which
megatron-core's buffers (and the distributed optimizer's shard views) alias, so the optimizer
never writes storage an in-flight microbatch reads; a retired version is one no in-flight or
later pass reads; autograd version counters are reset after an in-place step (`after_step`).

The update rule, the slots and why: docs/executor.md, "Weight versions".
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

__all__ = ["WeightVersions"]

HOME = 0
"""The slot every new version is made in: the parameters' storage at construction."""


class WeightVersions:
    """Weight slots for one pipeline stage's parameters, one per alive version.

    ``keep_from(v_new)``: the oldest version still read once ``v_new`` is made (by a
    microbatch in flight or one forwarded later); default ``v_new - 1`` (2BW)."""

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 keep_from: Callable[[int], int] | None = None):
        self.params = [p for p in params]
        self.slots: list[list[torch.Tensor] | None] = [[p.data for p in self.params], None]
        self.slot_of: dict[int, int] = {0: 0}  # version -> slot
        self.pointed_slot = 0
        self.keep_from = keep_from or (lambda new_version: new_version - 1)
        self._counters: list[int] | None = None
        self.derived: tuple[int, object] | None = None  # (version, key) slot 1 holds

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

    def use_trained(self) -> None:
        """Point the parameters at the newest weights the optimizer made (evaluation)."""
        self.use(self.newest)

    def tensors_of(self, version: int) -> list[torch.Tensor]:
        """The tensors holding ``version`` (alive)."""
        if version not in self.slot_of:
            raise KeyError(f"weight version {version} is not alive (alive: {self.alive})")
        return self.slots[self.slot_of[version]]

    def use_derived(self, version: int, key: object,
                    make: Callable[[list[torch.Tensor], list[torch.Tensor]], None]) -> None:
        """Point the parameters at weights derived from ``version``, the newest (PipeMare's
        corrected backward weights): ``make(newest, spare)`` writes them into slot 1 once per
        (version, key). The older versions are retired: call only once no pass reads them
        any more (the next ``fork`` refills the slot)."""
        if version != self.newest:
            raise ValueError(f"weights derived from version {version}: only from the newest "
                             f"({self.newest})")
        if self.derived != (version, key):
            spare = self.spare_tensors()
            self.slot_of = {version: HOME}
            with torch.no_grad():
                make(self.slots[HOME], spare)
            self.derived = (version, key)
        self._point(1)

    def _point(self, slot: int) -> None:
        """Point every parameter's ``.data`` at ``slot``'s tensors (a no-op when it is)."""
        if slot != self.pointed_slot:
            for p, data in zip(self.params, self.slots[slot]):
                p.data = data
            self.pointed_slot = slot

    def fork(self, new_version: int) -> None:
        """Make room for ``new_version`` in the home slot: retire the versions older than
        ``keep_from(new_version)``, move the newest (a copy) to a free slot if it is kept, and
        point the parameters at slot 0 for the optimizer step to overwrite."""
        newest = self.newest
        if new_version != newest + 1:
            raise ValueError(f"fork({new_version}) after version {newest}: versions must be "
                             "made in order")
        if self.slot_of[newest] != HOME:
            raise RuntimeError(f"weight version {newest} is not in the home slot")
        self.use(newest)
        oldest = self.keep_from(new_version)
        kept = {v: slot for v, slot in self.slot_of.items() if oldest <= v < newest}
        if oldest <= newest:
            free = self._free_slot(set(kept.values()))
            with torch.no_grad():
                for dst, src in zip(self.slot_tensors(free), self.slots[HOME]):
                    dst.copy_(src)
            kept[newest] = free
        self.slot_of = {**kept, new_version: HOME}
        self.derived = None
        self._counters = [p._version for p in self.params]

    def _free_slot(self, taken: set[int]) -> int:
        """The first slot after home that no kept version holds."""
        return next(slot for slot in range(1, len(self.slots) + 1) if slot not in taken)

    def after_step(self) -> None:
        """Undo the autograd version-counter bumps of an in-place optimizer step (see the
        module docstring); call once after the step, before any backward pass."""
        if self._counters is None:
            return
        torch._C._autograd._unsafe_set_version_counter(tuple(self.params), tuple(self._counters))
        self._counters = None

    # ---- checkpoints -------------------------------------------------------------------
    def older_versions(self) -> list[tuple[int, list[torch.Tensor]]]:
        """The alive versions but the newest, newest first, with their tensors."""
        return [(v, self.slots[self.slot_of[v]]) for v in sorted(self.slot_of, reverse=True)
                if v != self.newest]

    def older_version(self) -> tuple[int, list[torch.Tensor]] | None:
        """The second newest alive version and its tensors (None when only one is alive)."""
        older = self.older_versions()
        return older[0] if older else None

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        """The tensors of ``slot`` (> 0; allocated on first use)."""
        while len(self.slots) <= slot:
            self.slots.append(None)
        if self.slots[slot] is None:
            self.slots[slot] = [torch.empty_like(p.data) for p in self.params]
        return self.slots[slot]

    def spare_tensors(self) -> list[torch.Tensor]:
        """The tensors of slot 1, the first that is not home (allocated on first use)."""
        return self.slot_tensors(1)

    def loaded(self, newest: int, older: int | list[int] | None) -> None:
        """A checkpoint was read into the home slot (``newest``) and slots 1, 2, ... (the
        ``older`` versions, newest first; one version or None for 2BW's two)."""
        if self.pointed_slot == HOME:  # the load may have given the parameters new storage
            self.slots[HOME] = [p.data for p in self.params]
        self._point(HOME)
        self.slot_of = {newest: HOME}
        self.derived = None
        olders = [] if older is None else [older] if isinstance(older, int) else list(older)
        for slot, version in enumerate(olders, start=1):
            self.slot_of[version] = slot
