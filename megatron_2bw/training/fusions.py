"""megatron-core's fused CUDA kernels that Megatron-LM turns on by default: masked softmax,
RoPE and gradient accumulation (its --no-masked-softmax-fusion, --no-rope-fusion and
--no-gradient-accumulation-fusion, megatron/training/arguments.py at core_v0.16.1, all
``store_false`` with default True; ``apply_rope_fusion`` off without rope position embeddings).

The decision is :func:`fusion_fields`, a pure function of (flags, device kind, which kernels
import). Invariants:
  * On the CPU every one is off (the kernels are CUDA's).
  * On CUDA each follows Megatron-LM's flag, and is off, with one note, where its kernel does
    not import (megatron-core would raise: TransformerConfig for RoPE, ColumnParallelLinear for
    gradient accumulation, the softmax at its first fused call). zb-h1 keeps gradient
    accumulation fused: its W runs each weight-gradient GEMM once, with the fused kernel
    (schedules/wgrad.py).
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass

__all__ = ["FusionKernels", "fusion_fields"]

_SOFTMAX_MODULES = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda",
                    "scaled_softmax_cuda")
"""apex's kernels that megatron-core's FusedScaleMaskSoftmax imports (fusions/fused_softmax.py)."""


@dataclass(frozen=True)
class FusionKernels:
    """Which fused kernels import in this process."""

    masked_softmax: bool
    """apex's scaled (upper-triangular) masked softmax extensions."""
    rope: bool
    """transformer-engine's fused rotary embedding (TE >= 1.4), as megatron-core's rope_utils
    imports it."""
    gradient_accumulation: bool
    """``fused_weight_gradient_mlp_cuda`` (apex), as megatron-core's tensor_parallel.layers
    imports it."""

    @classmethod
    def probe(cls) -> "FusionKernels":
        from megatron.core.models.common.embeddings import rope_utils
        from megatron.core.tensor_parallel import layers

        return cls(
            masked_softmax=all(importlib.util.find_spec(name) is not None
                               for name in _SOFTMAX_MODULES),
            rope=rope_utils.fused_apply_rotary_pos_emb is not None,
            gradient_accumulation=layers._grad_accum_fusion_available)


# field -> (Megatron-LM's flag turning it off, the FusionKernels attribute, what is missing)
_FUSIONS = {
    "masked_softmax_fusion": ("--no-masked-softmax-fusion", "masked_softmax",
                              "apex's scaled_masked_softmax_cuda kernels do not import"),
    "apply_rope_fusion": ("--no-rope-fusion", "rope",
                          "transformer-engine's fused rotary embedding does not import"),
    "gradient_accumulation_fusion": ("--no-gradient-accumulation-fusion",
                                     "gradient_accumulation",
                                     "apex's fused_weight_gradient_mlp_cuda does not import"),
}


def fusion_fields(args: argparse.Namespace, device: str,
                  kernels: FusionKernels | None) -> tuple[dict[str, bool], list[str]]:
    """The three TransformerConfig fields for a process training on ``device`` ("cuda" or
    "cpu"; ``kernels`` may be None on the CPU), and the notes (one line each) saying which
    fusion asked for is off and why."""
    if device != "cuda":
        return {field: False for field in _FUSIONS}, []
    fields, notes = {}, []
    for field, (flag, kernel, missing) in _FUSIONS.items():
        wanted = getattr(args, field, True)
        if field == "apply_rope_fusion" and args.position_embedding_type != "rope":
            wanted = False  # Megatron-LM's validate_args, silently
        why = None if not wanted or getattr(kernels, kernel) else missing
        fields[field] = wanted and why is None
        if why is not None:
            notes.append(f" {field} off ({why}; Megatron-LM's default is on, {flag} turns it "
                         "off)")
    return fields, notes
