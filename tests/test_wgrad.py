"""zb-h1's split backward (megatron_2bw/schedules/wgrad.py) on a real megatron-core GPTModel
(4 layers, tied embeddings, PP=1, so the output layer reads the embedding's weight) under
megatron-core's DDP with --overlap-grad-reduce, in one gloo process.

Reference: megatron-core's own fused backward of the same microbatch on the same weights.
After I and W every ``main_grad`` equals the reference's bit for bit, DDP's hooks fire once
per parameter, nothing is copied twice (also with gradient-accumulation fusion), and the
bytes a pending W keeps equal the planner's formula. Guards: splitting the backward changes
neither the gradients nor the memory accounting.
Each check: docs/testing.md, "What each test module checks", test_wgrad.py.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from megatron_2bw.runtime.copies import CopiedBytes
from tests import dist as launch

MICRO_BATCH = 2
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
           "mlp.linear_fc2")
"""Each layer's megatron-core linear layers: their weights' GEMMs are deferred to W."""


def _stand_in_fused_kernel():
    """apex's fused_weight_gradient_mlp_cuda contract on the CPU: main_grad += dY^T X."""
    def accumulate(total_input, grad_output, main_grad):
        main_grad.add_(grad_output.t().matmul(total_input))

    return types.SimpleNamespace(wgrad_gemm_accum_fp32=accumulate,
                                 wgrad_gemm_accum_fp16=accumulate)


def _main_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.main_grad.clone() for name, p in model.named_parameters()}


def _split_against_fused(fusion: bool) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import layers

    from megatron_2bw.schedules.wgrad import WeightGradStore
    from tests.test_cpu_runtime import _batch, _config, _gpt, _token_losses

    torch.manual_seed(0)
    config = _config()
    model = _gpt(config)
    if fusion:
        layers.fused_weight_gradient_mlp_cuda = _stand_in_fused_kernel()
        for module in model.modules():
            if isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
                module.gradient_accumulation_fusion = True
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=2000), model)
    batch = _batch(MICRO_BATCH)

    loss = _token_losses(ddp, batch).mean()
    fused_copies = CopiedBytes()
    with fused_copies.counting():
        loss.backward()
    fused = _main_grads(model)
    ddp.finish_grad_sync()  # the first batch: records each parameter's hook count
    ddp.zero_grad_buffer()

    loss = _token_losses(ddp, batch).mean()
    store = WeightGradStore(model)
    input_copies = CopiedBytes()
    with input_copies.counting():
        pending = store.input_pass(loss, torch.ones_like(loss), None)
    pending_bytes = pending.nbytes()
    after_input = _main_grads(model)
    weight_copies = CopiedBytes()
    with weight_copies.counting():
        WeightGradStore.weight_pass(pending)
    after_weight = _main_grads(model)
    ddp.finish_grad_sync()  # asserts every bucket's reduction was launched by the hooks
    deferred = sorted(name for name, p in model.named_parameters() if id(p) in store.deferred)
    return {"fused": fused, "after_input": after_input, "after_weight": after_weight,
            "deferred": deferred,
            "copies": (fused_copies.bytes, input_copies.bytes + weight_copies.bytes),
            "pending_bytes": pending_bytes}


def _llama_pending_bytes() -> int:
    """Bytes one microbatch's pending W keeps on a Llama-style GPTModel: SwiGLU, 2 query
    groups for 4 heads, the output layer untied (its own deferred weight)."""
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_2bw.schedules.wgrad import WeightGradStore
    from tests.test_cpu_runtime import SEQ, VOCAB, _batch, _config, _token_losses

    torch.manual_seed(0)
    config = _config(gated_linear_unit=True, activation_func=F.silu, num_query_groups=2)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, share_embeddings_and_output_weights=False)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    loss = _token_losses(ddp, _batch(MICRO_BATCH)).mean()
    pending = WeightGradStore(model).input_pass(loss, torch.ones_like(loss), None)
    return pending.nbytes()


def wgrad_worker(rank: int, world_size: int) -> dict:
    from tests.test_cpu_runtime import _layout

    _layout(1, 1)
    runs = {fusion: _split_against_fused(fusion) for fusion in (False, True)}
    return runs | {"llama_pending_bytes": _llama_pending_bytes()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    (result,) = launch.spawn(wgrad_worker, 1, out_dir=tmp_path_factory.mktemp("wgrad"),
                             timeout=180)
    return result


@pytest.mark.parametrize("fusion", [False, True], ids=["unfused", "fused-accumulation"])
def test_input_then_weight_pass_equals_one_fused_backward(runs, fusion):
    run = runs[fusion]
    assert run["deferred"] == sorted(f"decoder.layers.{i}.{linear}.weight" for i in range(4)
                                     for linear in LINEARS)
    assert "embedding.word_embeddings.weight" not in run["deferred"]  # tied: its grad in I
    for name, reference in run["fused"].items():
        assert reference.abs().sum() > 0, name
        after_input = run["after_input"][name]
        if name in run["deferred"]:
            assert not after_input.any(), f"{name}: a deferred weight got a gradient in I"
        else:
            assert torch.equal(after_input, reference), f"{name}: I's gradient differs"
        assert torch.equal(run["after_weight"][name], reference), f"{name}: differs after W"
    fused_copies, split_copies = run["copies"]
    assert split_copies <= fused_copies, run["copies"]


def test_pending_weight_grad_bytes_match_the_planner(runs):
    """What the planner charges per pending W (its memory model for zb-h1, zb-v, dualpipev)
    against the store's bytes after I: per layer QKV, projection, FC1 and FC2 inputs and output
    gradients; the output layer's where it has its own weight (here untied; the tied one reads
    the embedding and takes its gradient in I)."""
    from megatron_2bw.planner import ModelSpec
    from tests.test_cpu_runtime import HEADS, HIDDEN, LAYERS, SEQ, VOCAB

    gpt = ModelSpec("gpt", num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                    seq_length=SEQ, vocab_size=VOCAB, ffn_hidden_size=2 * HIDDEN,
                    make_vocab_size_divisible_by=VOCAB)
    llama = dataclasses.replace(gpt, untie_embeddings=True, num_query_groups=2,
                                gated_linear_unit=True)
    fp32 = 4
    for model, measured in ((gpt, runs[False]["pending_bytes"]),
                            (llama, runs["llama_pending_bytes"])):
        layers = LAYERS * model.layer_weight_grad_bytes(MICRO_BATCH, 1, fp32)
        head = model.head_weight_grad_bytes(MICRO_BATCH, 1, fp32, with_embedding=True)
        assert layers + head == measured, (model, layers, head, measured)
    # By hand, per token (h = 32, f = 64), (input + output gradient) of QKV, projection, FC1,
    # FC2: GPT (h + 3h) + (h + h) + (h + f) + (f + h) = 12h floats; Llama (QKV (4 + 2 x 2)
    # heads of 8 = 2h, FC1 2f) (h + 2h) + (h + h) + (h + 2f) + (f + h) = 13h, and the output
    # layer h + V.
    tokens = SEQ * MICRO_BATCH
    assert runs[False]["pending_bytes"] == LAYERS * tokens * 12 * HIDDEN * fp32
    assert runs["llama_pending_bytes"] == (LAYERS * tokens * 13 * HIDDEN
                                           + tokens * (HIDDEN + VOCAB)) * fp32
