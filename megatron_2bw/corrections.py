"""Corrections of 2BW's one-step-stale update (``--stale-weight-correction``).

2BW's step t makes W(t+1) = W(t) - U_t, U_t the optimizer's update from the gradient at
W(max(t-1, 0)) (weight decay included). Each rule changes one thing:

    none     the paper's update, unchanged (no object is made)
    predict  batch t+1 reads R(t) = W(t) + s (W(t) - W(t-1)) (PipeOptim, Guan et al. 2023)
    dc       the clipped gradient g becomes g + lambda g*g (W(t) - W(t-1)) (DC-ASGD, 2017)
    ef       W(t+1) = W(t) - U_t - beta (U_t - U_{t-1}), t >= 1 (Zmushko et al., 2606.30634)

Invariants: each works where the optimizer steps, on its fp32 parameters (the weights, or
the master copies under bf16 and fp16, or this rank's shards of either). Memory per stage
beyond the two versions: predict and dc one more version (under bf16 the masters' fp32 W(t)
or W(t-1) too), ef one fp32 tensor (two under bf16). docs/schedules.md, "Correcting 2BW's
stale update".
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

import torch

from megatron_2bw.flag_types import CORRECTION_RULES
from megatron_2bw.weights import HOME, WeightVersions

__all__ = ["RULES", "StaleCorrection", "PredictedVersions", "DelayCompensation",
           "ErrorFeedback"]

RULES = CORRECTION_RULES
DEFAULT_COEFFICIENT = {"predict": 1.0, "dc": 1e5, "ef": 2.0}
"""s, lambda and beta when --stale-weight-correction-coeff is not given (docs/convergence.md's
sweeps). ef's beta 2 trained better than 1 (and 0.5, 3, 4) with Adam and Muon on both of its
models at lr 1e-3; predict's s 1 is PipeOptim's one step. dc's lambda multiplies
g * g * (W(t) - W(t-1)), which is tiny at a clipped gradient's per-element size (~1e-3) and one
step's change (~lr): 1e5 trained best of 1e3 ... 1e6 on docs/convergence.md's small model at lr
1e-3 (1e6 diverged); it scales with the model (the gradient's elements shrink as it grows)."""


@dataclass(frozen=True)
class StaleCorrection:
    """The rule a 2BW run corrects its stale update with, and its coefficient."""

    rule: str = "none"
    coefficient: float | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "StaleCorrection":
        return cls(getattr(args, "stale_weight_correction", "none"),
                   getattr(args, "stale_weight_correction_coeff", None))

    @property
    def coeff(self) -> float:
        return DEFAULT_COEFFICIENT[self.rule] if self.coefficient is None else self.coefficient

    def versions(self, params, keep_from) -> WeightVersions:
        """The version store of the rule: predict keeps R(v) apart from W; dc keeps one
        version more, W(t-1) through step t."""
        if self.rule == "predict":
            return PredictedVersions(params, keep_from, self.coeff)
        if self.rule == "dc":
            return WeightVersions(params, keep_from=lambda v: keep_from(v) - 1)
        return WeightVersions(params, keep_from=keep_from)

    def bind(self, versions: WeightVersions, optimizer):
        """The rule's per-stage object: after_update() after each step (predict, ef), the
        optimizer's pre-step hooks (dc); None for none."""
        if self.rule == "predict":
            return versions.watch(optimizer)
        if self.rule == "dc":
            return DelayCompensation(versions, optimizer, self.coeff)
        if self.rule == "ef":
            return ErrorFeedback(versions, optimizer, self.coeff)
        return None


class PredictedVersions(WeightVersions):
    """2BW's store under ``predict``: the home slot holds the newest true weights W (the
    optimizer steps them, evaluation reads them); the slot of each alive version v holds
    R(v), what microbatches read. ``fork`` copies W(t) into the new version's slot and
    ``after_update`` turns it into R(t+1) once the optimizer wrote W(t+1): three slots.
    Bound to an optimizer with fp32 master copies or a sharded state (``watch``), R is made
    where it steps and its ranges are summed over the replicas that share the steps."""

    def __init__(self, params, keep_from, scale: float):
        super().__init__(params, keep_from)
        self.scale = scale
        self.pending: int | None = None  # the version whose R after_update makes
        self.stepping: _Placement | None = None  # where R is made, when not from the slots
        self.before: dict[int, torch.Tensor] = {}  # master copy -> W(t), during a step
        self.fresh: set[int] = set()  # the master copies the pending step stepped
        self.hooks: list = []

    def watch(self, optimizer) -> "PredictedVersions":
        """Make R from ``optimizer``'s fp32 parameters where the weights are not all of them:
        its master copies (bf16, fp16: the difference of two 16-bit versions is mostly
        rounding) or this rank's shards (the rest come from the replicas, all-gathered or not
        yet, --overlap-param-gather)."""
        from megatron_2bw.deferred import members

        placement = _Placement(self, optimizer)
        if placement.masters or placement.shared:
            self.stepping = placement
            self.hooks = [inner.optimizer.register_step_pre_hook(self._remember)
                          for inner in members(optimizer)]
        return self

    def detach(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    @torch.no_grad()
    def _remember(self, torch_optimizer, args, kwargs) -> None:
        """W(t) of the master copies the step is about to change."""
        for p in _params(torch_optimizer):
            if id(p) in self.stepping.masters:
                self.before.setdefault(id(p), torch.empty_like(p)).copy_(p)
                self.fresh.add(id(p))

    def use_trained(self) -> None:
        self._point(HOME)

    def fork(self, new_version: int) -> None:
        newest = self.newest
        if new_version != newest + 1:
            raise ValueError(f"fork({new_version}) after version {newest}: versions must be "
                             "made in order")
        if self.pending is not None:
            raise RuntimeError(f"predict: R({self.pending}) was not made before the next step")
        self._point(HOME)
        kept = {v: s for v, s in self.slot_of.items() if v >= self.keep_from(new_version)}
        if kept.get(newest) == HOME:  # R(newest) = W(newest) there: the step overwrites it
            kept[newest] = self._copy_home_to(self._free_slot(set(kept.values())))
        snapshot = self._copy_home_to(self._free_slot(set(kept.values())))
        self.slot_of = {**kept, new_version: snapshot}
        self.pending, self.derived = new_version, None
        self.fresh.clear()
        self._counters = [p._version for p in self.params]

    def _copy_home_to(self, slot: int) -> int:
        with torch.no_grad():
            for dst, src in zip(self.slot_tensors(slot), self.slots[HOME]):
                dst.copy_(src)
        return slot

    @torch.no_grad()
    def after_update(self) -> None:
        """R(t+1) = (1 + s) W(t+1) - s W(t), in the slot fork filled with W(t)."""
        if self.pending is None:
            return
        predicted = self.slots[self.slot_of[self.pending]]
        if self.stepping is None:
            for r, w in zip(predicted, self.slots[HOME]):
                r.mul_(-self.scale).add_(w, alpha=1.0 + self.scale)
        else:
            self._predict_where_stepped(predicted)
        self.pending = None

    def _predict_where_stepped(self, predicted: list[torch.Tensor]) -> None:
        """R's ranges from the optimizer's fp32 parameters (W(t) a master copy's own, else
        the slot's, fork's copy; a skipped step leaves R = W), then the shared weights whole."""
        s, stepping = self.scale, self.stepping
        for p in stepping.params:
            r = stepping.range_of(predicted, p)
            if id(p) not in stepping.masters:
                r.mul_(-s).add_(p, alpha=1.0 + s)
            elif id(p) in self.fresh:
                r.copy_(p * (1.0 + s) - self.before[id(p)] * s)
            else:
                r.copy_(p)
        self.fresh.clear()
        for r, whole in zip(predicted, stepping.gathered(predicted)):
            if whole is not r:
                r.copy_(whole)

    def state_tensors(self) -> list[torch.Tensor]:
        """What a checkpoint holds beyond W and the older versions: R(newest)."""
        return self.slots[self.slot_of[self.newest]]

    def load_targets(self) -> list[torch.Tensor]:
        return self.slot_tensors(2)

    def state_loaded(self) -> None:
        """After ``loaded``: R(newest) was read into slot 2."""
        self.slot_of[self.newest] = 2


class DelayCompensation:
    """DC-ASGD's gradient: a pre-step hook on every torch optimizer of the stage adds
    lambda g * g * (W(t) - W(t-1)) to each parameter's (clipped) gradient, W(t) the weights
    the step starts from. In fp32 W(t-1) is the older version the store keeps; under bf16 and
    fp16 the optimizer steps fp32 master copies, whose W(t-1) the hook keeps itself (the
    16-bit versions' difference is mostly rounding), from the second step taken on."""

    def __init__(self, versions: WeightVersions, optimizer, lam: float):
        from megatron_2bw.deferred import members

        self.versions, self.lam = versions, lam
        self.hooks = [inner.optimizer.register_step_pre_hook(self._compensate)
                      for inner in members(optimizer)]
        self._where: dict[int, tuple[int, int]] = {}
        masters = _master_copies(members(optimizer), versions.params)
        # W(t-1) of the master copies, where the optimizer steps them
        self.state = _WeightShaped(versions, optimizer) if masters else None
        self.holds_state = self.state is not None
        self.stepped: set[int] = set()

    def detach(self) -> None:
        for hook in self.hooks:
            hook.remove()

    @torch.no_grad()
    def _compensate(self, torch_optimizer, args, kwargs) -> None:
        read = self.versions.newest - 2  # the step makes `newest`; its gradient read t - 1
        older = self.versions.tensors_of(read) if read in self.versions.alive else None
        for p in _params(torch_optimizer):
            if p.grad is None:
                continue
            if self.state is not None and id(p) in self.state.masters:
                before = self.state.view(p)
                if id(p) in self.stepped:
                    p.grad.addcmul_(p.grad * (p - before), p.grad, value=self.lam)
                before.copy_(p)
                self.stepped.add(id(p))
            elif older is not None:  # else the first step: it read the weights it starts from
                index, start = _cached_locate(self._where, self.versions.slots[HOME], p)
                before = older[index].view(-1)[start:start + p.numel()].view_as(p)
                p.grad.addcmul_(p.grad * (p - before), p.grad, value=self.lam)

    def state_tensors(self) -> list[torch.Tensor]:
        return self.state.summed()

    def load_targets(self) -> list[torch.Tensor]:
        return self.state.tensors

    def state_loaded(self) -> None:
        if self.state is not None:
            _mark_stepped(self)


class ErrorFeedback:
    """``ef`` where the optimizer steps: right after each torch optimizer's step wrote
    W' = W(t) - U_t into its parameters, and before megatron-core copies them into the model's
    weights, subtract beta (U_t - U_{t-1}) there (from the second step taken on). The
    optimizer's parameters are the fp32 main parameters: the weights in fp32 (or this rank's
    shard, a view of them, with the distributed optimizer), where W(t) is the version store's
    copy; their fp32 master copies (or shards of them) under bf16 and fp16, where W(t) is a
    copy taken before the step. A step megatron-core skips (a non-finite gradient) leaves the
    state as it was. U_{t-1} is kept in fp32, shaped as the model's weights."""

    holds_state = True

    def __init__(self, versions: WeightVersions, optimizer, beta: float):
        from megatron_2bw.deferred import members

        self.versions, self.beta = versions, beta
        self.state = _WeightShaped(versions, optimizer)
        self.previous = self.state.tensors  # U_{t-1}
        self.before: dict[int, torch.Tensor] = {}  # master copy -> W(t), during a step
        self.stepped: set[int] = set()  # the optimizer parameters with a step taken
        self.hooks = [hook for inner in members(optimizer) for hook in (
            inner.optimizer.register_step_pre_hook(self._remember),
            inner.optimizer.register_step_post_hook(self._correct))]

    def detach(self) -> None:
        for hook in self.hooks:
            hook.remove()

    @torch.no_grad()
    def _remember(self, torch_optimizer, args, kwargs) -> None:
        """W(t) of the master copies (the others' is the store's)."""
        for p in _params(torch_optimizer):
            if id(p) in self.state.masters:
                self.before.setdefault(id(p), torch.empty_like(p)).copy_(p)

    @torch.no_grad()
    def _correct(self, torch_optimizer, args, kwargs) -> None:
        for p in _params(torch_optimizer):
            previous = self.state.view(p)
            update = self._before(p) - p  # U_t
            if id(p) in self.stepped:  # the first step's gradient read the weights it updated
                p.add_(previous, alpha=self.beta).sub_(update, alpha=self.beta)
            previous.copy_(update)
            self.stepped.add(id(p))

    def _before(self, p: torch.Tensor) -> torch.Tensor:
        """W(t) of the optimizer's parameter ``p``."""
        if id(p) in self.state.masters:
            return self.before[id(p)]
        return self.state.range_of(self.versions.tensors_of(self.versions.newest - 1), p)

    def state_loaded(self) -> None:
        _mark_stepped(self)

    def state_tensors(self) -> list[torch.Tensor]:
        return self.state.summed()

    def load_targets(self) -> list[torch.Tensor]:
        return self.state.tensors


def _mark_stepped(rule) -> None:
    """After a load, ``rule`` (dc, ef) reads its state as loaded: every parameter has a step
    taken once the checkpoint's version is past the first."""
    if rule.versions.newest >= 1:
        rule.stepped.update(id(p) for p in rule.state.params)


class _Placement:
    """Where each parameter a stage's optimizer chain steps lies in the model's weights (whole
    weights, master copies, or this rank's shards of either), and which data-parallel groups
    share the steps (the distributed optimizer's shards, the layer-wise optimizer's
    parameters). ``gathered`` makes weight-shaped tensors whole from the ranges each rank
    wrote: a collective every rank of each sharing group makes, in the chain's order."""

    def __init__(self, versions: WeightVersions, optimizer):
        from megatron_2bw.deferred import members

        chain = members(optimizer)
        self.versions = versions
        self.masters = _master_copies(chain, versions.params)  # id -> (index, offset)
        self.params = [p for inner in chain for p in _params(inner.optimizer)]
        self.where: dict[int, tuple[int, int]] = {}  # _cached_locate's
        self.written: dict = {}  # group -> ranges (parameter, offset, elements) written here
        self.shared: dict = {}  # group -> the parameters its ranks share (the same on all)
        position = {id(p): i for i, p in enumerate(versions.params)}
        for inner in chain:
            for param_group in inner.optimizer.param_groups:
                group, shared = _sharing(optimizer, inner, param_group, versions.params)
                if group is None:
                    continue
                self.shared.setdefault(group, set()).update(position[id(p)] for p in shared)
                self.written.setdefault(group, []).extend(
                    (*self.place(p), p.numel()) for p in param_group["params"])

    @property
    def home(self) -> list[torch.Tensor]:
        return self.versions.slots[HOME]

    def place(self, p: torch.Tensor) -> tuple[int, int]:
        """(model weight, element offset) the optimizer's parameter ``p`` is a copy or a view
        of (all of it, or a shard)."""
        if id(p) in self.masters:
            return self.masters[id(p)]
        return _cached_locate(self.where, self.home, p)

    def range_of(self, tensors: list[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
        """The range of weight-shaped ``tensors`` that the optimizer's parameter ``p`` covers."""
        index, start = self.place(p)
        return tensors[index].view(-1)[start:start + p.numel()].view_as(p)

    def gathered(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (weight-shaped) with each shared weight made whole: the sum over its
        group of the ranges each rank wrote, zeros elsewhere (exact: one term is not zero),
        one all-reduce per group and dtype. The others are ``tensors``' own."""
        full = list(tensors)
        for group, shared in self.shared.items():
            for dtype in sorted({tensors[index].dtype for index in shared}, key=str):
                indices = sorted(i for i in shared if tensors[i].dtype == dtype)
                at = dict(zip(indices, itertools.accumulate(
                    [tensors[i].numel() for i in indices], initial=0)))
                flat = torch.zeros(sum(tensors[i].numel() for i in indices), dtype=dtype,
                                   device=tensors[indices[0]].device)
                for index, start, size in self.written.get(group, []):
                    if index in at:
                        flat[at[index] + start:at[index] + start + size] = \
                            tensors[index].view(-1)[start:start + size]
                torch.distributed.all_reduce(flat, group=group)
                for index in indices:
                    full[index] = flat[at[index]:at[index] + tensors[index].numel()].view_as(
                        tensors[index])
        return full


class _WeightShaped(_Placement):
    """One fp32 tensor per model weight, of which this rank writes the ranges its optimizer's
    parameters cover; a save sums the ranges of the ranks that share the steps."""

    def __init__(self, versions: WeightVersions, optimizer):
        super().__init__(versions, optimizer)
        self.tensors = [torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                        for t in self.home]

    def view(self, p: torch.Tensor) -> torch.Tensor:
        return self.range_of(self.tensors, p)

    def summed(self) -> list[torch.Tensor]:
        """Every weight's tensor whole on every rank (see ``_Placement.gathered``)."""
        return self.gathered(self.tensors)


def _sharing(optimizer, inner, param_group: dict, params: list) -> tuple:
    """(the data-parallel group whose ranks share the steps of ``param_group`` of ``inner``,
    a member of ``optimizer``'s chain, each stepping a part; the model parameters they share,
    the same list on every rank): the distributed optimizer's group and its buffers'
    parameters (each rank steps a shard of them); the layer-wise optimizer's data-parallel
    group and the parameters it deals over it (whole ones; the experts' over the expert
    data-parallel group); (None, []) where each rank steps all of them."""
    dealt = getattr(optimizer, "dp_cp_params_list", None)
    if dealt is not None:
        if param_group.get("is_expert_parallel", False):
            dealt = optimizer.expt_dp_params_list
            if dealt is None:  # one expert data-parallel rank: it steps every expert
                return None, []
            return optimizer.pg_collection.expt_dp, [p for ps in dealt for p in ps]
        return optimizer.pg_collection.dp_cp, [p for ps in dealt for p in ps]
    group = getattr(inner, "data_parallel_group", None)
    if group is None or torch.distributed.get_world_size(group) == 1:
        return None, []
    return group, [p for buffer in inner.buffers for p in buffer.params]


def _params(torch_optimizer) -> list[torch.Tensor]:
    return [p for group in torch_optimizer.param_groups for p in group["params"]]


def _master_copies(chain: list, params: list) -> dict[int, tuple[int, int]]:
    """id of each fp32 master copy the chain's optimizers step (bf16 weights) -> (the index
    of its model parameter in ``params``, the element the copy starts at): 0 for the
    mixed-precision optimizer's whole copies, the shard's start in the parameter for the
    distributed optimizer's."""
    from megatron_2bw.deferred import _MAIN_GROUPS

    index = {id(p): i for i, p in enumerate(params)}
    found = {}
    for optimizer in chain:
        for model_name, main_name in _MAIN_GROUPS[:2]:
            for model_group, main_group in zip(getattr(optimizer, model_name, ()),
                                               getattr(optimizer, main_name, ())):
                for model_param, main_param in zip(model_group, main_group):
                    if id(model_param) not in index:
                        continue
                    start = 0 if model_name == "float16_groups" else \
                        optimizer._get_model_param_range_map(model_param)["param"].start
                    found[id(main_param)] = (index[id(model_param)], start)
    return found


def _cached_locate(cache: dict, home: list[torch.Tensor], param: torch.Tensor
                   ) -> tuple[int, int]:
    """`_locate`, remembered per parameter address and checked on use (a load may give the
    weights new storage)."""
    key = param.data_ptr()
    hit = cache.get(key)
    if hit is None or home[hit[0]].data_ptr() + hit[1] * param.element_size() != key:
        hit = cache[key] = _locate(home, param)
    return hit


def _locate(home: list[torch.Tensor], param: torch.Tensor) -> tuple[int, int]:
    """(model parameter, element offset) that the optimizer's parameter ``param`` is a view
    of: the parameter itself, or the distributed optimizer's shard of it."""
    key, size = param.data_ptr(), param.element_size()
    for index, weights in enumerate(home):
        offset = key - weights.data_ptr()
        if weights.dtype == param.dtype and 0 <= offset < weights.numel() * size:
            return index, offset // size
    raise RuntimeError("a stale-weight correction: an optimizer parameter is neither a view "
                       "of the model's weights nor a master copy of one")
