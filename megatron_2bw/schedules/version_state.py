"""The weight state a version-keeping schedule (2bw, pipedream, pipemare) puts into a checkpoint
beside megatron-core's model state: the older weight version, and PipeMare T2's delta.

Each ``ShardedTensor`` and ``ShardedTensorFactory`` of a parameter is copied with its ``data``
pointed at the version's tensor and its key under a prefix ("twobw_older.",
"pipemare_delta."), keeping the chunk layout; ``ShardedObject`` extra state is saved once.

Invariants: a save covers every parameter of the stage, or fails (ValueError naming the
parameters); a load fills every parameter's tensor from the checkpoint (copied in after
megatron-core merged the factories), and a checkpoint that lacks any of the keys is refused
before anything is read.

More: docs/executor.md, "Weight versions in a checkpoint".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = ["VersionEntries", "version_entries"]


@dataclass
class VersionEntries:
    """One weight version's sharded entries, and where each parameter's tensor sits in them."""

    sharded: dict
    targets: list[tuple[tuple, int]]  # (path of keys into ``sharded``, parameter index)
    tensors: list[torch.Tensor]       # the version's tensors, indexed as the parameters
    names: list[str]                  # the parameters' names, for messages

    def uncovered(self) -> list[str]:
        """Parameters no entry holds."""
        covered = {index for _, index in self.targets}
        return [name for i, name in enumerate(self.names) if i not in covered]

    def check_covered(self, what: str) -> None:
        missing = self.uncovered()
        if missing:
            raise ValueError(f"{what}: no sharded checkpoint entry holds {len(missing)} "
                             f"parameter(s): {', '.join(missing[:4])}")

    def keys(self) -> set[str]:
        """The checkpoint keys the entries read or write (factories built, as a save does)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        keys = set()
        for path, _ in self.targets:
            entry = _at(self.sharded, path)
            if isinstance(entry, ShardedTensorFactory):
                keys.update(_built_keys(entry.build()))
            else:
                keys.add(entry.key)
        return keys

    def fill(self, loaded: dict) -> None:
        """Copy what ``loaded`` (the loaded counterpart of ``sharded``) holds into the tensors."""
        with torch.no_grad():
            for path, index in self.targets:
                value, target = _at(loaded, path), self.tensors[index]
                if value is not target:
                    target.copy_(value.reshape(target.shape))


def version_entries(chunks: list, params: list[torch.nn.Parameter],
                    tensors: list[torch.Tensor], prefix: str) -> VersionEntries:
    """The chunks' sharded entries re-pointed at ``tensors`` (the i-th stands for
    ``params[i]``) under ``prefix`` keys: one chunk's dict, or "chunk0", ... with several."""
    index_of = {id(p): i for i, p in enumerate(params)}
    names = [""] * len(params)
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) in index_of:
                names[index_of[id(p)]] = name
    targets: list[tuple[tuple, int]] = []
    by_chunk = []
    for i, chunk in enumerate(chunks):
        base = () if len(chunks) == 1 else (f"chunk{i}",)
        by_chunk.append(_repointed(chunk.module.sharded_state_dict(), index_of, tensors,
                                   prefix, base, targets))
    sharded = by_chunk[0] if len(chunks) == 1 else {f"chunk{i}": d
                                                     for i, d in enumerate(by_chunk)}
    return VersionEntries(sharded, targets, tensors, names)


def _repointed(sharded, index_of: dict, tensors: list, prefix: str, path: tuple,
               targets: list) -> dict:
    """The parameter entries of one (nested) sharded state dict, re-pointed; ``targets``
    gets each one's path and parameter index. ShardedObjects and non-parameter tensors are
    left out (they are not versioned)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    items = sharded.items() if isinstance(sharded, dict) else enumerate(sharded)
    for name, value in items:
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            index = index_of.get(id(value.data))
            if index is None:
                continue
            data = tensors[index]
            fields = {"key": prefix + value.key, "data": data}
            if isinstance(value, ShardedTensor):
                fields["dtype"] = data.dtype  # PipeMare's delta is fp32 in a 16-bit model
            out[name] = replace(value, **fields)
            targets.append(((*path, name), index))
        elif isinstance(value, (dict, list, tuple)):
            inner = _repointed(value, index_of, tensors, prefix, (*path, name), targets)
            if inner:
                out[name] = inner
    return out


def _at(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _built_keys(built) -> set[str]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(built, ShardedTensor):
        return {built.key}
    values = built.values() if isinstance(built, dict) else built
    return set().union(*(_built_keys(v) for v in values))
