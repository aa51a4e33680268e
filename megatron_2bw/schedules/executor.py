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

import sys
from typing import Callable

import torch

from megatron_2bw.corrections import StaleCorrection
from megatron_2bw.deferred import DeferredStep, why_not_deferred
from megatron_2bw.discrepancy import DiscrepancyCorrection
from megatron_2bw.runtime import device, distributed
from megatron_2bw.runtime.clock import clock_for
from megatron_2bw.schedules import (Action, Exchange, Kind, Placement, Step, call_program,
                                    format_grid, forward_program, keeps_versions, placement_of)
from megatron_2bw.schedules.actions import MAKES_PARAM_GRADS, SENDS_GRAD
from megatron_2bw.schedules.call import Call, model_chunks
from megatron_2bw.schedules.comm import reads_from
from megatron_2bw.schedules.mailbox import Mailbox
from megatron_2bw.schedules.moe_microbatches import AuxLossLedger
from megatron_2bw.schedules.p2p import CommError, StageComm
from megatron_2bw.schedules.passes import Passes
from megatron_2bw.schedules.pipemare import PipeMareOptions, call_schedule
from megatron_2bw.schedules.stepping import Stepping, after_each_step
from megatron_2bw.schedules.timeline import Timeline, TimelineRecord
from megatron_2bw.schedules.version_checkpoint import VersionCheckpoint
from megatron_2bw.schedules.version_checkpoint import _require  # noqa: F401 (executor._require)
from megatron_2bw.schedules.wgrad import PendingWeightGrads, WeightGradStore
from megatron_2bw.weights import WeightVersions

__all__ = ["PipelineRunner", "forward_backward_func_for", "reset_runners", "TimelineRecord"]


class PipelineRunner(Timeline, Mailbox, Passes, Stepping, VersionCheckpoint):
    """``forward_backward_func`` for one schedule; keeps state across Megatron calls (2BW's
    in-flight microbatches and weight versions). Composed of the handlers of each kind of
    action (mailbox.py: exchanges; passes.py: F, B, I, W; stepping.py: S and the step's
    corrections), the weight versions' checkpoint entries (version_checkpoint.py) and the
    timeline (timeline.py); this class holds their state and runs a call's program."""

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

        models = model_chunks(model)
        config = get_model_config(models[0])
        self._setup(models, config,
                    seq_length if decoder_seq_length is None else decoder_seq_length,
                    micro_batch_size)
        call = Call(forward_step_func, _iterators(data_iterator, len(models)), models, config,
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

    def drain(self) -> None:
        """Called before evaluation and checkpoints: the pipeline must already be empty, and
        a deferred step is applied."""
        if self.stash or self.weight_grads or self.inbox or self.outbox or self.handoff:
            raise RuntimeError(f"{self.schedule}: microbatches are still in flight; call "
                               "prepare_drain() before the last training call")
        if self.deferred is not None:
            self._apply_deferred()
        self._resolve_timeline()

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
            self._unwrap_step = after_each_step(self.optimizer, self.stale.after_update)
        if dist.get_rank() == 0:
            print(f" {self.schedule} optimizer step on stage {self.stage}: {self.step_mode}",
                  flush=True)

    # ---- training call -------------------------------------------------------------------
    def _train_call(self, call: Call) -> list:
        """One training call: the stage's program for batch ``batches_done`` (filling and
        draining as the pipeline's state says), run in order; the call's losses."""
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

    def _launch_param_gathers(self, call: Call, actions: list[Action]) -> None:
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

    def _execute(self, program: list[Step], call: Call, run_action: Callable) -> None:
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

    def _run(self, action: Action, call: Call) -> None:
        """One action through its handler (``_HANDLERS``), timed when recording."""
        if self.deferred is not None:
            self.deferred.progress()  # moves its collectives on; never blocks
        start = self._mark()
        _HANDLERS[action.kind](self, action, call)
        self._record(action.kind.value, action.microbatch, action.version, start)

    # ---- evaluation ----------------------------------------------------------------------
    def _forward_only(self, call: Call, collect_non_loss_data: bool) -> list:
        """Every microbatch through the pipeline once, with the newest weights."""
        from megatron.core.pipeline_parallel.schedules import forward_step

        self.drain()
        if self.versions is not None:
            self.versions.use_trained()
        m = call.num_microbatches

        def forward(action: Action, call: Call) -> None:
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

    def _timeline_clock(self):
        """The timeline's clock, anchored: CUDA events on CUDA, the host clock on the CPU."""
        return clock_for(device.training_device(), anchored=True)


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


def _iterators(data_iterator, chunks: int) -> list:
    """One data iterator per chunk (Megatron passes a list with virtual stages; one iterator
    serves a single chunk)."""
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != chunks:
            raise ValueError(f"{len(data_iterator)} data iterators for {chunks} model chunks")
        return list(data_iterator)
    return [data_iterator] * chunks


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
