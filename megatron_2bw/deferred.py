"""2BW's optimizer step, deferred to the point where its result is first read.

Under 2BW the step after batch t makes W(t+1), and a stage first reads W(t+1) at the forward
of batch t+2 (batch b reads version b-1, PipeDream-2BW Section 3.1). With gradient clipping or
tied embeddings the step holds collectives that span the pipeline: the grad-norm all-reduce
over the model-parallel group and the word-embedding all-reduce between the first and the last
stage. Run where Megatron's loop calls ``optimizer.step()``, they hold every stage until stage
0 ends its batch, (d-1) backward passes after the last stage ends it. Deferred, the step is
split in three:

    begin(t)     at the stage's step action (its last backward of batch t is done): the
                 stage-local gradient finalization (data-parallel and sequence-parallel
                 all-reduces), ``prepare_grads``, a copy of the optimizer's gradients, and a
                 helper thread that runs the cross-stage collectives on that copy;
    intercepted  Megatron's loop calls ``optimizer.step()``: step t's learning rate and weight
                 decay are recorded and the call returns at once;
    apply()      before the first action that reads W(t+1), at the next begin() at the latest,
                 and before a drain: joins the thread, forks the weights, clips the copy by the
                 global norm and runs ``step_with_ready_grads`` with step t's lr.

Invariants: at most one step is pending; the copy is taken before any gradient of batch t+1
exists, and the optimizer reads only the copy; the step writes the slot ``fork`` freed, which
no microbatch in flight reads; the result equals the synchronous step bit for bit in fp32
(same reductions on the same values, in the same order per tensor).

Not deferred (the step stays where the loop calls it): fp16 loss scaling (the scale of batch
t+1's backward depends on step t's inf check), DDP's overlapped gradient reduction, per-token
loss normalisation, position embeddings shared across stages, a custom
``finalize_model_grads_func``, and a ChainedOptimizer of more than one optimizer.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["DeferredStep", "why_not_deferred"]


def _inner(optimizer):
    """The optimizer that owns the parameter groups (a one-member ChainedOptimizer's member)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None and len(chained) == 1:
        return chained[0]
    return optimizer


def why_not_deferred(optimizer, config, chunk) -> str | None:
    """Why the step of this stage cannot be deferred, or None when it can (and is worth it:
    its step holds a collective that spans the pipeline; a ChainedOptimizer's always does, as
    it all-reduces the grad norm also without clipping, which the deferred step skips)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    inner = _inner(optimizer)
    if getattr(optimizer, "chained_optimizers", None) is not None and inner is optimizer:
        return "a ChainedOptimizer of several optimizers"
    if not all(hasattr(inner, name) for name in ("prepare_grads", "step_with_ready_grads",
                                                 "get_main_grads_for_grad_norm")):
        return f"{type(inner).__name__} is not a megatron-core optimizer"
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return "one pipeline stage (nothing to wait for)"
    if getattr(inner, "grad_scaler", None) is not None:
        return "fp16 loss scaling (the next batch's loss scale depends on this step)"
    if getattr(chunk, "ddp_config", None) is not None and chunk.ddp_config.overlap_grad_reduce:
        return "--overlap-grad-reduce"
    if config.calculate_per_token_loss:
        return "per-token loss normalisation"
    if getattr(config, "has_cond_embedder", False) or config.moe_router_enable_expert_bias:
        return "a conditional embedder or MoE expert bias (more cross-stage reductions)"
    if config.finalize_model_grads_func is not finalize_model_grads:
        return "a custom finalize_model_grads_func"
    pos_group = ps.get_position_embedding_group(check_initialized=False)
    if pos_group is not None and torch.distributed.get_world_size(pos_group) > 1 \
            and torch.distributed.get_rank() in torch.distributed.get_process_group_ranks(pos_group):
        return "position embeddings shared across stages"
    chained = getattr(optimizer, "chained_optimizers", None) is not None
    if inner.config.clip_grad <= 0 and _tied_embedding(chunk) is None and not chained:
        return "no clipping and no tied embeddings (the step is stage-local already)"
    return None


def _tied_embedding(chunk):
    """This stage's copy of the word embeddings when it is shared with another stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model

    group = ps.get_embedding_group(check_initialized=False)
    if group is None or torch.distributed.get_world_size(group) < 2 or \
            torch.distributed.get_rank() not in torch.distributed.get_process_group_ranks(group):
        return None
    model = get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)
    if not getattr(model, "share_embeddings_and_output_weights", False):
        return None
    return model.shared_embedding_or_output_weight()


def _main_param(optimizer, param):
    """The parameter the optimizer steps for the model parameter ``param`` (its fp32 master
    copy under bf16, itself in fp32)."""
    for model_group, main_group in zip(getattr(optimizer, "float16_groups", ()),
                                       getattr(optimizer, "fp32_from_float16_groups", ())):
        for model_param, main_param in zip(model_group, main_group):
            if model_param is param:
                return main_param
    return param


class DeferredStep:
    """One stage's pending optimizer step (see the module docstring)."""

    def __init__(self, optimizer, config, chunk):
        from megatron.core import parallel_state as ps

        self.optimizer = optimizer
        self.inner = _inner(optimizer)
        self.config = config
        self.chunk = chunk
        self.params = self.inner.get_parameters()
        self.copies: list[torch.Tensor | None] | None = None
        embedding = _tied_embedding(chunk)
        main = None if embedding is None else _main_param(self.inner, embedding)
        self.embedding_index = next((i for i, p in enumerate(self.params) if p is main), None)
        self.embedding_group = ps.get_embedding_group(check_initialized=False)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pending_version: int | None = None
        self.hyper: list[tuple] | None = None
        self.last_grad_norm: float | None = None
        self._thread: threading.Thread | None = None
        self._norm: float | None = None
        self._error: BaseException | None = None
        self._original_step = optimizer.step
        optimizer.step = self.intercepted_step

    def detach(self) -> None:
        """Give the optimizer its own step() back."""
        self.optimizer.step = self._original_step

    def _finalize_locally(self) -> None:
        """megatron-core's ``finalize_model_grads`` less its cross-stage all-reduces (the
        word-embedding one runs in the helper thread): the data-parallel reduction and, with
        sequence parallelism, the layer-norm gradients over the tensor-parallel group."""
        from megatron.core.distributed.finalize_model_grads import (
            _allreduce_non_tensor_model_parallel_grads, reset_model_temporary_tensors)

        self.chunk.finish_grad_sync()
        _allreduce_non_tensor_model_parallel_grads([self.chunk], self.config, self.tp_group)
        reset_model_temporary_tensors(self.config, [self.chunk])

    # ---- the three parts ----------------------------------------------------------------
    def begin(self, new_version: int) -> None:
        """Batch ``new_version - 1``'s gradients are final on this stage: copy them and start
        the cross-stage collectives."""
        if self.pending_version is not None:
            raise RuntimeError(f"step {self.pending_version} still pending at step {new_version}")
        self._finalize_locally()
        if self.inner.prepare_grads():
            raise RuntimeError("inf/nan check in a deferred step (fp16 is not deferred)")
        if self.copies is None:
            self.copies = [None if p.grad is None else torch.empty_like(p.grad)
                           for p in self.params]
        for p, copy in zip(self.params, self.copies):
            if copy is not None:
                copy.copy_(p.grad)
                p.grad = copy
        grads_for_norm = self.inner.get_main_grads_for_grad_norm()
        for p in self.params:  # a backward of batch t+1 would accumulate into a .grad left set
            p.grad = None
        embedding_grad = (None if self.embedding_index is None
                          else self.copies[self.embedding_index])
        self.pending_version, self.hyper, self._norm, self._error = new_version, None, None, None
        self._thread = threading.Thread(target=self._collectives,
                                        args=(grads_for_norm, embedding_grad),
                                        name=f"2bw-step-{new_version}", daemon=True)
        self._thread.start()

    def _collectives(self, grads_for_norm: list[torch.Tensor],
                     embedding_grad: torch.Tensor | None) -> None:
        """The helper thread: the all-reduces Megatron's step runs, in its order, on the copy:
        the tied embedding's gradient between first and last stage, then the grad norm."""
        from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

        from megatron_2bw.runtime import cpu

        try:
            with cpu.thread_context():
                if embedding_grad is not None:
                    torch.distributed.all_reduce(embedding_grad, group=self.embedding_group)
                if self.inner.config.clip_grad > 0:
                    group = self.inner.get_grad_stats_parallel_group()
                    self._norm = get_grad_norm_fp32(grads_for_norm,
                                                    grad_stats_parallel_group=group)
        except BaseException as error:  # re-raised by apply() in the main thread
            self._error = error

    def intercepted_step(self):
        """Megatron's ``optimizer.step()``: remember step t's lr and weight decay (the loop
        moves the scheduler on before the step runs) and return at once. The grad norm
        returned is the last applied step's, one iteration behind."""
        if self.pending_version is None:
            return self._original_step()
        self.hyper = [(group["lr"], group.get("weight_decay"))
                      for group in self.inner.param_groups]
        return True, self.last_grad_norm, None

    def apply(self, versions) -> None:
        """Run the pending step: wait for its collectives, make the new weight version."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        if self.pending_version is None:
            return
        self.wait_collectives()
        if self._error is not None:
            raise RuntimeError(f"the deferred optimizer step {self.pending_version} failed: "
                               f"{self._error}") from self._error
        if self.hyper is None:
            raise RuntimeError("optimizer.step() was not called after the training call")
        versions.fork(self.pending_version)
        for p, copy in zip(self.params, self.copies):
            p.grad = copy
        clip = self.inner.config.clip_grad
        if clip > 0:
            clip_grad_by_total_norm_fp32(self.params, clip, self._norm)
        now = [(group["lr"], group.get("weight_decay")) for group in self.inner.param_groups]
        self._set_hyper(self.hyper)
        try:
            self.inner.step_with_ready_grads()
        finally:
            self._set_hyper(now)
        for p in self.params:
            p.grad = None
        versions.after_step()
        self.last_grad_norm = self._norm
        self.pending_version = None

    def wait_collectives(self) -> None:
        """Block until the helper thread's all-reduces are done (the only wait a deferred
        step adds to the main thread)."""
        self._thread.join()

    def _set_hyper(self, values: list[tuple]) -> None:
        for group, (lr, weight_decay) in zip(self.inner.param_groups, values):
            group["lr"] = lr
            if weight_decay is not None:
                group["weight_decay"] = weight_decay
