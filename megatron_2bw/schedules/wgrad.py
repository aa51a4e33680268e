"""Zero-bubble's split backward as one backward in two parts: I computes the input gradients
and leaves what the weight gradients need, W computes the weight-gradient GEMMs.

`WeightGradStore` swaps the backward of megatron-core's linear layers' autograd Function only
while an I runs (`WeightGradStore.collecting`): it computes the input and bias gradients and
keeps (input, output gradient) per weight; W runs the weight GEMMs from them and hands each
gradient to its parameter's accumulator, so DDP's hooks run as in a fused backward.

Invariants: nothing is recomputed or copied; deferred are only the chunk's column- and
row-parallel linear weights that no embedding holds, every other parameter gets its gradient
in I; each weight gradient is added once, with megatron-core's own GEMMs, so the gradients
equal a fused backward's bit for bit.

Why this way and not another: docs/executor.md, "The split backward".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["WeightGradStore", "PendingWeightGrads"]


@dataclass
class _Pending:
    """One deferred weight-gradient GEMM: what the linear's backward leaves for W."""

    weight: torch.nn.Parameter
    input: torch.Tensor
    """The layer's input as saved for backward (the local part under sequence parallelism)."""
    grad_output: torch.Tensor
    """The output gradient, 2-D and contiguous (megatron-core's layout for the GEMM)."""
    main_grad: torch.Tensor | None
    """``weight.main_grad`` at the forward, where gradient-accumulation fusion is on."""
    fusion: bool
    sequence_parallel: bool
    tp_group: object

    def nbytes(self) -> int:
        """Bytes this pending GEMM keeps alive: the output gradient and the input (which a
        fused backward would have freed with the graph)."""
        return sum(t.numel() * t.element_size() for t in (self.grad_output, self.input))


@dataclass
class PendingWeightGrads:
    """A microbatch's deferred weight gradients, from its I to its W."""

    pending: list[_Pending]

    def nbytes(self) -> int:
        """Bytes kept for W (inputs and output gradients)."""
        return sum(p.nbytes() for p in self.pending)


class _WeightGrad(torch.autograd.Function):
    """One deferred GEMM as autograd sees it: a node whose inputs are the previous node's
    (empty) output and the weight, and whose backward runs the GEMM. W chains one per
    deferred item and runs the chain's backward in one engine call; each gradient goes to
    the weight's accumulator as it is made (the engine runs accumulators first), so one weight
    gradient exists at a time, handed over as a fused backward hands it: moved, not copied."""

    @staticmethod
    def forward(ctx, previous: torch.Tensor, item: "_Pending", weight: torch.Tensor):
        ctx.item = item
        return previous.new_empty(0)

    @staticmethod
    def backward(ctx, grad):
        item, ctx.item = ctx.item, None
        return grad, None, _weight_grad(item)


_ACTIVE: "WeightGradStore | None" = None
"""The store of the I now running (None: megatron-core's backward runs unchanged)."""


class WeightGradStore:
    """The deferred weight gradients of one model chunk (see the module docstring)."""

    def __init__(self, chunk: torch.nn.Module):
        from megatron.core.tensor_parallel.layers import (ColumnParallelLinear,
                                                          RowParallelLinear,
                                                          VocabParallelEmbedding)

        linears = [m for m in chunk.modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        embedded = {id(p) for m in chunk.modules() if isinstance(m, VocabParallelEmbedding)
                    for p in m.parameters()}
        self.deferred = {id(m.weight) for m in linears
                         if m.weight is not None and m.weight.requires_grad
                         and id(m.weight) not in embedded}
        self.eager_params = tuple(p for p in chunk.parameters()
                                  if p.requires_grad and id(p) not in self.deferred)
        self._collected: list[_Pending] | None = None

    def input_pass(self, output: torch.Tensor, output_grad: torch.Tensor,
                   input_tensor: torch.Tensor | None) -> PendingWeightGrads:
        """I: one backward from ``output``, restricted to ``input_tensor`` (its ``.grad`` is
        the input gradient) and the parameters that are not deferred (their ``.grad`` and
        hooks, as in a fused backward); frees the graph. Returns what W needs."""
        from torch.autograd import Variable

        inputs = self.eager_params + ((input_tensor,) if input_tensor is not None else ())
        if not inputs:
            raise RuntimeError("zb-h1: a model chunk whose every parameter is a deferred "
                               "linear weight and that has no input: nothing for I to compute")
        with self.collecting() as pending:
            # the engine directly, as Megatron's custom_backward: a sent output's storage is
            # already freed (deallocate_output_tensor) and torch.autograd would reject its shape
            Variable._execution_engine.run_backward(
                (output,), (output_grad,), False, False, inputs, True, True)
        return PendingWeightGrads(pending)

    @staticmethod
    def weight_pass(pending: PendingWeightGrads) -> None:
        """W: the weight-gradient GEMMs of one microbatch, in the order the I made them (a
        fused backward's order), each gradient given to its parameter's accumulator
        (``.grad``, DDP's hook) in one engine call (see ``_WeightGrad``)."""
        from torch.autograd import Variable

        items, pending.pending = pending.pending, []
        if not items:
            return
        chain = items[0].grad_output.new_empty(0)
        for item in reversed(items):  # the backward runs the last node first
            chain = _WeightGrad.apply(chain, item, item.weight)
        Variable._execution_engine.run_backward(
            (chain,), (torch.empty_like(chain),), False, False, (), True, True)

    @contextlib.contextmanager
    def collecting(self):
        """While it is active the linear Function's backward defers this chunk's weights'
        GEMMs into the yielded list."""
        from megatron.core.tensor_parallel.layers import \
            LinearWithGradAccumulationAndAsyncCommunication as Linear

        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("zb-h1: an input-gradient pass inside another")
        self._collected, _ACTIVE = [], self
        original = Linear.__dict__["backward"]
        Linear.backward = staticmethod(_split_backward())
        try:
            yield self._collected
        finally:
            Linear.backward = original
            self._collected, _ACTIVE = None, None

    def defers(self, ctx, weight: torch.Tensor) -> bool:
        """Whether this backward's weight GEMM is left for W."""
        return id(weight) in self.deferred and ctx.grad_output_buffer is None


_SPLIT_BACKWARD = None


def _split_backward():
    """The Function's backward while an I runs (made once: megatron-core's ``custom_bwd``
    wraps it as it wraps the original)."""
    global _SPLIT_BACKWARD
    if _SPLIT_BACKWARD is None:
        from megatron.core.tensor_parallel import layers

        original = layers.LinearWithGradAccumulationAndAsyncCommunication.backward

        @layers.custom_bwd
        def backward(ctx, grad_output):
            input, weight = ctx.saved_tensors
            if _ACTIVE is None or not _ACTIVE.defers(ctx, weight):
                return original(ctx, grad_output)
            return _input_part(ctx, input, weight, grad_output, _ACTIVE._collected)

        _SPLIT_BACKWARD = backward
    return _SPLIT_BACKWARD


def _input_part(ctx, input, weight, grad_output, collected: list) -> tuple:
    """megatron-core's backward of the linear Function without the weight GEMM: the input
    gradient (with its tensor-parallel all-reduce or reduce-scatter) and the bias gradient; the
    GEMM's operands go into ``collected``."""
    from megatron.core.tensor_parallel import layers

    tp_group = ctx.tp_group
    grad_input = grad_output.matmul(weight)
    handle = None
    if ctx.allreduce_dgrad:
        handle = torch.distributed.all_reduce(grad_input, group=tp_group, async_op=True)
    if ctx.sequence_parallel:
        sub_grad_input = torch.empty(list(input.size()), dtype=input.dtype,
                                     device=grad_input.device, requires_grad=False)
        handle = layers.dist_reduce_scatter_func(sub_grad_input, grad_input, group=tp_group,
                                                 async_op=True)
    grad_output = grad_output.contiguous()
    if grad_output.dim() == 3:  # megatron-core's prepare_input_tensors_for_wgrad_compute
        grad_output = grad_output.view(-1, grad_output.shape[2])
    grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
    collected.append(_Pending(weight, input, grad_output, ctx.main_grad,
                              ctx.gradient_accumulation_fusion, ctx.sequence_parallel, tp_group))
    if handle is not None:
        handle.wait()
    if ctx.sequence_parallel:
        grad_input = sub_grad_input
    return grad_input, None, grad_bias, None, None, None, None, None, None


def _weight_grad(item: _Pending) -> torch.Tensor | None:
    """The GEMM megatron-core's backward runs for the weight: its gradient, or, with
    gradient-accumulation fusion, the sum into ``main_grad`` and the placeholder gradient the
    fused backward hands to the accumulator (None where the weight has no
    ``grad_added_to_main_grad``, as there)."""
    from megatron.core.tensor_parallel import layers

    total_input = _gathered(item) if item.sequence_parallel else item.input
    total_input = total_input.contiguous()
    if total_input.dim() == 3:
        total_input = total_input.view(-1, total_input.shape[2])
    weight = item.weight
    if not item.fusion:
        return item.grad_output.t().matmul(total_input)
    weight.main_grad = item.main_grad
    accumulate = (layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32
                  if weight.main_grad.dtype == torch.float32
                  else layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16)
    accumulate(total_input, item.grad_output, weight.main_grad)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.main_grad.shape, dtype=item.input.dtype, device=weight.main_grad.device,
                requires_grad=False)


def _gathered(item: _Pending) -> torch.Tensor:
    """Sequence parallelism: the layer's whole input, all-gathered over the tensor-parallel
    group as megatron-core's backward gathers it (every rank runs the same W's in order)."""
    from megatron.core.parallel_state import get_global_memory_buffer
    from megatron.core.tensor_parallel import layers

    size = list(item.input.size())
    size[0] *= item.tp_group.size()
    buffer = get_global_memory_buffer().get_tensor(size, item.input.dtype, "mpu")
    layers.dist_all_gather_func(buffer, item.input, group=item.tp_group)
    return buffer
