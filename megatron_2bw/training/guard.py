"""Every iteration: has any rank been asked to stop, and has training diverged?

One small all-reduce (MAX over every rank, on the loop's gloo control group, from the main
thread) per iteration carries each rank's flags: launched with ``async_op=True`` after the
iteration's step and waited for one iteration later, so it never holds a pipeline stage.
Divergence: a non-finite loss or grad norm, in fp16 too many skipped steps or non-finite
losses in a row, non-finite weights after a step (reduced on the device, read late:
:class:`LateFlags`). A stop request: SIGTERM or SIGINT on any rank (:func:`catch_stop_signals`,
from start-up), or --exit-duration-in-mins passed.

Invariants: every rank posts exactly one exchange per iteration and waits for them in order,
so the control group sees the same all-reduces on every rank; the loop settles every pending
exchange before a checkpoint, so a diverged step is never saved.
The rules and why: docs/checkpoints_and_faults.md, "The per-iteration guard".
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Verdict", "Divergence", "RunGuard", "local_divergence", "nonfinite", "LateFlags",
           "NONFINITE_LOSSES", "catch_stop_signals"]

_STOP, _LOSS, _GRAD, _SKIPS, _WEIGHTS, _FP16_LOSSES = range(6)
_NUM_FLAGS = 6
NONFINITE_LOSSES = 3
"""fp16 with dynamic loss scaling: this many consecutive non-finite losses end the run."""
_received: str | None = None  # the name of the first stop signal this process received


def catch_stop_signals() -> None:
    """From now on SIGTERM and SIGINT are recorded for the loop to stop on, not fatal
    (process-wide, idempotent)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _record_signal)


def _record_signal(signum, frame) -> None:
    global _received
    if _received is None:
        _received = signal.Signals(signum).name


def _received_stop() -> str | None:
    """The stop signal received so far, saying when it came from the launcher's end. Asked
    after the handler ran, not inside it: the kernel sends the signal when the launcher's
    thread that started this rank ends, and may do so before the launcher's last thread ended
    and this process was re-parented."""
    from megatron_2bw.runtime import lifetime

    if _received == "SIGTERM" and lifetime.launcher_gone():
        return "SIGTERM: the launcher of this rank ended"
    return _received


class Divergence(RuntimeError):
    """Training diverged; the message is one line naming the iteration and what was seen."""


@dataclass(frozen=True)
class Verdict:
    """What all ranks said about one iteration."""

    iteration: int
    stop: bool
    divergence: str | None


def nonfinite(tensors) -> torch.Tensor:
    """A 0-d float tensor on the tensors' device: 1.0 where any holds a NaN or inf, else 0.0.
    Computed without a host sync: a max-abs per tensor (fused per dtype), no overflow."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    flags = [torch.stack(torch._foreach_norm(group, float("inf"))).isfinite().all()
             for group in by_dtype.values()]
    if not flags:
        return torch.zeros(())
    return torch.stack(flags).logical_not().any().float()


class LateFlags:
    """Device-side flags of one step, brought to the host without waiting: a non-blocking copy
    (into pinned memory, with an event, on CUDA) read one iteration later, by when the device
    has long passed it; on the CPU the copy is the flags."""

    def __init__(self):
        self.pending: tuple[int, torch.Tensor, object] | None = None

    def record(self, iteration: int, flags: torch.Tensor) -> None:
        event = None
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = flags.clone()
        self.pending = (iteration, host, event)

    def take(self) -> tuple[int, torch.Tensor] | None:
        """The recorded (iteration, flags on the host), or None; forgets them."""
        if self.pending is None:
            return None
        iteration, host, event = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        return iteration, host


def local_divergence(loss: float | None, grad_norm: float | None, skipped: bool,
                     consecutive_skips: int, fp16_dynamic: bool, window: int,
                     consecutive_nonfinite_losses: int = 0) -> int | None:
    """Which divergence rule this rank's numbers break (an index into the flags), or None.
    ``loss`` is None off the last stage, ``grad_norm`` None without clipping or when skipped;
    ``consecutive_nonfinite_losses`` counts this iteration's."""
    if fp16_dynamic:
        if skipped and consecutive_skips >= window:
            return _SKIPS
        if consecutive_nonfinite_losses >= NONFINITE_LOSSES:
            return _FP16_LOSSES
        return None
    if loss is not None and not math.isfinite(loss):
        return _LOSS
    if grad_norm is not None and not math.isfinite(grad_norm):
        return _GRAD
    return None


class RunGuard:
    """Signals and divergence checks of one training process (see the module docstring)."""

    def __init__(self, group, args, install_handlers: bool = True):
        self.group = group
        self.check_nan = not getattr(args, "no_check_for_nan_in_loss_and_grad", False)
        self.fp16_dynamic = bool(args.fp16) and args.loss_scale is None
        self.window = args.loss_scale_window
        self.received: str | None = None
        self.posted_stop = False
        minutes = getattr(args, "exit_duration_in_mins", None)
        self.deadline = None if minutes is None else time.monotonic() + 60.0 * minutes
        self.duration_reason = f"--exit-duration-in-mins {minutes:g} reached" if minutes else None
        self.consecutive_skips = 0
        self.consecutive_nonfinite_losses = 0  # on the last stage, which has the loss
        # (iteration, flags, the all-reduce's work, the step whose weights the flags judge)
        self.pending: list[tuple[int, torch.Tensor, object, int | None]] = []
        self.late = LateFlags()  # whether the last step's weights are not finite
        if install_handlers:
            catch_stop_signals()

    def record_step(self, iteration: int, weights_nonfinite: torch.Tensor) -> None:
        """The device-side :func:`nonfinite` of the weights after iteration ``iteration``'s
        step; read with the next iteration's :meth:`post` (or by :meth:`settle`). Called on
        every rank after every step while the check is on."""
        self.late.record(iteration, weights_nonfinite)

    def _read_step(self, flags: torch.Tensor) -> int | None:
        """Fold the last recorded step's weights flag into this exchange's ``flags``; that
        step's iteration (the same on every rank), None when none was recorded."""
        taken = self.late.take()
        if taken is None:
            return None
        iteration, weights_nonfinite = taken
        flags[_WEIGHTS] = weights_nonfinite
        return iteration

    def post(self, iteration: int, loss: float | None, grad_norm: float | None,
             succeeded: bool) -> None:
        """Launch the exchange of this iteration's flags (with the previous step's)."""
        self.consecutive_skips = 0 if succeeded else self.consecutive_skips + 1
        finite = loss is None or math.isfinite(loss)
        self.consecutive_nonfinite_losses = 0 if finite else self.consecutive_nonfinite_losses + 1
        if self.received is None:
            self.received = _received_stop()
        if self.deadline is not None and self.received is None \
                and time.monotonic() >= self.deadline:
            self.received = self.duration_reason
        flags = torch.zeros(_NUM_FLAGS)
        flags[_STOP] = self.received is not None
        if self.received is not None and not self.posted_stop:
            self.posted_stop = True  # said by the rank that got it: the stop comes <= 2 later
            print(f" stop requested ({self.received}) on rank {dist.get_rank()} by the end "
                  f"of iteration {iteration}", flush=True)
        step = None
        if self.check_nan:
            step = self._read_step(flags)
            broken = local_divergence(loss, grad_norm, not succeeded, self.consecutive_skips,
                                      self.fp16_dynamic, self.window,
                                      self.consecutive_nonfinite_losses)
            if broken is not None:
                flags[broken] = 1.0
        self._launch(iteration, flags, step)

    def _launch(self, iteration: int, flags: torch.Tensor, step: int | None) -> None:
        """All-reduce ``flags`` (of ``iteration``, with the weights of ``step``'s step)."""
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self.pending.append((iteration, flags, work, step))

    def verdicts(self, keep: int = 1) -> list[Verdict]:
        """Wait for all but the newest ``keep`` exchanges; their verdicts, oldest first."""
        split = max(len(self.pending) - keep, 0)
        ready, self.pending = self.pending[:split], self.pending[split:]
        found = []
        for iteration, flags, work, step in ready:
            work.wait()  # bounded by the control group's timeout (--distributed-timeout-minutes)
            if flags[_WEIGHTS]:  # reported at the step that made them
                iteration = step
            found.append(Verdict(iteration, bool(flags[_STOP]), self._describe(flags)))
        return found

    def settle(self) -> list[Verdict]:
        """Wait for every pending exchange (before a checkpoint, at the end), the last step's
        device-side flags included (one more exchange, on every rank at the same point)."""
        if self.late.pending is not None:
            flags = torch.zeros(_NUM_FLAGS)
            step = self._read_step(flags)
            self._launch(step, flags, step)
        return self.verdicts(keep=0)

    def _describe(self, flags: torch.Tensor) -> str | None:
        """What the flags say, the root cause first (weights broken by a step make every
        later loss non-finite)."""
        if flags[_WEIGHTS]:
            return "the weights are not finite (NaN or inf) after the optimizer step"
        if flags[_LOSS]:
            return "the loss is not finite (NaN or inf)"
        if flags[_GRAD]:
            return "the gradient norm is not finite (NaN or inf)"
        if flags[_FP16_LOSSES]:
            return (f"the loss is not finite (NaN or inf) in {NONFINITE_LOSSES} consecutive "
                    f"iterations: the fp16 loss scale cannot make the forward finite again")
        if flags[_SKIPS]:
            return (f"{self.window} consecutive fp16 steps skipped for overflowing gradients "
                    f"(--loss-scale-window): the loss scale cannot recover")
        return None
