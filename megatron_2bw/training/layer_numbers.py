"""Layers of each model chunk under the V placement (zb-v, dualpipev), so checkpoints key them
alike whatever the placement and split.

megatron-core sizes and numbers a chunk's layers (``get_num_layers_to_build``,
``get_transformer_layer_offset``) for its interleaved placement, under which chunk 1 of rank i
would be saved as stage d+i instead of the V's 2d-1-i. :func:`number_layers_by` records the V
placement and the split on the TransformerConfig, and those two functions, wrapped once per
process, answer for that config's chunks from them.

Invariants: a chunk's layers carry their true global numbers at build and at every save and
load, so a zb-v checkpoint holds a flush checkpoint's keys (any split on either side) and
either loads under the other; configs without a recorded placement are megatron-core's.

More: docs/checkpoints_and_faults.md, "Layer numbers under the V".
"""

from __future__ import annotations

import copy
import sys

from megatron_2bw.schedules import LayerSplit, Placement

__all__ = ["number_layers_by", "building_virtual_stage"]

_PLACEMENT = "pipeline_placement"  # TransformerConfig attributes: the Placement of its chunks,
_SPLIT = "pipeline_layer_split"  # the LayerSplit,
_VIRTUAL = "pipeline_virtual_stage"  # and a virtual stage a transient build stands for
_OFFSET = "get_transformer_layer_offset"
_COUNT = "get_num_layers_to_build"


def number_layers_by(config, placement: Placement, split: LayerSplit) -> None:
    """Size and number the layers of ``config``'s model chunks by ``placement`` and ``split``
    (a no-op for the loop, which megatron-core sizes and numbers itself). Call before
    building the chunks."""
    if placement.shape == "loop":
        return
    setattr(config, _PLACEMENT, placement)
    setattr(config, _SPLIT, split)
    _wrap()


def building_virtual_stage(config, virtual: int):
    """A copy of ``config`` whose chunk (any rank, any vp_stage) is virtual stage ``virtual``:
    the V's builds of a stage this rank does not hold (``build._v_chunks_as_flush``)."""
    transient = copy.copy(config)
    setattr(transient, _VIRTUAL, virtual)
    return transient


def _virtual_stage(config, vp_stage, pp_rank) -> int | None:
    """The virtual stage a V chunk holds; None for a config megatron-core places itself."""
    placement = getattr(config, _PLACEMENT, None)
    if placement is None or vp_stage is None:
        return None
    fixed = getattr(config, _VIRTUAL, None)
    if fixed is not None:
        return fixed
    if pp_rank is None:
        from megatron.core import parallel_state as ps

        pp_rank = ps.get_pipeline_model_parallel_rank()
    return placement.virtual(pp_rank, vp_stage)


def _wrap() -> None:
    """Replace megatron-core's two functions by placement-aware ones, where they are defined
    (callers importing them later get the wrappers) and in every loaded megatron module that
    imported them by name (transformer_block, gpt_layer_specs, ...). Idempotent."""
    from megatron.core.transformer import transformer_block, transformer_layer

    for module, name, answer in ((transformer_layer, _OFFSET, LayerSplit.offset),
                                 (transformer_block, _COUNT, LayerSplit.count)):
        original = getattr(module, name)
        if getattr(original, "_placement_aware", False):
            continue
        wrapper = _placement_aware(original, answer)
        for loaded, found in list(sys.modules.items()):
            if loaded.startswith("megatron.core") and getattr(found, name, None) is original:
                setattr(found, name, wrapper)


def _placement_aware(original, answer):
    def wrapper(config, vp_stage=None, pp_rank=None):
        virtual = _virtual_stage(config, vp_stage, pp_rank)
        if virtual is None:
            return original(config, vp_stage, pp_rank)
        return answer(getattr(config, _SPLIT), virtual)

    wrapper._placement_aware = True
    wrapper.__doc__ = original.__doc__
    return wrapper
