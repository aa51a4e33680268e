"""The CPU runtime: device selection, install/uninstall, and real megatron-core on gloo.

References:
  * selection: CUDA availability simulated with monkeypatch (our decision logic only);
  * install/uninstall: every attribute of the patched modules, snapshotted before install, is
    the identical object again after uninstall (in a subprocess, so this process stays clean);
  * parallel runs: megatron-core's GPTModel split by tensor (TP=2), pipeline (PP=2, Megatron's
    own 1F1B schedule) and data parallelism (DP=2, Megatron DDP) on 2 gloo processes gives the
    loss and the full gradients of one unsplit GPTModel (TP=1, PP=1, whole batch, plain
    autograd) holding the same weights, built in the same worker;
  * full activation recomputation under TP=2: the same gradients as without it, and each
    layer's forward really runs twice (once more inside backward).
Derived checks on the reference itself: the loss of a freshly initialized model is ~ln(vocab),
and a token changes no loss at earlier positions (the causal mask is really applied).
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
import traceback

import pytest
import torch

from megatron_2bw.runtime import cpu
from tests import dist as launch

VOCAB, SEQ, HIDDEN, HEADS, LAYERS = 64, 16, 32, 4, 4
MICRO_BATCH = 2
RTOL = 1e-5
TIMEOUT = 180


# ---- device selection (this process; CUDA availability simulated) -------------------------

def _fake_cuda(monkeypatch, available: bool, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("available, count, force, expected", [
    (True, 1, False, "cuda"),
    (True, 8, False, "cuda"),
    (True, 1, True, "cpu"),    # --cpu on a GPU machine
    (True, 0, False, "cpu"),   # CUDA build, no visible device
    (False, 0, False, "cpu"),
    (False, 0, True, "cpu"),
])
def test_device_kind(monkeypatch, available, count, force, expected):
    _fake_cuda(monkeypatch, available, count)
    from megatron_2bw.runtime.device import device_kind

    assert device_kind(force_cpu=force) == expected


def test_install_refuses_when_cuda_is_usable(monkeypatch):
    was_installed = cpu.is_installed()  # an earlier in-process test may have run an entry point
    cpu.uninstall()
    _fake_cuda(monkeypatch, True, 1)
    current_device = torch.cuda.current_device
    try:
        with pytest.raises(RuntimeError, match="--cpu"):
            cpu.install()
        assert not cpu.is_installed()
        assert torch.cuda.current_device is current_device
        assert torch.overrides._get_current_function_mode_stack() == []
    finally:
        cpu.uninstall()  # only acts if install wrongly went through
        if was_installed:
            cpu.install(force=True)


_INSTALL_ROUND_TRIP = textwrap.dedent('''
    import logging, types
    import torch
    from megatron.core import jit
    from megatron.core.tensor_parallel import random as tp_random
    from megatron_2bw.runtime import cpu

    modules = {"torch.cuda": torch.cuda, "torch.autograd": torch.autograd,
               "tp_random": tp_random, "jit": jit}
    def snapshot():
        return {m: dict(vars(mod)) for m, mod in modules.items()}
    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    before, filters = snapshot(), list(logger.filters)
    with torch.no_grad():
        reference = torch.ones(2)

    cpu.install()
    cpu.install()  # idempotent
    during = snapshot()
    for name in ("current_device", "synchronize", "manual_seed", "get_rng_state", "Stream"):
        assert during["torch.cuda"][name] is not before["torch.cuda"][name], name
    assert during["torch.autograd"]["_engine_run_backward"] is not \\
        before["torch.autograd"]["_engine_run_backward"]
    # CUDA spellings land on the CPU
    assert torch.empty(3, device="cuda").device.type == "cpu"
    assert torch.ones(2).cuda().device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"
    # seeding is real: same seed, same numbers; another seed, other numbers
    torch.cuda.manual_seed(5); a = torch.rand(4)
    torch.cuda.manual_seed(5); b = torch.rand(4)
    torch.cuda.manual_seed(6); c = torch.rand(4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # the remapping is active inside autograd's backward
    class CudaInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2
        @staticmethod
        def backward(ctx, g):
            return g * 2 + torch.zeros(g.shape, device="cuda")
    x = torch.ones(3, requires_grad=True)
    CudaInBackward.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))

    cpu.uninstall()
    after = snapshot()
    for m in before:
        changed = [k for k in before[m] if after[m].get(k) is not before[m][k]]
        added = [k for k in after[m] if k not in before[m]
                 and not isinstance(after[m][k], types.ModuleType)]
        assert not changed and not added, (m, changed, added)
    assert logger.filters == filters, logger.filters
    assert torch.overrides._get_current_function_mode_stack() == []
    assert not cpu.is_installed()
    try:
        torch.empty(1, device="cuda")  # a CPU build of torch: CUDA is gone again
    except (RuntimeError, AssertionError):
        pass
    else:
        raise AssertionError("device='cuda' still maps to the CPU after uninstall")
    print("round trip ok")
''')


def test_install_uninstall_round_trip():
    if cpu.cuda_usable():
        pytest.skip("the CPU runtime installs only where CUDA is not usable")
    done = subprocess.run([sys.executable, "-c", _INSTALL_ROUND_TRIP], cwd=launch.REPO,
                          env=launch.subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "round trip ok" in done.stdout, done.stderr[-3000:]


_JIT_AT_IMPORT = textwrap.dedent('''
    import sys
    import torch
    import megatron_2bw
    from megatron_2bw.runtime import cpu
    compile_ = torch.compile
    if {cuda!r}:
        cpu.cuda_usable = lambda: True  # what a GPU machine answers
    from megatron.core import jit
    from megatron.core.fusions import fused_bias_gelu
    assert torch.compile is compile_
    print("dynamo imported:", "torch._dynamo" in sys.modules)
    print("fuser is torch.compile:", jit.jit_fuser is torch.compile)
    print("bias_gelu is wrapped:", hasattr(fused_bias_gelu.bias_gelu, "__wrapped__"))
''')


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu-machine", "cuda-machine"])
def test_megatron_fuser_is_chosen_at_import_only_without_cuda(cuda):
    """Without CUDA, megatron-core's fused functions are left undecorated at its import (no
    TorchDynamo import); where CUDA is usable its import is untouched (torch.compile)."""
    if cpu.cuda_usable():
        pytest.skip("needs a machine without CUDA")
    done = subprocess.run([sys.executable, "-c", _JIT_AT_IMPORT.format(cuda=cuda)],
                          cwd=launch.REPO, env=launch.subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"dynamo imported: {cuda}" in done.stdout, done.stdout
    assert f"fuser is torch.compile: {cuda}" in done.stdout, done.stdout
    assert f"bias_gelu is wrapped: {cuda}" in done.stdout, done.stdout


# ---- megatron-core on 2 gloo processes: workers (run in spawned processes) ------------------

def _config(tp: int = 1, pp: int = 1, **overrides):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        ffn_hidden_size=2 * HIDDEN, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, **overrides)


def _gpt(config, pre_process: bool = True, post_process: bool = True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                    max_sequence_length=SEQ, pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=True)


def _batch(samples: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"tokens": torch.randint(0, VOCAB, (samples, SEQ), generator=g),
            "labels": torch.randint(0, VOCAB, (samples, SEQ), generator=g),
            "position_ids": torch.arange(SEQ).repeat(samples, 1)}


def _token_losses(model, batch: dict) -> torch.Tensor:
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # (b, s)


def _layout(tp: int, pp: int) -> None:
    """(Re)build megatron-core's groups for this layout; the world (2 processes) stays."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.runtime import distributed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    distributed.initialize(tp, pp, seed=1234, force_cpu=True, timeout_minutes=2)


def _global_name(name: str) -> str:
    """A stage's parameter name in the unsplit model: layer numbers shifted by the stage's first
    layer; the last stage's copy of the tied output weight is the word embedding."""
    from megatron.core import parallel_state as ps

    if name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    stages = ps.get_pipeline_model_parallel_world_size()
    offset = ps.get_pipeline_model_parallel_rank() * LAYERS // stages
    return re.sub(r"^decoder\.layers\.(\d+)\.",
                  lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def _load_from_full(model, full: dict) -> None:
    """Copy the unsplit model's weights into this rank's shard (tensor-parallel parameters
    carry megatron's ``partition_dim``)."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = full[_global_name(name)]
            if getattr(p, "tensor_model_parallel", False):
                w = torch.chunk(w, tp, dim=p.partition_dim)[tp_rank]
            assert w.shape == p.shape, (name, w.shape, p.shape)
            p.copy_(w)


def _full_grads(model, attr: str = "grad") -> dict:
    """Gradients by unsplit-model name, tensor-parallel shards gathered across the TP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp, out = ps.get_tensor_model_parallel_world_size(), {}
    for name, p in model.named_parameters():
        g = getattr(p, attr).detach().clone()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g.contiguous(), group=ps.get_tensor_model_parallel_group())
            g = torch.cat(parts, dim=p.partition_dim)
        out[_global_name(name)] = g
    return out


def _reference(batch: dict) -> dict:
    """One unsplit GPTModel (TP=1, PP=1) on the whole batch with plain autograd."""
    _layout(1, 1)
    model = _gpt(_config())
    token_losses = _token_losses(model, batch)
    loss = token_losses.mean()
    loss.backward()
    # causality probe: change the token at position j; losses before j must not move
    j = SEQ // 2
    probe = dict(batch, tokens=batch["tokens"].clone())
    probe["tokens"][:, j] = (probe["tokens"][:, j] + 1) % VOCAB
    with torch.no_grad():
        probe_losses = _token_losses(model, probe)
    return {"loss": float(loss),
            "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
            "token_losses": token_losses.detach(), "probe_losses": probe_losses, "probe_at": j}


def _count_calls(module) -> list:
    calls = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


def _tensor_parallel(batch: dict, reference: dict) -> dict:
    """TP=2, with and without full activation recomputation."""
    _layout(2, 1)
    out = {}
    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)
    for name, overrides in (("plain", {}), ("recompute", recompute)):
        model = _gpt(_config(tp=2, **overrides))
        _load_from_full(model, reference["weights"])
        calls = _count_calls(model.decoder.layers[0])
        loss = _token_losses(model, batch).mean()
        loss.backward()
        out[name] = {"loss": float(loss), "grads": _full_grads(model),
                     "layer0_forwards": len(calls)}
    return out


def _forward_step(data_iterator, model):
    """Megatron's forward_step_func contract; the reported loss is a copy (the schedule
    divides the returned one by the number of microbatches in place)."""
    batch = next(data_iterator)
    output = _token_losses(model, batch)

    def loss_func(token_losses):
        loss = token_losses.mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def _pipeline_parallel(batch: dict, reference: dict) -> dict:
    """PP=2 under megatron-core's own 1F1B schedule, the batch in microbatches, with Megatron
    DDP and finalize_model_grads (which all-reduces the tied embedding's gradient across the
    first and last stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _layout(1, 2)
    config = _config(pp=2)
    model = _gpt(config, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    _load_from_full(model, reference["weights"])
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func = finalize_model_grads
    num_microbatches = len(batch["tokens"]) // MICRO_BATCH
    microbatches = [{k: v[i * MICRO_BATCH:(i + 1) * MICRO_BATCH] for k, v in batch.items()}
                    for i in range(num_microbatches)]
    forward_backward = get_forward_backward_func()
    losses = forward_backward(forward_step_func=_forward_step, data_iterator=iter(microbatches),
                              model=[ddp], num_microbatches=num_microbatches, seq_length=SEQ,
                              micro_batch_size=MICRO_BATCH, forward_only=False)
    return {"schedule": forward_backward.__name__, "last_stage": ps.is_pipeline_last_stage(),
            "microbatch_losses": [float(d["loss"]) for d in losses],
            "grads": _full_grads(ddp.module, "main_grad")}


def _data_parallel(batch: dict, reference: dict) -> dict:
    """DP=2: each rank one half of the batch; Megatron DDP's all-reduce in
    finalize_model_grads."""
    import torch.distributed as dist
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)

    _layout(1, 1)  # on 2 processes: data-parallel size 2
    rank, half = dist.get_rank(), len(batch["tokens"]) // dist.get_world_size()
    config = _config()
    model = _gpt(config)
    _load_from_full(model, reference["weights"])
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    mine = {k: v[rank * half:(rank + 1) * half] for k, v in batch.items()}
    loss = _token_losses(ddp, mine).mean()
    loss.backward()
    finalize_model_grads([ddp])
    grads = _full_grads(model, "main_grad")
    return {"loss": float(loss), "grads": grads, **_adam_step(ddp, model, grads)}


def _adam_step(ddp, model, grads: dict) -> dict:
    """One step of the optimizer megatron-2bw builds on the CPU (weight decay off) against
    torch's per-parameter AdamW from the same weights and gradients."""
    from megatron_2bw.arguments import parse_args
    from megatron_2bw.training import build

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = parse_args(["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
                       "--num-attention-heads", str(HEADS), "--seq-length", str(SEQ),
                       "--max-position-embeddings", str(SEQ), "--micro-batch-size", "2",
                       "--vocab-size", str(VOCAB), "--mock-data", "--cpu", "--lr", "1e-3",
                       "--weight-decay", "0", "--clip-grad", "0", "--train-iters", "1"],
                      world_size=2)
    optimizer = build.build_optimizer(args, [ddp])
    optimizer.step()
    reference = {n: torch.nn.Parameter(w.clone()) for n, w in before.items()}
    for n, p in reference.items():
        p.grad = grads[_global_name(n)].clone()
    torch.optim.AdamW(list(reference.values()), lr=1e-3, weight_decay=0.0, eps=args.adam_eps,
                      betas=(args.adam_beta1, args.adam_beta2), foreach=False).step()
    moved = max(_relative_error(p.detach() - before[n], reference[n].detach() - before[n])
                for n, p in model.named_parameters())
    return {"adam_update_error": moved,
            "adam_fused": [g["fused"] for g in optimizer.optimizer.param_groups]}


def runtime_worker(rank: int, world_size: int) -> dict:
    """The unsplit reference, then TP=2, PP=2 and DP=2 on the same weights and batch, in one
    pair of processes (each layout rebuilds megatron-core's groups). A part that raises is
    reported in its own entry, so its test fails with the traceback and the others still run."""
    batch = _batch(4 * MICRO_BATCH)
    reference = _reference(batch)
    out = {"reference": {k: v for k, v in reference.items() if k != "weights"}}
    for name, part in (("tp", _tensor_parallel), ("pp", _pipeline_parallel),
                       ("dp", _data_parallel)):
        try:
            out[name] = part(batch, reference)
        except Exception:  # noqa: BLE001 - handed to the test that owns this part
            out[name] = {"error": traceback.format_exc()}
    return out


# ---- megatron-core on 2 gloo processes: the checks ----------------------------------------

def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def _assert_same_grads(actual: dict, expected: dict, what: str) -> None:
    assert set(actual) <= set(expected), set(actual) - set(expected)
    for name, grad in actual.items():
        assert grad.shape == expected[name].shape, (what, name)
        assert expected[name].norm() > 0, (what, name, "zero reference gradient")
        error = _relative_error(grad, expected[name])
        assert error <= RTOL, f"{what}: {name} gradient differs by {error:.2e} (relative)"


def _assert_same_loss(actual: float, expected: float, what: str) -> None:
    assert abs(actual - expected) <= RTOL * abs(expected), f"{what}: loss {actual} != {expected}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """runtime_worker's results on ranks 0 and 1."""
    return launch.spawn(runtime_worker, 2, out_dir=tmp_path_factory.mktemp("runtime"),
                        timeout=TIMEOUT)


def _part(result: dict, name: str) -> dict:
    if "error" in result[name]:
        pytest.fail(f"{name} raised in the worker:\n{result[name]['error']}")
    return result[name]


def test_reference_model_is_sane(runs):
    """The unsplit model itself: initial loss ~ ln(vocab) (init std 0.02 gives near-uniform
    logits), and causal: changing token j changes the losses at j and after, none before."""
    ref = runs[0]["reference"]
    assert abs(ref["loss"] - math.log(VOCAB)) < 0.05, ref["loss"]
    j = ref["probe_at"]
    assert torch.equal(ref["probe_losses"][:, :j], ref["token_losses"][:, :j])
    assert not torch.allclose(ref["probe_losses"][:, j], ref["token_losses"][:, j])


def test_tensor_parallel_matches_unsplit_model(runs):
    for rank, result in enumerate(runs):
        ref, tp = result["reference"], _part(result, "tp")["plain"]
        _assert_same_loss(tp["loss"], ref["loss"], f"TP=2 rank {rank}")
        assert set(tp["grads"]) == set(ref["grads"])
        _assert_same_grads(tp["grads"], ref["grads"], f"TP=2 rank {rank}")


def test_full_recomputation_under_tensor_parallel(runs):
    for rank, result in enumerate(runs):
        plain, recomputed = _part(result, "tp")["plain"], _part(result, "tp")["recompute"]
        assert plain["layer0_forwards"] == 1
        assert recomputed["layer0_forwards"] == 2, "the layer was not recomputed in backward"
        _assert_same_loss(recomputed["loss"], plain["loss"], f"recompute rank {rank}")
        _assert_same_grads(recomputed["grads"], plain["grads"], f"recompute vs plain, rank {rank}")
        _assert_same_grads(recomputed["grads"], result["reference"]["grads"],
                           f"recompute vs unsplit, rank {rank}")


def test_pipeline_parallel_1f1b_matches_unsplit_model(runs):
    first, last = _part(runs[0], "pp"), _part(runs[1], "pp")
    one_f_one_b = "forward_backward_pipelining_without_interleaving"
    assert first["schedule"] == last["schedule"] == one_f_one_b
    assert not first["last_stage"] and last["last_stage"]
    ref = runs[1]["reference"]
    assert len(last["microbatch_losses"]) == 4 and first["microbatch_losses"] == []
    _assert_same_loss(sum(last["microbatch_losses"]) / 4, ref["loss"], "PP=2")
    # between them, the two stages hold every parameter of the unsplit model
    assert set(first["grads"]) | set(last["grads"]) == set(ref["grads"])
    assert "embedding.word_embeddings.weight" in first["grads"]
    assert "embedding.word_embeddings.weight" in last["grads"]  # the tied output layer
    _assert_same_grads(first["grads"], ref["grads"], "PP=2 first stage")
    _assert_same_grads(last["grads"], ref["grads"], "PP=2 last stage")


def test_data_parallel_ddp_matches_whole_batch(runs):
    ref = runs[0]["reference"]
    results = [_part(r, "dp") for r in runs]
    _assert_same_loss(sum(r["loss"] for r in results) / 2, ref["loss"], "DP=2 mean loss")
    assert results[0]["loss"] != results[1]["loss"]  # the ranks really saw different halves
    for rank, result in enumerate(results):
        assert set(result["grads"]) == set(ref["grads"])
        _assert_same_grads(result["grads"], ref["grads"], f"DP=2 rank {rank}")


def test_cpu_adam_steps_fused_as_torch_would_per_parameter(runs):
    """On the CPU the optimizer steps with torch's fused AdamW kernel (torch's default there
    is per parameter, ~6x slower), and its update equals the per-parameter one."""
    for result in (_part(r, "dp") for r in runs):
        assert result["adam_fused"] and all(result["adam_fused"]), result["adam_fused"]
        assert result["adam_update_error"] <= 1e-6, result["adam_update_error"]


def test_ports_come_from_the_range_asked_for(monkeypatch):
    """MEGATRON_2BW_PORT_RANGE confines free_ports to its range (each pick distinct); a range
    with too few free ports, or a malformed one, says so in one line; unset, the OS picks."""
    import socket

    from megatron_2bw.runtime import ports

    monkeypatch.setenv(ports.RANGE_VARIABLE, "20100-20104")
    picked = ports.free_ports(3)
    assert len(set(picked)) == 3 and all(20100 <= p <= 20104 for p in picked), picked
    with socket.socket() as taken:  # one of the five held: four left, five asked for
        taken.bind(("127.0.0.1", picked[0]))
        with pytest.raises(RuntimeError, match="fewer than 5 free ports"):
            ports.free_ports(5)
    monkeypatch.setenv(ports.RANGE_VARIABLE, "20100")
    with pytest.raises(ValueError, match="expected LO-HI"):
        ports.free_port()
    monkeypatch.delenv(ports.RANGE_VARIABLE)
    assert ports.free_port() >= 1024
