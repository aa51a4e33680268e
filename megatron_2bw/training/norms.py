"""A zero-centred-gamma norm for the local layer spec (``--apply-layernorm-1p``).

megatron-core's local spec builds its norms as ``WrappedTorchNorm``, torch's LayerNorm/RMSNorm,
which refuse ``config.layernorm_zero_centered_gamma``; transformer-engine's and apex's norms
support it. :class:`ZeroCenteredNorm` is the same computation as theirs: the parameter holds
gamma - 1, starts at zero, and the output is ``norm(x) * (1 + weight) + bias`` (no bias for
RMSNorm), so weight decay pulls gamma towards 1, not 0.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["ZeroCenteredNorm", "with_zero_centered_norms"]


class ZeroCenteredNorm(torch.nn.Module):
    """LayerNorm or RMSNorm (``config.normalization``) whose weight is stored as gamma - 1."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        self.shape = (hidden_size,)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.bias = None if self.rms else torch.nn.Parameter(
            torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gamma = self.weight + 1
        if self.rms:
            return torch.nn.functional.rms_norm(x, self.shape, gamma, self.eps)
        return torch.nn.functional.layer_norm(x, self.shape, gamma, self.bias, self.eps)


def with_zero_centered_norms(layer_spec, config):
    """The block spec of this pipeline stage's layers, ``layer_spec``'s torch norms (and the
    block's final norm) replaced by :class:`ZeroCenteredNorm`; other norms stay as they are."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    def replaced(spec):
        if spec is WrappedTorchNorm:
            return ZeroCenteredNorm
        submodules = getattr(spec, "submodules", None)
        if not dataclasses.is_dataclass(submodules):
            return spec
        changes = {f.name: replaced(getattr(submodules, f.name))
                   for f in dataclasses.fields(submodules)}
        return dataclasses.replace(spec, submodules=dataclasses.replace(submodules, **changes))

    layers = get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=[replaced(layer_spec)] * layers,
                                      layer_norm=ZeroCenteredNorm)
