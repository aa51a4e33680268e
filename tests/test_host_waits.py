"""What the host waits for on a GPU, decided without one: plain waits, clocks, timers.

References, each a rule megatron-core follows on CUDA, checked where the CPU can decide it:
  * an exchange's and a deferred collective's wait is a plain ``work.wait()`` (no ``timeout=``:
    under NCCL a timed wait makes the host poll); the process group's timeout bounds it, and a
    wait that fails still gives one line naming the peer and --distributed-timeout-minutes;
  * the clock of a device: CUDA events on ``cuda``, the host clock on ``cpu``; an event clock
    turns marks into seconds from the events' own times (``elapsed_time``), and onto the host's
    time line through one anchor synchronized once;
  * timers: megatron-core's ``Timer`` calls ``torch.cuda.synchronize()`` at each start and stop
    (what waits for 2BW's in-flight all-reduces); under our schedules the loop's timers call it
    never, and measure the time between start and stop as megatron-core's do; under
    ``--pipeline-schedule megatron`` megatron-core's own timers stay (with the level-1 barrier).
"""

from __future__ import annotations

import argparse
import datetime
import time

import pytest
import torch
from megatron.core.timers import Timer, Timers

from megatron_2bw.deferred import DeferredStep
from megatron_2bw.runtime.clock import EventClock, HostClock, clock_for
from megatron_2bw.schedules.comm import Exchange, Transfer
from megatron_2bw.schedules.p2p import CommError, StageComm
from megatron_2bw.training import logs
from megatron_2bw.training.timers import StreamTimer, StreamTimers, syncs_device, timers_for


class Work:
    """A torch.distributed Work stand-in: records how it was waited for."""

    def __init__(self, error: Exception | None = None):
        self.waits, self.error = [], error

    def wait(self, *args, **kwargs):
        self.waits.append((args, kwargs))
        if self.error is not None:
            raise self.error
        return True


def _stage_comm() -> StageComm:
    comm = StageComm.__new__(StageComm)  # no process group: only the wait is under test
    comm.stage, comm.ranks = 0, {1: 1}
    comm.timeout = datetime.timedelta(minutes=0.5)
    return comm


EXCHANGE = Exchange((Transfer("send", 1, "activation", 3), Transfer("recv", 1, "grad", 2)))


def test_an_exchange_waits_plainly():
    work = Work()
    _stage_comm()._wait(work, EXCHANGE, "B2")
    assert work.waits == [((), {})]


def test_a_failed_exchange_wait_is_one_line_naming_the_peer():
    error = RuntimeError("Timed out waiting 30000ms for recv operation to complete")
    with pytest.raises(CommError) as raised:
        _stage_comm()._wait(Work(error), EXCHANGE, "B2")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("stage 0: waiting on rank 1 (stage 1) for the exchange before B2 "
                              "(send activation of microbatch 3 to stage 1; recv gradient "
                              "of microbatch 2 from stage 1)"), message
    assert "--distributed-timeout-minutes 0.5" in message and "Timed out waiting" in message


def test_a_deferred_collective_waits_plainly():
    step = DeferredStep.__new__(DeferredStep)  # no optimizer: only the wait is under test
    step.timeout, step.pending_version = datetime.timedelta(minutes=1), 4
    work = Work()
    step._wait((work, None, "the grad-norm all-reduce"))
    assert work.waits == [((), {})]


# ---- clocks -------------------------------------------------------------------------------------

def test_the_clock_follows_the_device():
    assert isinstance(clock_for(torch.device("cpu")), HostClock)
    assert isinstance(clock_for(torch.device("cuda", 0)), EventClock)  # makes no event yet
    assert clock_for(torch.device("cuda", 1), anchored=True).anchored


class FakeEvent:
    """A CUDA event stand-in on a made-up device time line (ms)."""

    device_ms = 0.0
    log: list = []

    def record(self):
        self.ms = FakeEvent.device_ms
        FakeEvent.log.append("record")

    def synchronize(self):
        FakeEvent.log.append("synchronize")

    def query(self):
        return True

    def elapsed_time(self, end) -> float:
        return end.ms - self.ms


def test_an_event_clock_reads_device_time_without_waiting_at_marks(monkeypatch):
    FakeEvent.device_ms, FakeEvent.log = 100.0, []
    clock = EventClock(FakeEvent, anchored=True)
    monkeypatch.setattr(time, "perf_counter", lambda: 50.0)  # when the anchor ran, host time
    start = clock.mark()  # the anchor first: recorded and waited for once
    FakeEvent.device_ms = 350.0  # the device ran 250 ms of work
    end = clock.mark()
    assert FakeEvent.log == ["record", "synchronize", "record", "record"]
    assert clock.seconds(start, end) == pytest.approx(0.25)
    assert clock.at(start) == pytest.approx(50.0) and clock.at(end) == pytest.approx(50.25)
    FakeEvent.log = []
    EventClock(FakeEvent).mark()  # not anchored (timers): no wait at all
    assert FakeEvent.log == ["record"]


# ---- timers -------------------------------------------------------------------------------------

def _count_syncs(monkeypatch) -> list:
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1))
    return syncs


def test_megatron_core_timers_synchronize_the_device(monkeypatch):
    """The reference: what megatron-core's Timer does at every start and stop."""
    syncs = _count_syncs(monkeypatch)
    timer = Timers(1, "max")("forward-backward", log_level=1)
    assert type(timer) is Timer
    timer.start()
    timer.stop()
    assert len(syncs) == 2


@pytest.mark.parametrize("schedule", ["2bw", "flush", "gpipe", "pipedream", "megatron"])
def test_the_loops_timers_synchronize_only_under_megatrons_schedule(monkeypatch, schedule):
    syncs = _count_syncs(monkeypatch)
    args = argparse.Namespace(pipeline_schedule=schedule, timing_log_level=2,
                              timing_log_option="minmax", log_num_zeros_in_grad=False)
    model_config, optimizer = argparse.Namespace(), argparse.Namespace(config=argparse.Namespace())
    timers = logs.attach_timers(args, model_config, optimizer, "cpu")
    assert model_config.timers is timers and optimizer.config.timers is timers
    assert model_config.barrier_with_L1_time == (schedule == "megatron") == syncs_device(schedule)
    for name in ("forward-backward", "optimizer"):
        timer = timers(name, log_level=1)
        timer.start()
        time.sleep(0.02)
        timer.stop()
        assert timer.elapsed(reset=False) >= 0.02
    assert len(syncs) == (4 if schedule == "megatron" else 0), syncs
    assert isinstance(timers, StreamTimers) == (schedule != "megatron")


def test_stream_timers_on_cuda_mark_events():
    timers = timers_for("2bw", 1, "max", torch.device("cuda", 0))
    assert isinstance(timers, StreamTimers) and isinstance(timers.clock, EventClock)
    assert not timers.clock.anchored  # durations only: no anchor wait


def test_a_stream_timer_on_events_adds_device_time(monkeypatch):
    FakeEvent.device_ms, FakeEvent.log = 0.0, []
    timer = StreamTimer("optimizer", EventClock(FakeEvent))
    for ms in (10.0, 30.0):
        timer.start()
        FakeEvent.device_ms += ms
        timer.stop()
        FakeEvent.device_ms += 1000.0  # not timed
    assert "synchronize" not in FakeEvent.log  # nothing waited while timing
    assert timer.elapsed() == pytest.approx(0.040)
    assert timer.elapsed() == 0.0  # reset


def test_executor_timelines_mark_events_on_cuda_and_resolve_after_the_call(monkeypatch):
    """The executor's timeline clock is chosen from the training device, anchored; marks are
    taken around each action and become records (perf_counter seconds) when the call ends."""
    from megatron_2bw.runtime import device
    from megatron_2bw.schedules import executor

    made = []

    def clock(device, anchored=False):
        made.append((device, anchored))
        return EventClock(FakeEvent, anchored=anchored)

    monkeypatch.setattr(device, "training_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(executor, "clock_for", clock)
    monkeypatch.setattr(time, "perf_counter", lambda: 7.0)
    FakeEvent.device_ms, FakeEvent.log = 0.0, []
    runner = executor.PipelineRunner("2bw")
    runner.stage = 1
    assert runner._mark() is None  # no timeline: no clock, no mark
    runner.timeline = []
    start = runner._mark()
    FakeEvent.device_ms = 20.0
    runner._record("F", 3, 0, start)
    assert runner.timeline == [] and made == [(torch.device("cuda", 0), True)]
    runner._resolve_timeline()
    assert runner.timeline == [executor.TimelineRecord(1, "F", 3, 0, 7.0, pytest.approx(7.02))]
