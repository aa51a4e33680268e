"""2BW's optimizer step, deferred to the point where its result is first read.

Under 2BW the step after batch t makes W(t+1), which a stage first reads at the forward of
batch t+2. The step is split, all on the one thread that issues every communication:
begin(t) at the stage's step action (local gradient finalization, a copy of the gradients,
the cross-stage collectives launched with ``async_op=True``); progress() between actions
(never blocks); the loop's ``optimizer.step()`` intercepted (records lr and weight decay);
apply() before the first step of the program that needs W(t+1) (comm.reads_from: a cut every
stage crosses at matching exchanges), at the next begin() at the latest, and before a drain.

Invariants: at most one step is pending; the copy is taken before any gradient of batch t+1
exists; every rank issues each group's collectives in the same order; the result equals the
synchronous step bit for bit in fp32. The whole story (the grad-norm chain, the collectives per
group and their order, chained and MoE optimizers, what is not deferred): docs/deferred_step.md.
"""

from __future__ import annotations

import datetime
import math

import torch

__all__ = ["DeferredStep", "why_not_deferred", "norm_groups"]


def members(optimizer) -> list:
    """The megatron-core optimizers that own the parameter groups, in step order: a
    ChainedOptimizer's members, or the optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def why_not_deferred(optimizer, config, chunks: list) -> str | None:
    """Why the step of this stage cannot be deferred, or None when it can (and is worth it:
    its step holds a collective that spans the pipeline; a chain of several optimizers' always
    does, as it all-reduces the grad norm also without clipping, which the deferred step
    skips). ``chunks``: the stage's model chunks (several with virtual stages)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    chain = members(optimizer)
    for inner in chain:
        if not all(hasattr(inner, name) for name in ("prepare_grads", "step_with_ready_grads",
                                                     "get_main_grads_for_grad_norm")):
            return f"{type(inner).__name__} is not a megatron-core optimizer"
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return "one pipeline stage (nothing to wait for)"
    if any(getattr(inner, "grad_scaler", None) is not None for inner in chain):
        return "fp16 loss scaling (the next batch's loss scale depends on this step)"
    if any(getattr(chunk, "ddp_config", None) is not None
           and chunk.ddp_config.overlap_grad_reduce for chunk in chunks):
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
    if chain[0].config.clip_grad <= 0 and _tied_embedding(chunks) is None and len(chain) == 1:
        return "no clipping and no tied embeddings (the step is stage-local already)"
    return None


def _tied_embedding(chunks: list):
    """This stage's copy of the word embeddings when it is shared with another stage: the
    first chunk's input embedding on the first stage, the last chunk's output layer on the
    last (the other chunks have neither)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model

    group = ps.get_embedding_group(check_initialized=False)
    if group is None or torch.distributed.get_world_size(group) < 2 or \
            torch.distributed.get_rank() not in torch.distributed.get_process_group_ranks(group):
        return None
    for chunk in chunks:
        model = get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)
        if not getattr(model, "share_embeddings_and_output_weights", False):
            continue
        weight = model.shared_embedding_or_output_weight()
        if weight is not None:
            return weight
    return None


_MAIN_GROUPS = (("float16_groups", "fp32_from_float16_groups"),
                ("model_float16_groups", "shard_fp32_from_float16_groups"),
                ("model_fp32_groups", "shard_fp32_groups"))
"""(model parameters, the parameters the optimizer steps for them): the mixed-precision
optimizer's fp32 master copies, the distributed optimizer's shards of its fp32 master copies
and of fp32 parameters (views of megatron-core's parameter buffer)."""


def _main_param(chain: list, param):
    """The parameter the chain's optimizers step for the model parameter ``param``: its fp32
    master copy under bf16, this rank's shard with the distributed optimizer, itself otherwise.

    With the distributed optimizer a shared word embedding has a DDP bucket of its own on both
    stages (megatron-core's ``_does_param_require_new_bucket``), so each data-parallel rank owns
    the same range of it on the first and the last stage, and the embedding group's all-reduce
    of the two shards' gradients is that of the full gradients, restricted to the range."""
    for optimizer in chain:
        for model_name, main_name in _MAIN_GROUPS:
            for model_group, main_group in zip(getattr(optimizer, model_name, ()),
                                               getattr(optimizer, main_name, ())):
                for model_param, main_param in zip(model_group, main_group):
                    if model_param is param:
                        return main_param
    return param


def _group_ranks(group) -> list[int]:
    """The global ranks of ``group`` (None: the default group), for error messages."""
    if group is None:
        return list(range(torch.distributed.get_world_size()))
    return torch.distributed.get_process_group_ranks(group)


def norm_groups(chain: list) -> list[list[int]]:
    """The members whose gradients one norm spans, as megatron-core's ``ChainedOptimizer.
    get_grad_norm`` takes it: all of them together where they share one grad-stats group;
    otherwise each member its own (MoE's expert optimizer: its grad-stats group is the expert
    tensor x expert x pipeline group), the norms then combined as sqrt(sum of squares)."""
    groups = {id(inner.get_grad_stats_parallel_group()) for inner in chain}
    if len(groups) == 1:
        return [list(range(len(chain)))]
    return [[index] for index in range(len(chain))]


class _Square:
    """A chain step: the local squared norm of norm group ``index`` (the step after it
    all-reduces it over a group)."""

    def __init__(self, index: int):
        self.index = index


class DeferredStep:
    """One stage's pending optimizer step (see the module docstring)."""

    def __init__(self, optimizer, config, chunks: list,
                 timeout: datetime.timedelta | None = None):
        """``chunks``: the stage's model chunks, whose one optimizer steps them together (one
        weight version spans them). ``timeout``: the bound on every wait on the step's
        collectives, which is each group's own timeout, named in errors (None: the process's
        --distributed-timeout-minutes, which every group was created with)."""
        from megatron.core import parallel_state as ps

        from megatron_2bw.runtime import distributed

        self.optimizer = optimizer
        self.members = members(optimizer)
        self.config = config
        self.chunks = list(chunks)
        self.timeout = timeout if timeout is not None else distributed.timeout()
        self.params = [p for inner in self.members for p in inner.get_parameters()]
        self.copies: list[torch.Tensor | None] | None = None
        embedding = _tied_embedding(self.chunks)
        main = None if embedding is None else _main_param(self.members, embedding)
        self.embedding_index = next((i for i, p in enumerate(self.params) if p is main), None)
        # a layer-wise optimizer's rank that steps no copy of the embedding still sums its
        # gradient with the other stage's (that stage's rank of this replica may step it)
        self.foreign_embedding = embedding if self.embedding_index is None else None
        self._foreign_copy: torch.Tensor | None = None
        self.gather = getattr(optimizer, "allgather_params", None)  # layer-wise: after step
        self.embedding_group = ps.get_embedding_group(check_initialized=False)
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pending_version: int | None = None
        self.hyper: list[tuple] | None = None
        self.last_grad_norm: float | None = None
        self._norm: float | None = None
        # the pending step's collectives: launched and not waited for yet (work, group, what);
        # the one the rest of the chain waits for; the chain's remaining steps (_Square or
        # (group, what, norm group) for an all-reduce of that group's squared norm); the
        # squared norms
        self._works: list[tuple] = []
        self._gate: tuple | None = None
        self._chain: list = []
        self.launched: dict[str, int] = {}  # collectives launched so far, by what they are
        self.norm_groups = (norm_groups(self.members) if self.gather is None
                            else [list(range(len(self.members)))])  # one norm, as its own
        self._grads_for_norm: list[list[torch.Tensor]] = []  # per norm group
        self._squared: list[torch.Tensor | None] = []
        self._original_step = optimizer.step
        optimizer.step = self.intercepted_step

    def detach(self) -> None:
        """Give the optimizer its own step() back."""
        self.optimizer.step = self._original_step

    def _finalize_locally(self) -> None:
        """megatron-core's ``finalize_model_grads`` less its cross-stage all-reduces (the
        word-embedding one is launched by begin()): the data-parallel reduction and, with
        sequence parallelism, the layer-norm gradients over the tensor-parallel group."""
        from megatron.core.distributed.finalize_model_grads import (
            _allreduce_non_tensor_model_parallel_grads, reset_model_temporary_tensors)

        for chunk in self.chunks:
            chunk.finish_grad_sync()
        _allreduce_non_tensor_model_parallel_grads(self.chunks, self.config, self.tp_group)
        reset_model_temporary_tensors(self.config, self.chunks)

    # ---- the parts ------------------------------------------------------------------------
    def begin(self, new_version: int) -> None:
        """Batch ``new_version - 1``'s gradients are final on this stage: copy them and launch
        the cross-stage collectives that need nothing else."""
        from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

        if self.pending_version is not None:
            raise RuntimeError(f"step {self.pending_version} still pending at step {new_version}")
        self._finalize_locally()
        if any([inner.prepare_grads() for inner in self.members]):
            raise RuntimeError("inf/nan check in a deferred step (fp16 is not deferred)")
        if self.copies is None:
            self.copies = [None if p.grad is None else torch.empty_like(p.grad)
                           for p in self.params]
        for p, copy in zip(self.params, self.copies):
            if copy is not None:
                copy.copy_(p.grad)
                p.grad = copy
        grads_for_norm = [[g for index in indices
                           for g in self.members[index].get_main_grads_for_grad_norm()]
                          for indices in self.norm_groups]
        for p in self.params:  # a backward of batch t+1 would accumulate into a .grad left set
            p.grad = None
        embedding_grad = (None if self.embedding_index is None
                          else self.copies[self.embedding_index])
        if self.foreign_embedding is not None:  # a copy kept across steps, as self.copies
            grad = self.foreign_embedding.main_grad.detach()
            if self._foreign_copy is None:
                self._foreign_copy = torch.empty_like(grad, dtype=torch.float32)
            embedding_grad = self._foreign_copy
            embedding_grad.copy_(grad)
        self.pending_version, self.hyper, self._norm = new_version, None, None
        self._works, self._gate, self._chain = [], None, []
        self._squared = [None] * len(self.norm_groups)
        if embedding_grad is not None:
            work = self._launch(embedding_grad, self.embedding_group,
                                "the word-embedding gradient all-reduce")
            if any(grad is embedding_grad for grads in grads_for_norm for grad in grads):
                self._gate = work  # the norm reads the all-reduced embedding gradient
        if self._clip > 0:
            # per norm group, get_grad_norm_fp32's groups: FSDP's data-parallel one (DTensor
            # grads), then the grad-stats one of its (first) member
            self._grads_for_norm = []
            for index, (indices, grads) in enumerate(zip(self.norm_groups, grads_for_norm)):
                data_parallel_group = None
                for grad in grads:
                    data_parallel_group = get_data_parallel_group_if_dtensor(
                        grad, data_parallel_group)
                self._grads_for_norm.append([to_local_if_dtensor(grad) for grad in grads])
                self._chain.append(_Square(index))
                if data_parallel_group:
                    self._chain.append((data_parallel_group, "the grad-norm all-reduce over "
                                        "FSDP's data-parallel group", index))
                self._chain.append((self._grad_stats_group(indices[0]),
                                    "the grad-norm all-reduce over the grad-stats group"
                                    + ("" if len(self.norm_groups) == 1
                                       else f" (optimizer {indices[0]} of the chain)"), index))
            self._advance(block=False)

    def _grad_stats_group(self, member: int):
        """The group a norm group's squared norm is summed over: its member's grad-stats
        group; the world (None) under a layer-wise optimizer, whose data-parallel ranks each
        hold the gradients of the parameters they step (its ``get_grad_norm``)."""
        if self.gather is not None:
            return None
        return self.members[member].get_grad_stats_parallel_group()

    def progress(self) -> None:
        """Move the pending step's chain on without blocking: once the collective the grad
        norm waits for has completed, compute the local squared norm and launch its
        all-reduce. Called between actions; costs one attribute test when nothing waits."""
        if self._chain:
            self._advance(block=False)

    def intercepted_step(self):
        """Megatron's ``optimizer.step()``: remember step t's lr and weight decay (the loop
        moves the scheduler on before the step runs) and return at once. The grad norm
        returned is the last applied step's, one iteration behind."""
        if self.pending_version is None:
            return self._original_step()
        self.hyper = [(group["lr"], group.get("weight_decay")) for group in self._groups()]
        return True, self.last_grad_norm, None

    def apply(self, versions) -> None:
        """Run the pending step: wait for its collectives, make the new weight version."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        if self.pending_version is None:
            return
        self.wait_collectives()
        if self.hyper is None:
            raise RuntimeError("optimizer.step() was not called after the training call")
        versions.fork(self.pending_version)
        for p, copy in zip(self.params, self.copies):
            p.grad = copy
        if self._clip > 0:
            clip_grad_by_total_norm_fp32(self.params, self._clip, self._norm)
        now = [(group["lr"], group.get("weight_decay")) for group in self._groups()]
        self._set_hyper(self.hyper)
        try:
            for inner in self.members:
                inner.step_with_ready_grads()
        finally:
            self._set_hyper(now)
        if self.gather is not None:
            self.gather()  # the parameters the other data-parallel ranks stepped
        for p in self.params:
            p.grad = None
        versions.after_step()
        self.last_grad_norm = self._norm
        self.pending_version = None

    def wait_collectives(self) -> None:
        """Finish the chain and wait (bounded) for every collective of the pending step: the
        only wait a deferred step adds to the stage. Sets the step's grad norm."""
        if self.pending_version is None:
            return
        self._advance(block=True)
        works, self._works = self._works, []
        for work in works:
            self._wait(work)
        if any(squared is not None for squared in self._squared):
            # get_grad_norm_fp32, norm 2, per norm group; several as ChainedOptimizer's
            # get_grad_norm combines its members' norms
            norms = [squared.item() ** (1.0 / 2.0) for squared in self._squared]
            self._norm = norms[0] if len(norms) == 1 else \
                math.sqrt(sum([(norm if norm else 0.0) ** 2 for norm in norms]))
            self._squared, self._grads_for_norm = [], []

    # ---- the collectives ------------------------------------------------------------------
    def _advance(self, block: bool) -> None:
        """Run the chain's steps whose input is ready; with ``block``, all of them."""
        while self._chain:
            if self._gate is not None:
                if not block and not self._gate[0].is_completed():
                    return
                gate, self._gate = self._gate, None
                self._works = [entry for entry in self._works if entry is not gate]
                self._wait(gate)  # orders this stream after the collective's (NCCL)
            step = self._chain.pop(0)
            if isinstance(step, _Square):
                self._squared[step.index] = self._local_squared_norm(step.index)
            else:
                group, what, index = step
                work = self._launch(self._squared[index], group, what)
                following = self._chain[0] if self._chain else None
                if isinstance(following, tuple) and following[2] == index:
                    self._gate = work  # its next link all-reduces this result further

    def _local_squared_norm(self, index: int) -> torch.Tensor:
        """This rank's sum of squares of norm group ``index``'s gradients, as
        get_grad_norm_fp32 computes it for norm 2 (one multi-tensor L2 kernel, then ``** 2``)."""
        from megatron.core.optimizer import clip_grads

        grads = self._grads_for_norm[index]
        if grads:
            dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device="cuda")
            grad_norm, _ = clip_grads.multi_tensor_applier(
                clip_grads.l2_norm_impl, dummy_overflow_buf, [grads], False)
        else:
            grad_norm = torch.zeros(1, dtype=torch.float, device="cuda")
        return grad_norm ** 2.0

    def _launch(self, tensor: torch.Tensor, group, what: str) -> tuple:
        """Start a sum all-reduce of ``tensor`` over ``group``; the entry is kept for apply()."""
        try:
            work = torch.distributed.all_reduce(tensor, group=group, async_op=True)
        except Exception as error:  # gloo raises RuntimeError, NCCL DistBackendError
            raise RuntimeError(self._failed(what, group, error)) from error
        entry = (work, group, what)
        self._works.append(entry)
        self.launched[what] = self.launched.get(what, 0) + 1
        return entry

    def _wait(self, entry: tuple) -> None:
        """A plain ``wait()``, bounded by the group's timeout (every group was created with
        --distributed-timeout-minutes); a timed wait would make NCCL's host thread poll."""
        work, group, what = entry
        timeout = self.timeout
        try:
            completed = work.wait()
        except Exception as error:
            raise RuntimeError(self._failed(what, group, error, timeout)) from error
        if completed is False:  # a backend that reports the timeout instead of raising
            raise RuntimeError(self._failed(what, group, "timed out", timeout))

    def _failed(self, what: str, group, error, timeout: datetime.timedelta | None = None) -> str:
        bound = "" if timeout is None else f" or ran past its timeout ({timeout})"
        return (f"the deferred optimizer step {self.pending_version}: {what} with ranks "
                f"{_group_ranks(group)} failed{bound}: {error}")

    @property
    def _clip(self) -> float:
        """--clip-grad (every member's config holds it)."""
        return self.members[0].config.clip_grad

    def _groups(self) -> list[dict]:
        """Every member's parameter groups, in step order."""
        return [group for inner in self.members for group in inner.param_groups]

    def _set_hyper(self, values: list[tuple]) -> None:
        for group, (lr, weight_decay) in zip(self._groups(), values):
            group["lr"] = lr
            if weight_decay is not None:
                group["weight_decay"] = weight_decay
