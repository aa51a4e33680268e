"""Runs one stage's action list on megatron-core model chunks: Megatron's
``forward_backward_func`` for every schedule of this package.

`PipelineRunner` runs the stage's program for a call (`schedules.call_program`: the actions
with their fused send/receive groups), one handler per kind of step in a dispatch table
(exchange, F, B, I, W, S), on the chunk and data iterator each action names. The weight
versions of 2BW and PipeDream live in `weights.WeightVersions`, PipeMare's corrected backward
weights in `discrepancy`, zb-h1's deferred weight gradients in `schedules.wgrad`.

Invariants: every F, B, I and W runs after pointing the weights at its microbatch's version;
only the batch's last backward per chunk launches the gradient reductions; a 2BW call leaves
its look-ahead forwards in flight unless `prepare_drain()` asked for an empty pipeline, and a
call with another number of microbatches than the last one's finds the pipeline empty.
The handlers, parameter all-gathers, PipeMare's warm-up and drains: docs/executor.md.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron_2bw.corrections import StaleCorrection
from megatron_2bw.deferred import DeferredStep, why_not_deferred
from megatron_2bw.discrepancy import DiscrepancyCorrection, zeros_like_delta
from megatron_2bw.errors import CheckpointRefused
from megatron_2bw.runtime import device, distributed
from megatron_2bw.runtime.clock import clock_for
from megatron_2bw.schedules import (Action, Exchange, Kind, Placement, Step, call_program,
                                    format_grid, forward_program, keeps_versions, placement_of)
from megatron_2bw.schedules.actions import MAKES_PARAM_GRADS, SENDS_GRAD
from megatron_2bw.schedules.comm import reads_from
from megatron_2bw.schedules.p2p import CommError, StageComm
from megatron_2bw.schedules.pipemare import (PipeMareOptions, call_schedule, correction_span,
                                             forward_delay, lr_factor)
from megatron_2bw.schedules.version_state import version_entries
from megatron_2bw.schedules.wgrad import PendingWeightGrads, WeightGradStore
from megatron_2bw.schedules.moe_microbatches import (AuxLossLedger,
                                                   aux_loss_scale_for_backward)
from megatron_2bw.weights import WeightVersions

__all__ = ["PipelineRunner", "forward_backward_func_for", "reset_runners", "TimelineRecord"]


@dataclass(frozen=True)
class TimelineRecord:
    """One executed action, for timelines (``tools/timeline.py``): ``start``/``end`` in
    ``time.perf_counter()`` seconds. On CUDA both are CUDA events recorded around the action on
    the current stream, placed on that time line after the call (``runtime.clock``): the
    action's compute, not its launch; on the CPU host clock readings."""

    stage: int
    kind: str
    microbatch: int | None
    version: int | None
    start: float
    end: float


@dataclass
class _Call:
    """What one Megatron call passes to the schedule, as the handlers need it."""

    forward_step_func: Callable
    data_iterators: list
    """One per model chunk."""
    models: list
    """The stage's model chunks (virtual stages c*d + stage); one without virtual stages."""
    config: object
    num_microbatches: int
    losses: list
    num_tokens: torch.Tensor
    pg_collection: object
    force_all_reduce: bool
    completing: dict = field(default_factory=dict)
    """chunk -> the call's actions whose parameter gradients complete the chunk's for the
    batch: its last B, or its last I (the small parameters) and its last W (the rest)."""
    gathers_next_chunk_at: dict = field(default_factory=dict)
    """chunk c+1 -> chunk c's first forward of the call, where chunk c+1's parameter
    all-gathers are launched (virtual stages with ``config.param_sync_func``; c+1 >= 2)."""

    @property
    def model(self) -> torch.nn.Module:
        """The one model chunk (schedules that keep weight versions run one chunk)."""
        return self.models[0]


class PipelineRunner:
    """``forward_backward_func`` for one schedule; keeps state across Megatron calls (2BW's
    in-flight microbatches and weight versions)."""

    def __init__(self, schedule: str):
        self.schedule = schedule
        self.batches_done = 0  # training calls made: the next call runs batch `batches_done`
        self.pipeline_empty = True  # no call yet, or the last one drained: the next one fills
        self.in_flight_m: int | None = None  # m of the call that left microbatches in flight
        self.drain_at: int | None = None  # the batch after which the pipeline is empty
        # (microbatch, chunk) -> (input, output) until its backward
        self.stash: dict[tuple[int, int], tuple] = {}
        # (microbatch, chunk) -> the deferred weight-gradient GEMMs, from I to W
        self.weight_grads: dict[tuple[int, int], PendingWeightGrads] = {}
        self.wgrad_stores: dict[int, WeightGradStore] = {}  # chunk -> its store (zb-h1)
        # (tensor, microbatch, the sender's chunk) -> tensor, as transfers name them
        self.inbox: dict[tuple[str, int, int], torch.Tensor] = {}  # received, not used yet
        self.outbox: dict[tuple[str, int, int], torch.Tensor] = {}  # made, not sent yet
        # the V's turn, keyed as the outbox: a chunk's output for the next chunk of this stage
        self.handoff: dict[tuple[str, int, int], torch.Tensor] = {}
        self.placement = Placement(1)
        self.chunks = 1
        self.versions: WeightVersions | None = None
        self.comm: StageComm | None = None
        self.timeline: list[TimelineRecord] | None = None  # set to [] to record
        self.clock = None  # the timeline's clock (runtime.clock), made at the first record
        self._unresolved: list[tuple] = []  # (kind, microbatch, version, start, end) marks
        self.optimizer = None  # attach_optimizer(): 2BW may then defer the step
        self.defer = True
        self.deferred: DeferredStep | None = None
        self.stale_rule = StaleCorrection()  # --stale-weight-correction
        self.stale = None  # its per-stage object (corrections.py), once bound
        self._unwrap_step = None  # gives the optimizer its own step() back
        self.step_mode: str | None = None  # how 2BW steps, once known (first call)
        self.pipemare = PipeMareOptions()
        self.correction: DiscrepancyCorrection | None = None  # pipemare's T2, once bound
        # T2's delta read from a checkpoint (at the newest version, which the correction binds
        # at before the next step), until the correction binds
        self.loaded_delta: list[torch.Tensor] | None = None
        self.loading: dict = {}  # checkpoint key -> VersionEntries being loaded
        # (microbatch, chunk) -> the version its forward read, until its backward
        self.forward_read: dict[tuple[int, int], int] = {}
        self.aux_losses: AuxLossLedger | None = None  # a MoE model's, by batch

    # ---- Megatron's forward_backward_func signature ---------------------------------------
    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches: int,
                 seq_length: int, micro_batch_size: int, decoder_seq_length: int | None = None,
                 forward_only: bool = False, collect_non_loss_data: bool = False,
                 first_val_step=None, adjust_tensor_shapes_fn=None, p2p_communicator=None,
                 pg_collection=None, force_all_reduce: bool = False):
        from megatron.core.utils import get_model_config

        models = _chunks(model)
        config = get_model_config(models[0])
        self._setup(models, config,
                    seq_length if decoder_seq_length is None else decoder_seq_length,
                    micro_batch_size)
        call = _Call(forward_step_func, _iterators(data_iterator, len(models)), models, config,
                     num_microbatches, [], token_count(self.comm.device), pg_collection,
                     force_all_reduce)
        try:
            if forward_only:
                return self._forward_only(call, collect_non_loss_data)
            return self._train_call(call)
        finally:
            self._resolve_timeline()

    def prepare_drain(self, calls: int = 1) -> None:
        """The training call ``calls`` calls from now (1: the next) leaves no microbatch in
        flight; the calls before it run no forward beyond its batch. Under pipedream and
        pipemare at m < d the look-ahead forwards reach ``drain_notice(m)`` batches ahead, so
        a drain must be asked for that many calls before (earlier is refused here)."""
        target = self.batches_done + calls - 1
        if not self.pipeline_empty and self.in_flight_m is not None:
            m, depth = self.in_flight_m, self.depth
            forwarded = (self.batches_done * m - 1 + depth - 1) // m  # the first stage's
            if self.drain_at is not None:
                forwarded = min(forwarded, self.drain_at)
            if keeps_versions(self.schedule) and self.chunks == 1 and forwarded > target:
                raise RuntimeError(
                    f"{self.schedule}: a drain after batch {target} was asked for too late: "
                    f"the look-ahead forwards already reached batch {forwarded} (m={m} < d="
                    f"{depth}: ask {self.drain_notice(m)} calls ahead)")
        self.drain_at = target if self.drain_at is None else min(self.drain_at, target)

    def drain_notice(self, num_microbatches: int) -> int:
        """Calls ahead ``prepare_drain`` must be called (1 unless pipedream or pipemare run
        at m < d: ``schedules.pipedream.drain_notice``)."""
        from megatron.core import parallel_state as ps

        from megatron_2bw.schedules import SCHEDULES

        if self.schedule not in SCHEDULES:
            return 1
        depth = ps.get_pipeline_model_parallel_world_size()
        return SCHEDULES[self.schedule].drain_notice(depth, num_microbatches)

    def attach_optimizer(self, optimizer, defer: bool = True,
                         correction: StaleCorrection | None = None) -> None:
        """The optimizer the training loop steps after each call. Under 2BW its step is then
        deferred (:mod:`megatron_2bw.deferred`) where that removes a pipeline-wide wait;
        ``defer=False`` keeps it where the loop calls it. ``correction``: 2BW's stale-weight
        correction (:mod:`megatron_2bw.corrections`), before the first call."""
        if self.deferred is not None:
            self.deferred.detach()
            self.deferred = None
        if self._unwrap_step is not None:
            self._unwrap_step()
            self._unwrap_step = None
        if getattr(self.stale, "detach", None) is not None:
            self.stale.detach()
        self.stale = None
        if correction is not None:
            if self.versions is not None and correction != self.stale_rule:
                raise RuntimeError("the stale-weight correction is set before the first call")
            self.stale_rule = correction
        self.optimizer, self.defer, self.step_mode = optimizer, defer, None

    def configure_pipemare(self, options: PipeMareOptions) -> None:
        """PipeMare's techniques (--pipemare-*), before the first call."""
        if self.batches_done:
            raise RuntimeError("configure_pipemare() after the first training call")
        self.pipemare, self.correction = options, None

    def drain(self) -> None:
        """Called before evaluation and checkpoints: the pipeline must already be empty, and
        a deferred step is applied."""
        if self.stash or self.weight_grads or self.inbox or self.outbox or self.handoff:
            raise RuntimeError(f"{self.schedule}: microbatches are still in flight; call "
                               "prepare_drain() before the last training call")
        if self.deferred is not None:
            self._apply_deferred()
        self._resolve_timeline()

    def abandon(self) -> None:
        """Training ends here without another step (divergence): a deferred step's pending
        collectives are finished, so every rank has issued the same ones, and not applied."""
        if self.deferred is not None:
            self.deferred.wait_collectives()

    # ---- set-up --------------------------------------------------------------------------
    def _setup(self, models: list, config, seq_length: int, micro_batch_size: int) -> None:
        from megatron.core import parallel_state as ps

        self.stage = ps.get_pipeline_model_parallel_rank()
        self.depth = ps.get_pipeline_model_parallel_world_size()
        self.is_last = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.chunks = len(models)
        self.placement = placement_of(self.schedule, self.depth, self.chunks)
        if keeps_versions(self.schedule) and self.versions is None:
            self.bind(models)
        if keeps_versions(self.schedule) and self.step_mode is None:
            self._choose_step_mode(models, config)
        if getattr(config, "num_moe_experts", None) and self.aux_losses is None:
            self.aux_losses = AuxLossLedger()
        seq = seq_length // ps.get_context_parallel_world_size()
        if config.sequence_parallel:
            seq //= ps.get_tensor_model_parallel_world_size()
        shape = (seq, micro_batch_size, config.hidden_size)
        if self.comm is None or self.comm.shape != shape:
            self.comm = StageComm(shape, config.pipeline_dtype, device.training_device(),
                                  distributed.timeout())

    def _choose_step_mode(self, models: list, config) -> None:
        import torch.distributed as dist

        reason = "no optimizer attached" if self.optimizer is None else \
            "--no-deferred-step" if not self.defer else \
            why_not_deferred(self.optimizer, config, models)
        if reason is None:
            self.deferred = DeferredStep(self.optimizer, config, models,
                                         timeout=distributed.timeout())
            self.step_mode = "deferred"
        else:
            self.step_mode = f"at the loop's optimizer.step() ({reason})"
        if self.optimizer is not None and self.stale is None:
            self.stale = self.stale_rule.bind(self.versions, self.optimizer)
        if self.deferred is None and hasattr(self.stale, "after_update"):
            self._unwrap_step = _after_each_step(self.optimizer, self.stale.after_update)
        if dist.get_rank() == 0:
            print(f" {self.schedule} optimizer step on stage {self.stage}: {self.step_mode}",
                  flush=True)

    def bind(self, model) -> None:
        """Create the 2BW weight versions of the parameters of ``model`` (a chunk, or the
        stage's list of chunks: one version spans them all); version 0 = current."""
        if keeps_versions(self.schedule) and self.versions is None:
            self.versions = self.stale_rule.versions(
                [p for chunk in _chunks(model) for p in chunk.parameters()], self._oldest_read)

    def _oldest_read(self, new_version: int) -> int:
        """The oldest version this stage reads once ``new_version`` (made after batch
        ``new_version - 1``) exists: the forward version of the batch's first microbatch,
        the oldest an in-flight microbatch or a later (refilled) forward reads."""
        from megatron_2bw.schedules import SCHEDULES

        from megatron.core import parallel_state as ps

        spec = SCHEDULES[self.schedule]
        m = getattr(self, "current_m", None) or 1
        depth = ps.get_pipeline_model_parallel_world_size()
        stage = ps.get_pipeline_model_parallel_rank()
        return spec.version_of(depth, m, stage, new_version * m)

    # ---- training call -------------------------------------------------------------------
    def _train_call(self, call: _Call) -> list:
        m, batch = call.num_microbatches, self.batches_done
        if keeps_versions(self.schedule) and not self.pipeline_empty and m != self.in_flight_m:
            raise RuntimeError(f"{self.schedule}: this call has {m} microbatches but the last "
                               f"one left look-ahead forwards of {self.in_flight_m}-microbatch "
                               "batches in flight; call prepare_drain() before the last call "
                               "of a batch size")
        if self.versions is not None:
            self.versions.after_step()
        self._bind_correction(m)
        if self.correction is not None:
            self.correction.track()  # the loop's step (not deferred) wrote the newest version
        self.current_m = m
        schedule, drain = self.schedule, self.drain_at == batch
        if schedule == "pipemare":
            schedule = call_schedule(batch, self.pipemare.sync_iters)
            drain = drain or schedule == "flush"
        program = call_program(schedule, self.depth, m, self.stage, batch,
                               fill=self.pipeline_empty, drain=drain, chunks=self.chunks,
                               drain_at=self.drain_at)
        actions = [step for step in program if isinstance(step, Action)]
        call.completing = _completing(actions)
        self._launch_param_gathers(call, actions)
        if self.deferred is not None and self.schedule in ("pipedream", "pipemare"):
            # each stage's next forwards read its newest version at once; at m < d a stage's
            # call may begin with a receive, and a stage blocked there would never launch the
            # step's collectives that its neighbours' first forwards wait for
            self._apply_deferred()
        self._execute(program, call, self._run)
        if self.aux_losses is not None:
            self.aux_losses.settle(batch)  # the tracker holds this call's batch's aux losses
        self._reschedule_lr(m, batch)
        self.batches_done += 1
        self.pipeline_empty = drain
        self.in_flight_m = None if drain else m
        if drain:
            self.drain_at = None
        return call.losses

    def _reschedule_lr(self, microbatches: int, batch: int) -> None:
        """PipeMare's T1 (--pipemare-lr-warmup-steps K): the step after batch t (step k = t)
        runs with the learning rate scaled by 1 / tau_i ** (1 - min(k/K, 1)) on this stage
        (`pipemare.lr_factor`), tau_i its largest forward delay, > 1 only at m < d. Scaled in
        the optimizer's groups now, between the call and the loop's ``optimizer.step()``:
        the step (or the deferred step, which records the rate there) reads it, and the
        scheduler's next ``step()`` sets every group's rate afresh."""
        steps = self.pipemare.lr_warmup_steps
        if self.schedule != "pipemare" or not steps or self.optimizer is None:
            return
        factor = lr_factor(batch, steps, forward_delay(self.depth, microbatches, self.stage))
        if factor != 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] *= factor

    def _launch_param_gathers(self, call: _Call, actions: list[Action]) -> None:
        """Virtual stages with --overlap-param-gather and --align-param-gather: launch chunks
        0 and 1's all-gathers now and note where each later chunk's is launched (its
        predecessor's first forward), as megatron-core's interleaved schedule does."""
        param_sync = call.config.param_sync_func
        if param_sync is None or len(call.models) == 1:
            return
        for chunk in range(2):
            param_sync[chunk](call.models[chunk].parameters())
        for action in actions:
            after = action.chunk + 1
            if (action.kind is Kind.FORWARD and 2 <= after < len(call.models)
                    and after not in call.gathers_next_chunk_at):
                call.gathers_next_chunk_at[after] = action

    def _bind_correction(self, microbatches: int) -> None:
        """PipeMare's T2 on this stage, from its first call on (none where no backward reads
        a newer version than its forward: the last stage)."""
        decay = self.pipemare.discrepancy_decay
        if self.schedule != "pipemare" or decay is None or self.correction is not None:
            return
        span = correction_span(self.depth, microbatches, self.stage)
        if span > 0:
            self.correction = DiscrepancyCorrection(self.versions, decay, span)
            if self.loaded_delta is not None:
                self.correction.delta = self.loaded_delta
        self.loaded_delta = None

    def _execute(self, program: list[Step], call: _Call, run_action: Callable) -> None:
        """Run a program's steps in order; on a failure print the grid with the step marked."""
        needs = self._reads_from(program)
        for index, step in enumerate(program):
            try:
                if self.deferred is not None and needs[index] is not None \
                        and needs[index] == self.deferred.pending_version:
                    self._apply_deferred()  # the first step needing it (comm.reads_from)
                if isinstance(step, Exchange):
                    self._exchange(step, _next_action(program, index), call)
                else:
                    run_action(step, call)
            except (CommError, RuntimeError) as error:
                _report_failure(self.stage, program, index, error)
                raise

    def _reads_from(self, program: list[Step]) -> list[int | None]:
        """Per step of ``program``, the version that must exist before it (comm.reads_from);
        all None without a deferred step. With virtual stages the exchanges' rule gives no
        single cut yet, so there only the actions need one (each its own version)."""
        if self.deferred is None:
            return [None] * len(program)
        if self.chunks > 1:
            return [step.version if isinstance(step, Action) and step.kind is not Kind.STEP
                    else None for step in program]
        from megatron_2bw.schedules import SCHEDULES

        spec, m = SCHEDULES[self.schedule], getattr(self, "current_m", None) or 1
        return reads_from(program, lambda k: spec.version_of(self.depth, m, self.stage, k))

    def _exchange(self, exchange: Exchange, before: str, call: _Call) -> None:
        """One fused send/receive group; a sent activation's storage is then released as
        Megatron does (its autograd graph stays for the backward)."""
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

        sends = [t.key for t in exchange.transfers if t.op == "send"]
        outgoing = {key: self.outbox.pop(key) for key in sends}
        self.inbox.update(self.comm.exchange(exchange, outgoing, before))
        for (tensor, _, _), output in outgoing.items():
            if tensor == "activation":
                deallocate_output_tensor(output, call.config.deallocate_pipeline_outputs)

    def _run(self, action: Action, call: _Call) -> None:
        if self.deferred is not None:
            self.deferred.progress()  # moves its collectives on; never blocks
        start = self._mark()
        _HANDLERS[action.kind](self, action, call)
        self._record(action.kind.value, action.microbatch, action.version, start)

    def _apply_deferred(self) -> None:
        """Run a pending deferred step; timelines show it as a step record where it ran."""
        version, start = self.deferred.pending_version, self._mark()
        self.deferred.apply(self.versions)
        if version is not None and hasattr(self.stale, "after_update"):
            self.stale.after_update()
        if self.correction is not None:
            self.correction.track()
        if version is not None:
            self._record(Kind.STEP.value, None, version, start)

    # ---- timelines -----------------------------------------------------------------------
    def _mark(self):
        """A clock mark when recording a timeline (None otherwise): a CUDA event on CUDA, the
        host clock on the CPU (``runtime.clock.clock_for``). Never waits."""
        if self.timeline is None:
            return None
        if self.clock is None:
            self.clock = clock_for(device.training_device(), anchored=True)
        return self.clock.mark()

    def _record(self, kind: str, microbatch: int | None, version: int | None, start) -> None:
        if self.timeline is not None and start is not None:
            self._unresolved.append((kind, microbatch, version, start, self.clock.mark()))

    def _resolve_timeline(self) -> None:
        """After a call: the call's marks become TimelineRecords on the perf_counter time line
        (on CUDA this waits for the call's last event, once per call, not per action)."""
        if self.timeline is not None:
            self.timeline += [TimelineRecord(self.stage, kind, microbatch, version,
                                             self.clock.at(start), self.clock.at(end))
                              for kind, microbatch, version, start, end in self._unresolved]
        self._unresolved = []

    def _first(self, chunk: int) -> bool:
        """Whether ``chunk`` of this stage is the model's first virtual stage (reads data)."""
        return self.placement.is_first(self.stage, chunk)

    def _last(self, chunk: int) -> bool:
        """Whether ``chunk`` of this stage is the model's last virtual stage (the loss)."""
        return self.placement.is_last(self.stage, chunk)

    def _take(self, tensor: str, microbatch: int, chunk: int, step: int) -> torch.Tensor | None:
        """What the virtual stage `step` (+-1) away from ``chunk`` made for ``microbatch``:
        received from its stage, or handed over by this stage's other chunk (the V's turn);
        None past the model's ends."""
        maker = self.placement.neighbour(self.stage, chunk, step)
        if maker is None:
            return None
        box = self.handoff if maker[0] == self.stage else self.inbox
        return box.pop((tensor, microbatch, maker[1]))

    def _give(self, tensor: str, microbatch: int, chunk: int, step: int,
              value: torch.Tensor) -> None:
        """Pass ``value`` to the virtual stage `step` (+-1) away: into the outbox for its
        stage, or, on this stage (the V's turn), detached as a received tensor would be."""
        taker = self.placement.neighbour(self.stage, chunk, step)
        if taker is None:
            return
        if taker[0] == self.stage:
            self.handoff[tensor, microbatch, chunk] = value.detach()
        else:
            self.outbox[tensor, microbatch, chunk] = value

    def _input(self, microbatch: int, chunk: int) -> torch.Tensor | None:
        """The previous virtual stage's output for ``microbatch`` (None on the first)."""
        received = self._take("activation", microbatch, chunk, -1)
        return None if received is None else received.requires_grad_(True)

    def _output_grad(self, microbatch: int, chunk: int) -> torch.Tensor | None:
        """The next virtual stage's input gradient for ``microbatch`` (None on the last: its
        output is the loss)."""
        return self._take("grad", microbatch, chunk, 1)

    def _forward(self, action: Action, call: _Call) -> None:
        from megatron.core.pipeline_parallel.schedules import forward_step

        if self.versions is not None:
            self.versions.use(action.version)
        k, m, c = action.microbatch, call.num_microbatches, action.chunk
        if call.gathers_next_chunk_at.get(c + 1) is action:
            call.config.param_sync_func[c + 1](call.models[c + 1].parameters())
        input_tensor = self._input(k, c)

        def run():
            return forward_step(
                call.forward_step_func, call.data_iterators[c], call.models[c], m, input_tensor,
                call.losses, call.config, 1, is_first_microbatch=k % m == 0,
                current_microbatch=k % m, vp_stage=self._vp_stage(c),
                is_last_stage=self._last(c))

        # a MoE model's aux losses booked to the microbatch's batch (training.moe)
        output, num_tokens = run() if self.aux_losses is None else \
            self.aux_losses.forward(k // m, run)
        call.num_tokens += num_tokens
        self._give("activation", k, c, 1, output)
        self.stash[k, c] = (input_tensor, output)
        self.forward_read[k, c] = action.version

    def _vp_stage(self, chunk: int) -> int | None:
        """megatron-core's ``vp_stage`` of a chunk: None without virtual stages."""
        return chunk if self.chunks > 1 else None

    def _backward_inputs(self, action: Action, call: _Call) -> tuple:
        """For a B or an I: the microbatch's version in use, and its stashed (input, output)
        with the received output gradient (None on the last stage: the output is the loss).
        Under PipeMare's T2 a backward reading a newer version than its forward reads the
        corrected weights, W(version) - (tau_fwd - tau_bkwd) * delta. A MoE model's aux-loss
        gradient scale is set for this backward (``training.moe``: not the one the last
        forward left, which under 2BW may be another step's)."""
        k, c = action.microbatch, action.chunk
        if getattr(call.config, "num_moe_experts", None):
            aux_loss_scale_for_backward(call.config, call.num_microbatches)
        scale = action.version - self.forward_read.pop((k, c))  # tau_fwd - tau_bkwd
        if self.correction is not None and scale > 0:
            self.correction.use(action.version, scale)
        elif self.versions is not None:
            self.versions.use(action.version)
        output_grad = self._output_grad(k, c)
        input_tensor, output = self.stash.pop((k, c))
        return input_tensor, output, output_grad

    def _backward(self, action: Action, call: _Call) -> None:
        from megatron.core.enums import ModelType
        from megatron.core.pipeline_parallel.schedules import backward_step

        k = action.microbatch
        input_tensor, output, output_grad = self._backward_inputs(action, call)
        with self._param_grads(action, call):
            input_grad = backward_step(input_tensor, output, output_grad,
                                       ModelType.encoder_or_decoder, call.config)
        if not self._first(action.chunk):
            self._give("grad", k, action.chunk, -1, input_grad)

    def _input_grad(self, action: Action, call: _Call) -> None:
        """I: the input gradient and the small parameters' gradients; the linear layers'
        weight-gradient GEMMs wait in the chunk's store for the W."""
        k, c = action.microbatch, action.chunk
        input_tensor, output, output_grad = self._backward_inputs(action, call)
        if output_grad is None:  # the loss, scaled as Megatron's backward_step does
            if call.config.grad_scale_func is not None:
                output = call.config.grad_scale_func(output)
            output_grad = torch.ones_like(output)
        store = self.wgrad_stores.get(c)
        if store is None:
            store = self.wgrad_stores[c] = WeightGradStore(call.models[c])
        with self._param_grads(action, call):
            self.weight_grads[k, c] = store.input_pass(output, output_grad, input_tensor)
        if not self._first(c):
            self._give("grad", k, c, -1, input_tensor.grad)

    def _weight_grad(self, action: Action, call: _Call) -> None:
        """W: the microbatch's deferred weight-gradient GEMMs."""
        if self.versions is not None:
            self.versions.use(action.version)
        pending = self.weight_grads.pop((action.microbatch, action.chunk))
        with self._param_grads(action, call):
            WeightGradStore.weight_pass(pending)

    @contextlib.contextmanager
    def _param_grads(self, action: Action, call: _Call):
        """Around a B, I or W: a chunk's completing ones (its last B, or its last I and last W)
        complete that chunk's gradients; all others run under ``config.no_sync_func``. With a
        grad_sync_func (--overlap-grad-reduce, aligned) the chunk's bucket reductions are
        launched right after its last completing one,
        except on the first stage of Megatron's 1F1B (one chunk), which launches them from that
        backward's hooks; with virtual stages every stage launches them after, as megatron-core's
        interleaved schedule does (a chunk's backward gives gradients to its parameters only)."""
        config, c = call.config, action.chunk
        completing = call.completing.get(c, ())
        sync_after = config.grad_sync_func is not None and (len(call.models) > 1
                                                            or self.stage > 0)
        with contextlib.nullcontext() if action in completing and not sync_after \
                else _no_sync(config):
            yield
        if completing and action == completing[-1] and sync_after:
            grad_sync = config.grad_sync_func
            chunk_sync = grad_sync[c] if isinstance(grad_sync, (list, tuple)) else grad_sync
            chunk_sync(call.models[c].parameters())

    def _step(self, action: Action, call: _Call) -> None:
        if self.deferred is not None:
            self._apply_deferred()  # the previous step, if no action read it yet
            self.deferred.begin(action.version)
            return
        config = call.config
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func(
                call.models, call.num_tokens if config.calculate_per_token_loss else None,
                pg_collection=call.pg_collection, force_all_reduce=call.force_all_reduce)
        if self.versions is not None:
            self.versions.fork(action.version)

    # ---- evaluation ----------------------------------------------------------------------
    def _forward_only(self, call: _Call, collect_non_loss_data: bool) -> list:
        """Every microbatch through the pipeline once, with the newest weights."""
        from megatron.core.pipeline_parallel.schedules import forward_step

        self.drain()
        if self.versions is not None:
            self.versions.use_trained()
        m = call.num_microbatches

        def forward(action: Action, call: _Call) -> None:
            j, c = action.microbatch, action.chunk
            output, _ = forward_step(call.forward_step_func, call.data_iterators[c],
                                     call.models[c], m, self._input(j, c), call.losses,
                                     call.config, 1, collect_non_loss_data,
                                     is_first_microbatch=j == 0, current_microbatch=j,
                                     vp_stage=self._vp_stage(c), is_last_stage=self._last(c))
            self._give("activation", j, c, 1, output)

        self._execute(forward_program(self.depth, m, self.stage, self.chunks, self.placement),
                      call, forward)
        return call.losses

    # ---- checkpoints (2BW keeps its older weight version) --------------------------------
    def checkpoint_extra(self, model: list, sharded: dict) -> None:
        """Add what a resumed 2BW run needs to continue exactly: the older weight versions
        (the batches after ``batches_done`` still read them: one under 2BW and at m >= d,
        ceil((d-1)/m) under pipedream and pipemare, `_older_slots`) and the version numbers;
        under PipeMare's T2 each stage's delta at the newest version (the pipeline is drained
        and every step tracked; zeros on the last stage, which corrects nothing). Every
        parameter is saved, whichever kind of sharded entry megatron-core gives it
        (version_state.py). Every stage saves the same number of older versions (the layers'
        tensors span the pipeline); a stage that holds fewer (a later stage reads fewer)
        fills the rest with its newest, which it never reads as an older one. The version
        numbers are the first stage's (megatron-core saves common state from rank 0)."""
        if not keeps_versions(self.schedule):
            return
        self.bind(model)
        newest = self.versions.newest
        alive = [(v, t) for v, t in self.versions.older_versions()]
        olders = [v for v, _ in alive][:self._older_slots()]  # dc's W(t-2): read no more
        sharded["twobw_versions"] = {"batches_done": self.batches_done, "newest": newest,
                                     "older": olders[0] if olders else None, "olders": olders,
                                     "correction": self.stale_rule.rule}
        fallback = self.versions.tensors_of(newest)
        for j in range(1, self._older_slots() + 1):
            tensors = alive[j - 1][1] if j <= len(alive) else fallback
            entries = self._entries(model, tensors, _older_prefix(j))
            entries.check_covered("the older weight version")
            sharded[_older_key(j)] = entries.sharded
        if self._corrects():
            if self.correction is not None:
                self.correction.track()
                delta = self.correction.delta
            else:  # the last stage corrects nothing; its layers' shards complete the tensors
                delta = zeros_like_delta(self.versions.tensors_of(self.versions.newest))
            entries = self._entries(model, delta, _DELTA_PREFIX)
            entries.check_covered("PipeMare's delta")
            sharded["pipemare_delta"] = entries.sharded
        state = self._stale_state()
        if state is not None:
            entries = self._entries(model, state.state_tensors(), _STALE_PREFIX)
            entries.check_covered(f"the {self.stale_rule.rule} correction's state")
            sharded[_STALE_KEY] = entries.sharded

    def prepare_load(self, model: list, sharded: dict, path: str) -> None:
        """Loading counterpart of :meth:`checkpoint_extra`: the older version is read into the
        spare slot (and T2's delta, where the checkpoint has one). A checkpoint written by
        another schedule has one version only. One that has the older version of only some
        parameters (a megatron-2bw that did not save GLU's fc1) is refused with
        CheckpointRefused: its spare slot could not be filled."""
        from megatron.core import dist_checkpointing

        self.loading = {}
        if not keeps_versions(self.schedule):
            return
        self.bind(model)
        common = dist_checkpointing.load_common_state_dict(path).get("twobw_versions")
        saved_rule = "none" if common is None else common.get("correction", "none")
        if saved_rule != self.stale_rule.rule:
            raise CheckpointRefused(
                f"--load: {path} was trained with --stale-weight-correction {saved_rule}; "
                f"resume it with the same rule, not {self.stale_rule.rule}")
        if common is None:
            return
        saved_keys = set(dist_checkpointing.load_tensors_metadata(path))
        sharded["twobw_versions"] = {"batches_done": 0, "newest": 0, "older": None,
                                     "olders": []}
        j = 1
        while j == 1 or any(key.startswith(_older_prefix(j)) for key in saved_keys):
            older = self._entries(model, self.versions.slot_tensors(j), _older_prefix(j))
            _require(older, saved_keys, path, "the older weight version")
            sharded[_older_key(j)] = older.sharded
            self.loading[_older_key(j)] = older
            j += 1
        if self._corrects() and any(key.startswith(_DELTA_PREFIX) for key in saved_keys):
            self.loaded_delta = zeros_like_delta(self.versions.tensors_of(self.versions.newest))
            delta = self._entries(model, self.loaded_delta, _DELTA_PREFIX)
            _require(delta, saved_keys, path, "PipeMare's delta")
            sharded["pipemare_delta"] = delta.sharded
            self.loading["pipemare_delta"] = delta
        state = self._stale_state()
        if state is not None:
            entries = self._entries(model, state.load_targets(), _STALE_PREFIX)
            _require(entries, saved_keys, path, f"the {self.stale_rule.rule} correction's state")
            sharded[_STALE_KEY] = entries.sharded
            self.loading[_STALE_KEY] = entries

    def _older_slots(self) -> int:
        """Older versions a checkpoint holds: what the first stage reads besides the newest
        once the pipeline is drained (1, or ceil((d-1)/m) under pipedream and pipemare)."""
        from megatron_2bw.schedules import SCHEDULES

        m = getattr(self, "current_m", None) or 1
        return SCHEDULES[self.schedule].drain_notice(self.depth, m) if hasattr(
            self, "depth") else 1

    def weight_tensors(self) -> list[torch.Tensor] | None:
        """Every alive weight version's tensors (None for a schedule without versions)."""
        if self.versions is None:
            return None
        return [t for version in self.versions.alive for t in self.versions.tensors_of(version)]

    def _entries(self, model: list, tensors: list[torch.Tensor], prefix: str):
        return version_entries(_chunks(model), self.versions.params, tensors, prefix)

    def _corrects(self) -> bool:
        """Whether the run has PipeMare's T2 (the same on every rank: checkpoints hold delta
        for every stage, the stacked layer tensors span the pipeline)."""
        return self.schedule == "pipemare" and self.pipemare.discrepancy_decay is not None

    def checkpoint_loaded(self, model: list, loaded: dict) -> None:
        if not keeps_versions(self.schedule):
            return
        for key, entries in self.loading.items():
            entries.fill(loaded[key])  # factories' merges are new tensors
        # the older versions read into slots 1, 2, ... (a checkpoint of dc's listed one more)
        slots_read = next(j for j in itertools.count(1) if _older_key(j) not in self.loading) - 1
        self.loading = {}
        info = loaded.get("twobw_versions")
        if info is None:  # one version: batch k reads "version k-1", the same weights
            iteration = loaded["iteration"]
            info = {"batches_done": iteration, "newest": iteration,
                    "older": iteration - 1 if iteration > 0 else None}
            for spare, p in zip(self.versions.spare_tensors(), self.versions.params):
                spare.copy_(p.data)
            slots_read = 1
        self.batches_done = info["batches_done"]
        olders = info.get("olders") or ([] if info["older"] is None else [info["older"]])
        self.versions.loaded(info["newest"], olders[:slots_read])
        state = self._stale_state()
        if state is not None:
            state.state_loaded()

    def _stale_state(self):
        """The stale-weight correction's object when it has state a checkpoint holds (bound
        here if the first call has not come yet)."""
        if self.stale is None and self.stale_rule.rule != "none" and self.optimizer is not None:
            self.stale = self.stale_rule.bind(self.versions, self.optimizer)
        if self.stale is None or not getattr(self.stale, "holds_state", True):
            return None
        return self.stale


_HANDLERS = {Kind.FORWARD: PipelineRunner._forward, Kind.BACKWARD: PipelineRunner._backward,
             Kind.INPUT_GRAD: PipelineRunner._input_grad,
             Kind.WEIGHT_GRAD: PipelineRunner._weight_grad, Kind.STEP: PipelineRunner._step}


def token_count(device: torch.device) -> torch.Tensor:
    """A call's running count of loss tokens (--calculate-per-token-loss), zero, on the stage's
    training device as megatron-core's schedules create it (``torch.zeros([], dtype=torch.int,
    device="cuda")``): the last stage adds the loss function's count, a tensor on that device,
    and ``finalize_model_grads`` broadcasts it over the pipeline group, which under NCCL takes
    device tensors only."""
    return torch.zeros([], dtype=torch.int, device=device)


def _completing(actions: list[Action]) -> dict[int, list[Action]]:
    """Per chunk, the actions whose parameter gradients complete the chunk's for the batch, in
    program order: the last of each kind that makes parameter gradients (B; or I and W)."""
    last: dict[tuple[int, Kind], Action] = {}
    for action in actions:
        if action.kind in MAKES_PARAM_GRADS or action.kind in SENDS_GRAD:
            last[action.chunk, action.kind] = action
    completing: dict[int, list[Action]] = {}
    for action in actions:
        if last.get((action.chunk, action.kind)) is action:
            completing.setdefault(action.chunk, []).append(action)
    return completing


def _no_sync(config):
    """``config.no_sync_func`` entered for every model chunk (a list with virtual stages)."""
    functions = config.no_sync_func
    if functions is None:
        return contextlib.nullcontext()
    if not isinstance(functions, (list, tuple)):
        return functions()
    stack = contextlib.ExitStack()
    for function in functions:
        stack.enter_context(function())
    return stack


def _chunks(model) -> list:
    """The stage's model chunks as a list."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _after_each_step(optimizer, after: Callable[[], None]) -> Callable[[], None]:
    """Make ``optimizer.step()`` call ``after()`` once the step's weights are written (a
    stale-weight correction where the loop runs the step); returns the undo."""
    original = optimizer.step

    def step(*args, **kwargs):
        result = original(*args, **kwargs)
        after()
        return result

    optimizer.step = step
    return lambda: setattr(optimizer, "step", original)


def _iterators(data_iterator, chunks: int) -> list:
    """One data iterator per chunk (Megatron passes a list with virtual stages; one iterator
    serves a single chunk)."""
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != chunks:
            raise ValueError(f"{len(data_iterator)} data iterators for {chunks} model chunks")
        return list(data_iterator)
    return [data_iterator] * chunks


_OLDER_PREFIX, _DELTA_PREFIX, _STALE_PREFIX = "twobw_older.", "pipemare_delta.", "twobw_stale."
"""Checkpoint keys of the older weight version, of PipeMare's delta and of the stale-weight
correction's state (R(newest) under predict, U_{t-1} under ef): the parameter's key after the
prefix."""
_STALE_KEY = "twobw_stale_state"


def _older_prefix(j: int) -> str:
    """Key prefix of the j-th older version (1: the second newest, 2BW's one)."""
    return _OLDER_PREFIX if j == 1 else f"twobw_older{j}."


def _older_key(j: int) -> str:
    """The sharded-state entry of the j-th older version."""
    return "twobw_older_weights" if j == 1 else f"twobw_older_weights{j}"


def _require(entries, saved_keys: set[str], path: str, what: str) -> None:
    """Refuse a checkpoint that lacks some of ``entries``' keys (the slot could not be
    filled)."""
    missing = sorted(entries.keys() - saved_keys)
    if missing:
        raise CheckpointRefused(
            f"--load: {path} holds {what} of only some parameters ({len(missing)} key(s) "
            f"missing, e.g. {missing[0]}): a run of this schedule cannot resume from it "
            "exactly (it was saved by a megatron-2bw that left them out)")


def _next_action(program: list[Step], index: int) -> str:
    """The action after position ``index`` of a program, for messages ("the end" if none)."""
    return next((str(step) for step in program[index + 1:] if isinstance(step, Action)),
                "the end of the call")


def _report_failure(stage: int, program: list[Step], index: int, error: Exception) -> None:
    """This stage's program for the call, the failing step marked (the row is this stage's)."""
    error.reported_by_stage = stage  # the entry script adds no second line
    grid = format_grid([program], {0: index}).replace("stage 0 ", f"stage {stage} ", 1)
    print(f"error: pipeline stage {stage} failed at step {program[index]} "
          f"({index + 1} of {len(program)} in this call): {error}\n{grid}",
          file=sys.stderr, flush=True)


_RUNNERS: dict[str, PipelineRunner] = {}


def forward_backward_func_for(schedule: str) -> PipelineRunner:
    """The process-wide runner of ``schedule`` (its state spans Megatron calls)."""
    if schedule not in _RUNNERS:
        _RUNNERS[schedule] = PipelineRunner(schedule)
    return _RUNNERS[schedule]


def reset_runners() -> None:
    _RUNNERS.clear()
