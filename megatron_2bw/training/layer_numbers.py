"""Global layer numbers under the V placement (zb-v, dualpipev), so checkpoints key layers alike.

megatron-core numbers a chunk's transformer layers from ``get_transformer_layer_offset(config,
vp_stage, pp_rank)`` (megatron/core/transformer/transformer_layer.py, 0.16.1), which assumes its
interleaved placement (``schedules.Placement``'s "loop"): chunk c of pipeline rank i holds
virtual stage c*d + i. Each TransformerLayer keeps the number it was built with
(``layer_number``: attention's query-key scaling reads it), and
``TransformerBlock.sharded_state_dict`` keys the layer's tensors by it (the global layer index
along the checkpoint's layer axis) and calls the offset again to find the layer's index in the
chunk. Under the V placement chunk 1 of rank i holds virtual stage 2d-1-i = d + (d-1-i), where
the loop puts chunk 1 of rank d-1-i; numbered by the loop, it would be saved as stage d+i.

:func:`number_layers_by` records the placement on the TransformerConfig, and megatron-core's
offset function, wrapped once per process, answers for that config's chunks with the rank that
holds the same virtual stage under the loop. A chunk's layers then carry their true global
numbers, at build and at every save and load: a zb-v checkpoint holds the keys a flush
checkpoint of the same model holds, and either loads under the other. Configs without a
recorded placement are numbered as megatron-core numbers them.
"""

from __future__ import annotations

import sys

from megatron_2bw.schedules import Placement

__all__ = ["number_layers_by"]

_PLACEMENT = "pipeline_placement"  # TransformerConfig attribute: the Placement of its chunks
_FUNCTION = "get_transformer_layer_offset"


def number_layers_by(config, placement: Placement) -> None:
    """Number the layers of ``config``'s model chunks by ``placement`` (a no-op for the loop,
    which is megatron-core's own). Call before building the chunks."""
    if placement.shape == "loop":
        return
    setattr(config, _PLACEMENT, placement)
    _wrap_offset()


def _loop_rank(placement: Placement, pp_rank: int, vp_stage: int) -> int:
    """The pipeline rank whose chunk ``vp_stage`` holds, under the loop, the virtual stage that
    chunk ``vp_stage`` of ``pp_rank`` holds under ``placement`` (V: i for chunk 0, d-1-i for
    chunk 1)."""
    loop_rank = placement.virtual(pp_rank, vp_stage) - vp_stage * placement.depth
    assert 0 <= loop_rank < placement.depth, (placement, pp_rank, vp_stage)
    return loop_rank


def _wrap_offset() -> None:
    """Replace megatron-core's offset function by the placement-aware one, in transformer_layer
    (callers importing it later get the wrapper) and in every loaded megatron module that
    imported it by name (transformer_block, gpt_layer_specs, ...). Idempotent."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import transformer_layer

    original = getattr(transformer_layer, _FUNCTION)
    if getattr(original, "_placement_aware", False):
        return

    def offset(config, vp_stage=None, pp_rank=None):
        placement = getattr(config, _PLACEMENT, None)
        if placement is not None and vp_stage is not None:
            rank = ps.get_pipeline_model_parallel_rank() if pp_rank is None else pp_rank
            pp_rank = _loop_rank(placement, rank, vp_stage)
        return original(config, vp_stage, pp_rank)

    offset._placement_aware = True
    offset.__doc__ = original.__doc__
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, _FUNCTION, None) is original:
            setattr(module, _FUNCTION, offset)
