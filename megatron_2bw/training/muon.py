"""--optimizer muon: megatron-core's Muon set-up, with the Muon this machine can run.

megatron-core's ``get_megatron_muon_optimizer`` splits the parameters (Muon for the 2-D
weights of the hidden layers, Adam for embeddings, output layer, norms and biases) and chains
the optimizers. Its ``TensorParallelMuon`` needs NVIDIA's emerging-optimizers (Python >=
3.12); where that is missing, :class:`BlockwiseMuon` (torch.optim.Muon with megatron-core's
momentum, scaling and QKV split) takes its place in the same set-up. Where they differ:
docs/megatron_lm_compatibility.md.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_2bw.arguments import have_emerging_optimizers

__all__ = ["build_muon_optimizer", "which_muon", "BlockwiseMuon", "newton_schulz",
           "ns_dtype", "scale_factor"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""torch.optim.Muon's quintic Newton-Schulz coefficients (Keller Jordan's)."""


def which_muon() -> str:
    """The Muon --optimizer muon runs here, in words."""
    if have_emerging_optimizers():
        return "megatron-core's TensorParallelMuon (emerging-optimizers)"
    return ("megatron-2bw's BlockwiseMuon (torch.optim.Muon; emerging-optimizers, which "
            "megatron-core's TensorParallelMuon needs, is not installed)")


def build_muon_optimizer(config, model_chunks: list, layer_wise: bool = False):
    """megatron-core's chain of Muon and Adam for ``model_chunks`` (``config``: an
    OptimizerConfig with the --muon-* fields); ``layer_wise``: wrapped in megatron-core's
    LayerWiseDistributedOptimizer (each data-parallel rank steps whole parameters and
    all-gathers the updated ones; --optimizer dist_muon)."""
    from megatron.core.optimizer import muon as core_muon

    from megatron_2bw.training import layer_wise as layer_wise_optimizer

    build = lambda: core_muon.get_megatron_muon_optimizer(  # noqa: E731
        config, model_chunks, layer_wise_distributed_optimizer=layer_wise)
    if have_emerging_optimizers():
        optimizer = build()
    else:
        with _blockwise_muon_in(core_muon):
            optimizer = build()
    if layer_wise:
        layer_wise_optimizer.adapt(optimizer)
    return optimizer


@contextlib.contextmanager
def _blockwise_muon_in(module):
    """megatron-core's Muon set-up building :class:`BlockwiseMuon` (the names it reads)."""
    saved = module.TensorParallelMuon, module.HAVE_EMERGING_OPTIMIZERS
    module.TensorParallelMuon, module.HAVE_EMERGING_OPTIMIZERS = BlockwiseMuon, True
    try:
        yield
    finally:
        module.TensorParallelMuon, module.HAVE_EMERGING_OPTIMIZERS = saved


def newton_schulz(x: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """U V^T of x = U S V^T, approximately: ``steps`` quintic iterations on x / ||x||_F
    (Jordan, "Muon", 2024; torch.optim.Muon's), along the smaller dimension, in x's dtype."""
    a, b, c = NS_COEFFICIENTS
    wide = x.mT if x.size(-2) > x.size(-1) else x  # (m, n), m <= n
    X = wide / wide.norm().clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT                                   # (m, m)
        X = torch.addmm(X, torch.addmm(A, A, A, beta=b, alpha=c), X, beta=a)
    return X.mT if x.size(-2) > x.size(-1) else X


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """The update's scale per --muon-scale-mode (emerging-optimizers' get_muon_scale_factor):
    spectral sqrt(max(rows, cols)) (update RMS ~ 1, Kimi's Moonlight), shape_scaling
    sqrt(max(1, rows / cols)) (Jordan's), unit_rms_norm sqrt(rows / cols) (Scion's)."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    raise ValueError(f"unknown Muon scale mode {mode!r}")


class BlockwiseMuon(torch.optim.Muon):
    """megatron-core's TensorParallelMuon in its blockwise mode (each tensor-parallel rank
    orthogonalizes its own shard), on torch.optim.Muon: per parameter

        p <- p (1 - lr wd);  M <- beta M + (1 - beta) g;  u = (1 - beta) g + beta M (Nesterov)
        or M;  p <- p - lr * scale * extra * NS(u)   (Q, K and V apart with split_qkv)

    The constructor takes TensorParallelMuon's arguments; only "blockwise" runs here."""

    def __init__(self, params, lr: float = 3e-4, momentum_beta: float = 0.95,
                 use_nesterov: bool = True, weight_decay: float = 0.01,
                 use_decoupled_weight_decay: bool = True, split_qkv: bool = False,
                 is_qkv_fn=None, qkv_split_shapes=None, fp32_matmul_prec: str = "medium",
                 coefficient_type: str = "quintic", num_ns_steps: int = 5,
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0,
                 pg_collection=None, mode: str = "blockwise") -> None:
        if mode != "blockwise":
            raise ValueError(f"Muon's tensor-parallel mode {mode!r} needs emerging-optimizers")
        super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum_beta,
                         nesterov=use_nesterov, ns_steps=num_ns_steps)
        self.decoupled_weight_decay = use_decoupled_weight_decay
        self.split_qkv, self.is_qkv_fn = split_qkv, is_qkv_fn
        self.qkv_split_shapes = tuple(qkv_split_shapes or ())
        self.fp32_matmul_prec = fp32_matmul_prec
        self.scale_mode, self.extra_scale_factor = scale_mode, extra_scale_factor

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else closure()
        for group in self.param_groups:
            lr, weight_decay, beta = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                momentum = state["momentum_buffer"]
                if weight_decay > 0 and self.decoupled_weight_decay:
                    p.mul_(1.0 - lr * weight_decay)
                elif weight_decay > 0:
                    grad = grad.add(p, alpha=weight_decay)
                momentum.lerp_(grad, 1.0 - beta)
                update = grad.lerp(momentum, beta) if group["nesterov"] else momentum
                p.add_(self._orthogonalized(p, update, group["ns_steps"]), alpha=-lr)
        return loss

    def _orthogonalized(self, p: torch.Tensor, update: torch.Tensor, steps: int) -> torch.Tensor:
        """NS(update) scaled; the fused QKV weight's Q, K and V parts each on their own."""
        if not (self.split_qkv and self.is_qkv_fn is not None and self.is_qkv_fn(p)):
            return self._scaled(update, steps)
        rows, hidden = update.shape
        groups = rows // sum(self.qkv_split_shapes)  # this rank's query groups
        parts = update.view(groups, sum(self.qkv_split_shapes), hidden).split(
            self.qkv_split_shapes, dim=1)
        done = [self._scaled(part.reshape(-1, hidden), steps).view(groups, -1, hidden)
                for part in parts]
        return torch.cat(done, dim=1).view(rows, hidden)

    def _scaled(self, update: torch.Tensor, steps: int) -> torch.Tensor:
        with _matmul_precision(update, self.fp32_matmul_prec):
            orthogonal = newton_schulz(update.to(ns_dtype(self.fp32_matmul_prec)), steps)
        scale = scale_factor(update.size(-2), update.size(-1), self.scale_mode)
        return (orthogonal.float() * (scale * self.extra_scale_factor)).to(update.dtype)


def ns_dtype(precision: str) -> torch.dtype:
    """The dtype Newton-Schulz iterates in for --muon-fp32-matmul-prec: bf16 for medium (the
    default) and low, as Jordan's reference Muon and torch.optim.Muon run it (4-5x the fp32
    rate on a CPU with AVX512-BF16, the tensor cores' rate on a GPU), fp32 for high."""
    return torch.float32 if precision == "high" else torch.bfloat16


@contextlib.contextmanager
def _matmul_precision(tensor: torch.Tensor, precision: str):
    """--muon-fp32-matmul-prec high on CUDA: Newton-Schulz's fp32 products in TF32 (torch's
    "high" float32 matmul precision); elsewhere nothing to set (medium and low iterate in
    bf16, the CPU's fp32 products stay fp32)."""
    if tensor.device.type != "cuda" or precision != "high":
        yield
        return
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)
