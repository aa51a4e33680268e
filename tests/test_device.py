"""Device placement, layer-spec choice and bounded waits, checked without a GPU.

References:
  * the device decision is a pure function of (--cpu, CUDA usable, LOCAL_RANK): a table;
  * a CUDA-looking host is simulated in this process (torch.cuda.is_available/device_count
    patched; set_device/current_device recorded, never run): ``--cpu`` there selects the CPU
    runtime and ``training_device()`` is the CPU; without ``--cpu``, ``set_device(LOCAL_RANK)``
    comes before ``init_process_group(nccl)``, which gets ``device_id`` (NCCL's eager
    communicator creation), and an active CPU runtime is refused;
  * timeouts: after ``initialize()`` on 2 gloo processes, torch's own record of each group's
    timeout (``group._get_backend(cpu).options._timeout``) for the default group, every
    megatron-core group and the training loop's control group; and the ``timeout=`` that each
    ``torch.distributed.new_group`` call received (megatron-core 0.16.1 omits it for
    EXPERT_DATA_PARALLEL_GROUP_GLOO, which ``initialize()`` then bounds).
"""

from __future__ import annotations

import datetime

import pytest
import torch

from megatron_2bw import entry
from megatron_2bw.runtime import cpu, device, distributed
from megatron_2bw.training import specs
from tests import dist as launch

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--train-iters", "1", "--lr", "1e-3", "--mock-data"]


@pytest.fixture
def clean_runtime(monkeypatch):
    """The test starts without the CPU runtime and without a device choice; afterwards the
    process is as it was (an earlier in-process test may have installed the runtime)."""
    was_installed = cpu.is_installed()
    cpu.uninstall()
    monkeypatch.setattr(device, "_choice", None)
    monkeypatch.setenv("LOCAL_RANK", "0")
    yield
    cpu.uninstall()
    if was_installed:
        cpu.install(force=True)


def _cuda_looking_host(monkeypatch) -> list:
    """torch.cuda reports one usable device; set_device/current_device are recorded, not run,
    and creating a CUDA tensor would fail (CPU build) or is caught by the recorder."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    return calls


# ---- the decision ---------------------------------------------------------------------------

@pytest.mark.parametrize("force_cpu, cuda_usable, local_rank, kind, index, backend", [
    (False, True, 0, "cuda", 0, "nccl"),
    (False, True, 3, "cuda", 3, "nccl"),
    (True, True, 3, "cpu", None, "gloo"),    # --cpu on a GPU host
    (False, False, 1, "cpu", None, "gloo"),
    (True, False, 0, "cpu", None, "gloo"),
])
def test_choose_device(force_cpu, cuda_usable, local_rank, kind, index, backend):
    choice = device.choose_device(force_cpu, cuda_usable, local_rank)
    assert (choice.kind, choice.index, choice.backend) == (kind, index, backend)


@pytest.mark.parametrize("force_cpu, cuda_usable, kind", [
    (False, True, "cuda"), (True, True, "cpu"), (False, False, "cpu")])
def test_device_kind_is_the_same_decision(monkeypatch, force_cpu, cuda_usable, kind):
    monkeypatch.setattr(cpu, "cuda_usable", lambda: cuda_usable)
    assert device.device_kind(force_cpu) == kind


def test_training_device_before_initialize_is_an_error(clean_runtime):
    with pytest.raises(RuntimeError, match="before .*initialize"):
        device.training_device()


def test_cpu_flag_on_a_cuda_host_selects_the_cpu_runtime(clean_runtime, monkeypatch):
    calls = _cuda_looking_host(monkeypatch)
    args, tokenizer = entry.setup("gpt", [*TINY, "--cpu"])
    assert args.cpu and tokenizer is None
    assert cpu.is_installed()
    assert device.device_choice().kind == "cpu"
    assert device.training_device() == torch.device("cpu")
    assert calls == []  # no set_device: nothing touched a CUDA device


def test_cuda_host_sets_the_device_before_the_process_group(clean_runtime, monkeypatch):
    calls = _cuda_looking_host(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")

    class Stop(Exception):
        pass

    def init_process_group(backend, rank, world_size, timeout, device_id):
        calls.append(("init_process_group", backend, timeout, device_id))
        raise Stop  # what follows needs real NCCL

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    with pytest.raises(Stop):
        distributed.initialize(1, 1, seed=1, timeout_minutes=0.5)
    assert calls == [("set_device", 1),
                     ("init_process_group", "nccl", datetime.timedelta(seconds=30),
                      torch.device("cuda", 1))]  # bound device: NCCL groups connect eagerly
    assert not cpu.is_installed()
    assert device.training_device() == torch.device("cuda", 1)


def test_cpu_runtime_on_cuda_is_refused(clean_runtime, monkeypatch):
    calls = _cuda_looking_host(monkeypatch)
    cpu.install(force=True)
    with pytest.raises(RuntimeError, match="CPU runtime is active in a process that trains "
                                           "on CUDA"):
        device.select_device(force_cpu=False)
    assert calls == []


def test_per_token_loss_count_is_on_the_stage_device(monkeypatch):
    """--calculate-per-token-loss: a call's token count is created on the stage's device, the
    one its exchanges use (``training_device()``), as megatron-core's schedules create it
    (``torch.zeros([], dtype=torch.int, device="cuda")``): the last stage adds the loss
    function's device count to it and ``finalize_model_grads`` broadcasts it over the pipeline
    group, NCCL on a GPU. "meta" stands in for the GPU (a count made on the CPU is not on it)."""
    from types import SimpleNamespace

    from megatron_2bw.schedules import executor

    stage_device = torch.device("meta")
    runner = executor.PipelineRunner("flush")
    monkeypatch.setattr(runner, "_setup", lambda *_: setattr(
        runner, "comm", SimpleNamespace(device=stage_device)))
    monkeypatch.setattr(runner, "_train_call", lambda call: call)
    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace()
    call = runner(forward_step_func=None, data_iterator=None, model=model, num_microbatches=2,
                  seq_length=4, micro_batch_size=1)
    assert call.num_tokens.device == stage_device
    assert (call.num_tokens.shape, call.num_tokens.dtype) == (torch.Size([]), torch.int)


# ---- batches --------------------------------------------------------------------------------

def test_to_device_on_cpu_moves_and_pins_nothing():
    batch = {"tokens": torch.arange(6).view(2, 3), "labels": torch.ones(2, 3, dtype=torch.long),
             "attention_mask": torch.ones(2, 1, 3, 3, dtype=torch.bool), "extra": None}
    moved = device.to_device(batch, torch.device("cpu"))
    assert moved is batch
    assert all(not t.is_pinned() for t in moved.values() if t is not None)


# ---- layer specs ----------------------------------------------------------------------------

@pytest.mark.parametrize("impl, have_te, on_cuda, expected, why", [
    ("transformer_engine", True, True, True, "--transformer-impl transformer_engine"),
    ("transformer_engine", False, True, False, "not importable"),
    ("transformer_engine", True, False, False, "CPU"),
    ("local", True, True, False, "--transformer-impl local"),
])
def test_use_transformer_engine(impl, have_te, on_cuda, expected, why):
    use, reason = specs.use_transformer_engine(impl, have_te, on_cuda)
    assert use is expected and why in reason


def test_transformer_engine_on_cpu_falls_back_with_one_line(clean_runtime, monkeypatch, capsys):
    from megatron.core.models.gpt import gpt_layer_specs

    args, _ = entry.setup("gpt", [*TINY, "--cpu"])
    assert args.transformer_impl == "transformer_engine"  # Megatron-LM's default
    monkeypatch.setattr(specs, "_reported_layer_spec", False)
    capsys.readouterr()
    for _ in range(2):
        spec = specs.gpt_layer_spec(args)
    local = gpt_layer_specs.get_gpt_layer_local_spec()
    assert spec.submodules.mlp.submodules.linear_fc1 is local.submodules.mlp.submodules.linear_fc1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert lines == [" --transformer-impl transformer_engine: using the local layer spec "
                     "(this process runs on the CPU; transformer_engine needs CUDA)"]


# ---- timeouts -------------------------------------------------------------------------------

def _timeout_of(group) -> datetime.timedelta:
    """torch's record of a gloo group's timeout."""
    return group._get_backend(torch.device("cpu")).options._timeout


def _group_timeouts_worker(rank: int, world_size: int, minutes: float) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_2bw.training import loop

    passed = []
    new_group = dist.new_group

    def recording_new_group(*args, **kwargs):
        passed.append((kwargs.get("group_desc"), kwargs.get("timeout")))
        return new_group(*args, **kwargs)

    dist.new_group = recording_new_group  # megatron-core's create_group calls it by this name
    distributed.initialize(1, 2, seed=1, force_cpu=True, timeout_minutes=minutes)
    groups = [g for g in ps._global_process_group_list if g is not None]
    result = {"configured": distributed.timeout(),
              "default": _timeout_of(dist.distributed_c10d._get_default_group()),
              "megatron": [_timeout_of(g) for g in groups],
              "control": _timeout_of(loop._cpu_group()),
              "new_group_calls": passed}
    distributed.destroy()
    return result


def test_every_group_carries_the_configured_timeout(tmp_path):
    minutes = 0.5
    expected = datetime.timedelta(seconds=30)
    results = launch.spawn(_group_timeouts_worker, 2, minutes, out_dir=tmp_path, timeout=180)
    for rank, result in enumerate(results):
        assert result["configured"] == expected, rank
        assert result["default"] == expected, rank
        assert len(result["megatron"]) >= 5, result["megatron"]  # TP, PP, DP, MP, ... groups
        assert set(result["megatron"]) == {expected}, (rank, result["megatron"])
        assert result["control"] == expected, rank
        # megatron-core 0.16.1 passes no timeout for one group; initialize() bounds it after
        unbounded = {desc for desc, bound in result["new_group_calls"] if bound != expected}
        assert unbounded <= {"EXPERT_DATA_PARALLEL_GROUP_GLOO"}, (rank, unbounded)


def test_timeout_flag_must_be_positive():
    from megatron_2bw.arguments import FlagError, parse_args

    args = parse_args([*TINY, "--distributed-timeout-minutes", "0.25"], world_size=1)
    assert args.distributed_timeout_minutes == 0.25
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(FlagError, match="--distributed-timeout-minutes"):
            parse_args([*TINY, "--distributed-timeout-minutes", bad], world_size=1)


def test_timeout_default_before_initialize(monkeypatch):
    monkeypatch.setattr(distributed, "_timeout", None)
    assert distributed.timeout() == datetime.timedelta(minutes=10)
