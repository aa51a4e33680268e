"""The runner's weight versions as checkpoints hold them: the version store's creation and
the older versions, PipeMare's delta and the stale-weight correction's state saved beside
the model and read back.

:class:`VersionCheckpoint` adds those entries to a sharded state dict (``checkpoint_extra``),
names where they load (``prepare_load``) and restores the store (``checkpoint_loaded``).
Invariant: every stage saves the same keys (the older versions, a delta on every stage when
PipeMare's T2 runs), and a checkpoint lacking some of a slot's keys is refused with
:class:`~megatron_2bw.errors.CheckpointRefused`, never half loaded.
"""

from __future__ import annotations

import itertools

import torch

from megatron_2bw.discrepancy import zeros_like_delta
from megatron_2bw.errors import CheckpointRefused
from megatron_2bw.schedules import keeps_versions
from megatron_2bw.schedules.call import model_chunks
from megatron_2bw.schedules.version_state import version_entries

__all__ = ["VersionCheckpoint"]


class VersionCheckpoint:
    """The runner's version store and its checkpoint entries. Needs ``schedule``,
    ``versions``, ``stale_rule``, ``stale``, ``optimizer``, ``pipemare``, ``correction``,
    ``loaded_delta``, ``loading`` and ``batches_done`` (and ``depth`` and ``current_m`` once
    a call has run)."""

    def bind(self, model) -> None:
        """Create the 2BW weight versions of the parameters of ``model`` (a chunk, or the
        stage's list of chunks: one version spans them all); version 0 = current."""
        if keeps_versions(self.schedule) and self.versions is None:
            self.versions = self.stale_rule.versions(
                [p for chunk in model_chunks(model) for p in chunk.parameters()], self._oldest_read)

    def _oldest_read(self, new_version: int) -> int:
        """The oldest version this stage reads once ``new_version`` (made after batch
        ``new_version - 1``) exists: the forward version of the batch's first microbatch,
        the oldest an in-flight microbatch or a later (refilled) forward reads."""
        from megatron_2bw.schedules import SCHEDULES

        from megatron.core import parallel_state as ps

        spec = SCHEDULES[self.schedule]
        m = getattr(self, "current_m", None) or 1
        depth = ps.get_pipeline_model_parallel_world_size()
        stage = ps.get_pipeline_model_parallel_rank()
        return spec.version_of(depth, m, stage, new_version * m)

    def checkpoint_extra(self, model: list, sharded: dict) -> None:
        """Add what a resumed 2BW run needs to continue exactly: the older weight versions
        (the batches after ``batches_done`` still read them: one under 2BW and at m >= d,
        ceil((d-1)/m) under pipedream and pipemare, `_older_slots`) and the version numbers;
        under PipeMare's T2 each stage's delta at the newest version (the pipeline is drained
        and every step tracked; zeros on the last stage, which corrects nothing). Every
        parameter is saved, whichever kind of sharded entry megatron-core gives it
        (version_state.py). Every stage saves the same number of older versions (the layers'
        tensors span the pipeline); a stage that holds fewer (a later stage reads fewer)
        fills the rest with its newest, which it never reads as an older one. The version
        numbers are the first stage's (megatron-core saves common state from rank 0)."""
        if not keeps_versions(self.schedule):
            return
        self.bind(model)
        newest = self.versions.newest
        alive = [(v, t) for v, t in self.versions.older_versions()]
        olders = [v for v, _ in alive][:self._older_slots()]  # dc's W(t-2): read no more
        sharded["twobw_versions"] = {"batches_done": self.batches_done, "newest": newest,
                                     "older": olders[0] if olders else None, "olders": olders,
                                     "correction": self.stale_rule.rule}
        fallback = self.versions.tensors_of(newest)
        for j in range(1, self._older_slots() + 1):
            tensors = alive[j - 1][1] if j <= len(alive) else fallback
            entries = self._entries(model, tensors, _older_prefix(j))
            entries.check_covered("the older weight version")
            sharded[_older_key(j)] = entries.sharded
        if self._corrects():
            if self.correction is not None:
                self.correction.track()
                delta = self.correction.delta
            else:  # the last stage corrects nothing; its layers' shards complete the tensors
                delta = zeros_like_delta(self.versions.tensors_of(self.versions.newest))
            entries = self._entries(model, delta, _DELTA_PREFIX)
            entries.check_covered("PipeMare's delta")
            sharded["pipemare_delta"] = entries.sharded
        state = self._stale_state()
        if state is not None:
            entries = self._entries(model, state.state_tensors(), _STALE_PREFIX)
            entries.check_covered(f"the {self.stale_rule.rule} correction's state")
            sharded[_STALE_KEY] = entries.sharded

    def prepare_load(self, model: list, sharded: dict, path: str) -> None:
        """Loading counterpart of :meth:`checkpoint_extra`: the older version is read into the
        spare slot (and T2's delta, where the checkpoint has one). A checkpoint written by
        another schedule has one version only. One that has the older version of only some
        parameters (a megatron-2bw that did not save GLU's fc1) is refused with
        CheckpointRefused: its spare slot could not be filled."""
        from megatron.core import dist_checkpointing

        self.loading = {}
        if not keeps_versions(self.schedule):
            return
        self.bind(model)
        common = dist_checkpointing.load_common_state_dict(path).get("twobw_versions")
        saved_rule = "none" if common is None else common.get("correction", "none")
        if saved_rule != self.stale_rule.rule:
            raise CheckpointRefused(
                f"--load: {path} was trained with --stale-weight-correction {saved_rule}; "
                f"resume it with the same rule, not {self.stale_rule.rule}")
        if common is None:
            return
        saved_keys = set(dist_checkpointing.load_tensors_metadata(path))
        sharded["twobw_versions"] = {"batches_done": 0, "newest": 0, "older": None,
                                     "olders": []}
        j = 1
        while j == 1 or any(key.startswith(_older_prefix(j)) for key in saved_keys):
            older = self._entries(model, self.versions.slot_tensors(j), _older_prefix(j))
            _require(older, saved_keys, path, "the older weight version")
            sharded[_older_key(j)] = older.sharded
            self.loading[_older_key(j)] = older
            j += 1
        if self._corrects() and any(key.startswith(_DELTA_PREFIX) for key in saved_keys):
            self.loaded_delta = zeros_like_delta(self.versions.tensors_of(self.versions.newest))
            delta = self._entries(model, self.loaded_delta, _DELTA_PREFIX)
            _require(delta, saved_keys, path, "PipeMare's delta")
            sharded["pipemare_delta"] = delta.sharded
            self.loading["pipemare_delta"] = delta
        state = self._stale_state()
        if state is not None:
            entries = self._entries(model, state.load_targets(), _STALE_PREFIX)
            _require(entries, saved_keys, path, f"the {self.stale_rule.rule} correction's state")
            sharded[_STALE_KEY] = entries.sharded
            self.loading[_STALE_KEY] = entries

    def _older_slots(self) -> int:
        """Older versions a checkpoint holds: what the first stage reads besides the newest
        once the pipeline is drained (1, or ceil((d-1)/m) under pipedream and pipemare)."""
        from megatron_2bw.schedules import SCHEDULES

        m = getattr(self, "current_m", None) or 1
        return SCHEDULES[self.schedule].drain_notice(self.depth, m) if hasattr(
            self, "depth") else 1

    def weight_tensors(self) -> list[torch.Tensor] | None:
        """Every alive weight version's tensors (None for a schedule without versions)."""
        if self.versions is None:
            return None
        return [t for version in self.versions.alive for t in self.versions.tensors_of(version)]

    def _entries(self, model: list, tensors: list[torch.Tensor], prefix: str):
        """The sharded entries of ``tensors`` (one per parameter) under the key ``prefix``."""
        return version_entries(model_chunks(model), self.versions.params, tensors, prefix)

    def _corrects(self) -> bool:
        """Whether the run has PipeMare's T2 (the same on every rank: checkpoints hold delta
        for every stage, the stacked layer tensors span the pipeline)."""
        return self.schedule == "pipemare" and self.pipemare.discrepancy_decay is not None

    def checkpoint_loaded(self, model: list, loaded: dict) -> None:
        """After :meth:`prepare_load`'s entries were read: fill the slots and restore the
        version numbers and the batches done (a checkpoint of one version fills the spare slot
        with the current weights)."""
        if not keeps_versions(self.schedule):
            return
        for key, entries in self.loading.items():
            entries.fill(loaded[key])  # factories' merges are new tensors
        # the older versions read into slots 1, 2, ... (a checkpoint of dc's listed one more)
        slots_read = next(j for j in itertools.count(1) if _older_key(j) not in self.loading) - 1
        self.loading = {}
        info = loaded.get("twobw_versions")
        if info is None:  # one version: batch k reads "version k-1", the same weights
            iteration = loaded["iteration"]
            info = {"batches_done": iteration, "newest": iteration,
                    "older": iteration - 1 if iteration > 0 else None}
            for spare, p in zip(self.versions.spare_tensors(), self.versions.params):
                spare.copy_(p.data)
            slots_read = 1
        self.batches_done = info["batches_done"]
        olders = info.get("olders") or ([] if info["older"] is None else [info["older"]])
        self.versions.loaded(info["newest"], olders[:slots_read])
        state = self._stale_state()
        if state is not None:
            state.state_loaded()

    def _stale_state(self):
        """The stale-weight correction's object when it has state a checkpoint holds (bound
        here if the first call has not come yet)."""
        if self.stale is None and self.stale_rule.rule != "none" and self.optimizer is not None:
            self.stale = self.stale_rule.bind(self.versions, self.optimizer)
        if self.stale is None or not getattr(self.stale, "holds_state", True):
            return None
        return self.stale


_OLDER_PREFIX, _DELTA_PREFIX, _STALE_PREFIX = "twobw_older.", "pipemare_delta.", "twobw_stale."
"""Checkpoint keys of the older weight version, of PipeMare's delta and of the stale-weight
correction's state (R(newest) under predict, U_{t-1} under ef): the parameter's key after the
prefix."""
_STALE_KEY = "twobw_stale_state"


def _older_prefix(j: int) -> str:
    """Key prefix of the j-th older version (1: the second newest, 2BW's one)."""
    return _OLDER_PREFIX if j == 1 else f"twobw_older{j}."


def _older_key(j: int) -> str:
    """The sharded-state entry of the j-th older version."""
    return "twobw_older_weights" if j == 1 else f"twobw_older_weights{j}"


def _require(entries, saved_keys: set[str], path: str, what: str) -> None:
    """Refuse a checkpoint that lacks some of ``entries``' keys (the slot could not be
    filled)."""
    missing = sorted(entries.keys() - saved_keys)
    if missing:
        raise CheckpointRefused(
            f"--load: {path} holds {what} of only some parameters ({len(missing)} key(s) "
            f"missing, e.g. {missing[0]}): a run of this schedule cannot resume from it "
            "exactly (it was saved by a megatron-2bw that left them out)")
