"""Single-process references for the schedule exactness tests (tests/test_schedules_exact.py).

One full-size GPT (GPT-2-style, or Llama-style with ``Model.llama``), trained by a plain PyTorch
loop with ``torch.optim.AdamW`` set up as megatron-core sets it up on the CPU, under each
schedule's update rule: synchronous W(t+1) = AdamW(W(t), g(W(t))), 2BW's
W(t+1) = AdamW(W(t), g(W(max(t-1, 0)))), PipeDream's and PipeMare's per-stage rules.

    python tests/reference.py SPEC.json     # writes SPEC["init"] and SPEC["out"]/<job>.pt

Invariants: the data (``microbatch``, ``stream_microbatch`` for a changing batch size) is a
pure function of (seed, batch, replica, microbatch) shared with tests/schedule_worker.py; a
tied output layer is kept apart from the embedding (PipeDream reads the two at different
versions), their gradients summed and counted once in the clipping norm.
The rules in full: docs/testing.md, "The exactness references".
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

__all__ = ["Model", "MODEL", "LLAMA_FLAGS", "microbatch", "stream_microbatch",
           "no_weight_decay", "initial_weights_of", "reference_run", "run_jobs"]


@dataclass(frozen=True)
class Model:
    """The tiny GPT and optimizer every exactness test uses (fp32, no dropout, constant LR)."""

    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    seq_length: int = 16
    vocab_size: int = 64
    micro_batch_size: int = 2
    init_method_std: float = 0.02
    lr: float = 1e-3
    lr_warmup_iters: int = 0
    """Megatron's linear warm-up from 0: step t uses lr * min(t, warm-up) / warm-up."""
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    seed: int = 1234
    data_seed: int = 4321
    llama: bool = False
    """Llama-style layers: SwiGLU (FFN 4h), RMSNorm, rotary position embeddings, grouped-query
    attention with 2 query groups, no biases (``LLAMA_FLAGS``); else GPT-2 style."""
    optimizer: str = "adam"
    """"muon": Muon for the hidden layers' 2-D weights (``muon_step``), AdamW for the rest."""
    muon_momentum: float = 0.9
    muon_nesterov: bool = False
    tensor_parallel: int = 1
    """Muon orthogonalizes each tensor-parallel rank's block of a weight on its own."""
    correction: str = "none"
    """2bw's stale-weight correction ("predict", "dc", "ef"; ``reference_run``)."""
    correction_coeff: float = 1.0
    moe: dict | None = None
    """Mixture of Experts: megatron-core TransformerConfig fields (``num_moe_experts``,
    ``moe_router_topk``, ...) set on the reference's config directly; the pipeline runs pass
    them as Megatron-LM's flags (tests/schedule_worker.py ``moe_flags``). The reference has
    every expert in one process; its decoder is megatron-core's per-layer block spec."""


MODEL = Model()
LLAMA_FLAGS = ("--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
               "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear")
"""Megatron-LM's flags of ``Model.llama`` (with --ffn-hidden-size 4h: --swiglu's default
differs); the reference sets megatron-core's fields directly (``_config``)."""


def microbatch(model: Model, batch: int, replica: int, j: int) -> dict:
    """Microbatch j of batch `batch` for data-parallel replica `replica`: random tokens, the
    next token as label, every token counted."""
    generator = torch.Generator().manual_seed(
        model.data_seed * 1_000_003 + batch * 10_007 + replica * 101 + j)
    b, s = model.micro_batch_size, model.seq_length
    text = torch.randint(0, model.vocab_size, (b, s + 1), generator=generator)
    return {"tokens": text[:, :-1].contiguous(), "labels": text[:, 1:].contiguous(),
            "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s).expand(b, s).contiguous()}


def stream_microbatch(model: Model, replica: int, index: int) -> dict:
    """The ``index``-th microbatch (from 0) of replica ``replica``'s data stream, for runs
    whose batch size changes: ``microbatch`` of "batch" ``index``, its microbatch 0."""
    return microbatch(model, index, replica, 0)


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """megatron-core's default grouping (``get_standard_config_overrides``): biases and 1-D
    parameters get wd_mult 0."""
    return name.endswith(".bias") or param.dim() == 1


def _config(model: Model):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    llama = dict(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
                 num_query_groups=2, add_bias_linear=False) if model.llama else {}
    return TransformerConfig(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        ffn_hidden_size=4 * model.hidden_size, num_attention_heads=model.num_attention_heads,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=model.init_method_std,
        params_dtype=torch.float32, use_cpu_initialization=True, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, **llama, **(model.moe or {}))


def _gpt(model: Model, tie: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_local_spec)

    normalization = "RMSNorm" if model.llama else "LayerNorm"
    config = _config(model)
    if model.moe:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core's router without TE
            moe_utils.te_general_gemm = None
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=normalization)
    else:
        spec = get_gpt_layer_local_spec(normalization=normalization)
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=model.vocab_size, max_sequence_length=model.seq_length,
                    pre_process=True, post_process=True,
                    share_embeddings_and_output_weights=tie,
                    position_embedding_type="rope" if model.llama else "learned_absolute")


def _loss(gpt, data: dict) -> torch.Tensor:
    per_token = gpt(data["tokens"], data["position_ids"], None, labels=data["labels"])  # (b, s)
    mask = data["loss_mask"].view(-1)
    return (per_token.float().view(-1) * mask).sum() / mask.sum()


def _gradients(gpt, params: dict, batch: int, replicas: int, microbatches: int,
               model: Model, data=None, weights_of=None,
               backward_weights=None, after_replica=None) -> tuple[dict, list[float]]:
    """Gradient of mean_{r,j} loss(r, j) at the current weights, accumulated one microbatch at a
    time; and each replica's mean microbatch loss. ``data(r, j)`` replaces
    ``microbatch(model, batch, r, j)``; ``weights_of(j)``, when given, loads the weights
    microbatch j reads before it runs; ``backward_weights(j)``, when given, points the
    parameters at other weights between microbatch j's forward and its backward (the saved
    activations stay the forward's). ``after_replica()``, when given, runs after each
    replica's microbatches."""
    data = data or (lambda r, j: microbatch(model, batch, r, j))
    for p in params.values():
        p.grad = None
    losses = []
    for r in range(replicas):
        total = 0.0
        for j in range(microbatches):
            if weights_of is not None:
                weights_of(j)
            loss = _loss(gpt, data(r, j))
            if backward_weights is not None:
                backward_weights(j)
            if model.moe:  # the aux losses' gradients are scaled as the main loss's
                from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

                MoEAuxLossAutoScaler.set_loss_scale(
                    torch.tensor([1.0 / (microbatches * replicas)]))
            (loss / (microbatches * replicas)).backward()
            total += float(loss.detach())
        losses.append(total / microbatches)
        if after_replica is not None:
            after_replica()
    # an expert no token reached (token dropping) has no gradient: zero, as in a gradient buffer
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for n, p in params.items()}, losses


@torch.no_grad()
def update_expert_bias(gpt, rate: float) -> None:
    """Aux-loss-free balancing (Wang et al. 2024, arXiv 2408.15664), once per batch: each
    router's expert bias moves by ``rate`` towards balance, +rate for an expert that got fewer
    than the mean of the batch's token counts, -rate for one that got more; the counts start
    over."""
    for module in gpt.modules():
        bias = getattr(module, "expert_bias", None)
        if bias is None:
            continue
        counts = module.local_tokens_per_expert
        bias += torch.sign(counts.sum() / counts.numel() - counts) * rate
        counts.zero_()


# ---- Muon (Jordan, 2024), written out for the references ---------------------------------------

def newton_schulz5(x: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Five quintic iterations X <- a X + (b A + c A^2) X, A = X X^T, from X = x / ||x||_F,
    along the smaller side (Jordan's coefficients a, b, c = 3.4445, -4.7750, 2.0315)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = x.shape[0] > x.shape[1]
    X = x.t() if tall else x
    X = X / max(float(X.norm()), 1e-7)
    for _ in range(steps):
        A = X @ X.t()
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.t() if tall else X


def _muon_blocks(name: str, shape: tuple, model: "Model") -> list[tuple[slice, slice]]:
    """The blocks of a 2-D weight that are orthogonalized apart: one per tensor-parallel rank
    (column-parallel QKV and FC1 split on rows, row-parallel projections on columns; position
    embeddings whole), and in the QKV weight of each rank, its query groups' Q, K and V rows
    apart."""
    rows, cols = shape
    tp = model.tensor_parallel
    column = name.endswith(("linear_qkv.weight", "linear_fc1.weight"))
    row = name.endswith(("linear_proj.weight", "linear_fc2.weight"))
    ranks = [(slice(r * rows // tp, (r + 1) * rows // tp), slice(None)) if column else
             (slice(None), slice(r * cols // tp, (r + 1) * cols // tp)) if row else
             (slice(None), slice(None)) for r in range(tp if column or row else 1)]
    if not name.endswith("linear_qkv.weight"):
        return ranks
    kv = model.hidden_size // model.num_attention_heads
    groups = 2 if model.llama else model.num_attention_heads
    q = model.num_attention_heads // groups * kv
    per_group, blocks = q + 2 * kv, []
    for rank_rows, _ in ranks:
        for start, size in ((0, q), (q, kv), (q + kv, kv)):  # Q, K, V of the rank's groups
            rows_of = [g * per_group + start + i
                       for g in range(rank_rows.start // per_group, rank_rows.stop // per_group)
                       for i in range(size)]
            blocks.append((torch.tensor(rows_of), slice(None)))
    return blocks


@torch.no_grad()
def muon_step(named: dict, grads: dict, state: dict, model: "Model", lr: float) -> None:
    """One Muon step of megatron-core's TensorParallelMuon (blockwise): decoupled weight decay,
    an exponential moving average of the gradient (Nesterov: (1 - mu) g + mu M), each block
    orthogonalized and scaled by sqrt(max(rows, cols)) (the "spectral" scale)."""
    mu = model.muon_momentum
    for name, p in named.items():
        g = grads[name]
        m = state.setdefault(name, torch.zeros_like(g))
        p.mul_(1.0 - lr * model.weight_decay)
        m.mul_(mu).add_(g, alpha=1.0 - mu)
        u = (1.0 - mu) * g + mu * m if model.muon_nesterov else m.clone()
        update = torch.zeros_like(u)
        for rows, cols in _muon_blocks(name, tuple(p.shape), model):
            block = u[rows][:, cols] if isinstance(rows, torch.Tensor) else u[rows, cols]
            o = newton_schulz5(block) * max(block.shape) ** 0.5
            if isinstance(rows, torch.Tensor):
                update[rows] = o
            else:
                update[rows, cols] = o
        p.sub_(update, alpha=lr)


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """megatron-core's Muon split: 2-D weights but the word embeddings and the output layer
    (the parameters it flags ``is_embedding_or_output_parameter``; learned position
    embeddings are not flagged, so Muon steps them)."""
    return param.dim() == 2 and name not in ("embedding.word_embeddings.weight",
                                             "output_layer.weight")


def clip_grads(grads: dict, max_norm: float) -> float:
    """megatron-core's clip_grad_norm_fp32: total norm in Python floats, scale when above."""
    total = math.sqrt(sum(float(torch.norm(g)) ** 2 for g in grads.values()))
    coeff = max_norm / (total + 1.0e-6)
    if max_norm > 0 and coeff < 1.0:
        for g in grads.values():
            g.mul_(coeff)
    return total


def _stage_of(name: str, depth: int, num_layers: int | list[int]) -> int:
    """The pipeline stage of a PP=1 GPTModel parameter (see the module docstring); with
    ``num_layers`` a list, stage i holds num_layers[i] layers (an uneven split)."""
    if name.startswith("embedding."):
        return 0
    if name.startswith("decoder.layers."):
        layer = int(name.split(".")[2])
        if isinstance(num_layers, int):
            return layer // (num_layers // depth)
        return next(i for i in range(depth) if layer < sum(num_layers[:i + 1]))
    return depth - 1  # decoder.final_layernorm, output_layer


def _pipedream_reads(name: str, depth: int, m: int, num_layers: int | list[int], t: int, j: int,
                     sync_iters: int = 0) -> int:
    """The version microbatch j of batch t reads of parameter `name` under PipeDream (and in
    PipeMare's forward): t during the `sync_iters` synchronous iterations."""
    warmup = depth - _stage_of(name, depth, num_layers) - 1
    return max((t * m + j - warmup) // m, 0) if t >= sync_iters else t


def _pipemare_gamma(name: str, depth: int, m: int, num_layers: int | list[int],
                    decay: float) -> float | None:
    """T2's gamma = D ** (1 / s) of the stage holding `name`, s its largest tau_fwd - tau_bkwd:
    1 where the stage has look-ahead forwards (they read t-1, their backward t), else no
    correction (None)."""
    span = 1 if min(depth - _stage_of(name, depth, num_layers) - 1, m) > 0 else 0
    return decay ** (1.0 / span) if span else None


def reference_run(init: dict, *, rule: str, replicas: int, microbatches: int | list[int],
                  iterations: int, tie: bool, model: Model = MODEL,
                  lrs: list[float] | None = None, depth: int = 1,
                  discrepancy_decay: float | None = None, sync_iters: int = 0,
                  lr_warmup_steps: int = 0, split: list[int] | None = None) -> dict:
    """Train the full model from `init` with `rule` ("sync", "2bw", or "pipedream" or
    "pipemare" over `depth` stages); returns the final weights (names as in a PP=1 GPTModel),
    per-iteration losses [t][replica] and grad norms. `microbatches` as a list: batch t has
    microbatches[t] per replica, read from the streams (``stream_microbatch``). `lrs`: step t's
    learning rate (instead of `model`'s warm-up). `split`: the layers of each of the `depth`
    stages where a per-stage rule's pipeline splits them unevenly.

    "pipemare" options: `sync_iters` N, batches t < N read W(t) in forward and backward;
    `discrepancy_decay` D, a backward whose forward read W(t-1) on its stage reads
    W(t) - (t - forward's version) * delta instead of W(t), with, per parameter,
    delta(t+1) = gamma * delta(t) + (1 - gamma) * (W(t+1) - W(t)), delta(0) = 0,
    gamma = D ** (1 / s) and s = 1 on stages with look-ahead forwards (none elsewhere);
    `lr_warmup_steps` K (T1), step t of stage i uses lr_t / tau_i ** (1 - min(t/K, 1)) with
    tau_i = max(ceil((d-i-1)/m), 1), the oldest version a forward of the stage reads in steady
    state (t - floor((t m - w_i)/m))."""
    init = initial_weights_of(init, model)
    sizes = microbatches if isinstance(microbatches, list) else None
    if sizes is not None and len(sizes) != iterations:
        raise ValueError(f"{len(sizes)} batch sizes for {iterations} iterations")
    if lrs is not None and len(lrs) != iterations:
        raise ValueError(f"{len(lrs)} learning rates for {iterations} iterations")
    per_stage = rule in ("pipedream", "pipemare")
    split_tie = tie and per_stage  # the two copies are read at different versions
    gpt = _gpt(model, tie and not split_tie)
    params = dict(gpt.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(init["embedding.word_embeddings.weight" if split_tie and
                         name == "output_layer.weight" else name])
    stages = range(depth) if per_stage else [None]
    layers = list(split) if split else model.num_layers  # per stage where split unevenly
    stage_of = (lambda n: _stage_of(n, depth, layers)) if per_stage else \
        (lambda n: None)
    muon = {n: p for n, p in params.items() if model.optimizer == "muon" and uses_muon(n, p)}
    adam = {n: p for n, p in params.items() if n not in muon}
    groups = [group for stage in stages for group in (
        {"params": [p for n, p in adam.items()
                    if not no_weight_decay(n, p) and stage_of(n) == stage],
         "weight_decay": model.weight_decay, "stage": stage},
        {"params": [p for n, p in adam.items()
                    if no_weight_decay(n, p) and stage_of(n) == stage],
         "weight_decay": 0.0, "stage": stage}) if group["params"]]
    muon_state: dict = {}
    last_update = None  # ef: U_{t-1}
    optimizer = torch.optim.AdamW(groups, lr=model.lr, betas=(model.adam_beta1, model.adam_beta2),
                                  eps=model.adam_eps)
    snapshot = lambda: {n: p.detach().clone() for n, p in params.items()}  # noqa: E731
    previous = snapshot()  # W(t-1), with W(-1) = W(0)
    history = []  # W(0), W(1), ...: the versions PipeDream's stages read
    gammas = {n: _pipemare_gamma(n, depth, microbatches, layers, discrepancy_decay)
              for n in params} if rule == "pipemare" and discrepancy_decay else {}
    delta = {n: torch.zeros_like(p) for n, p in params.items() if gammas.get(n) is not None}
    losses, norms, aux = [], [], []
    for t in range(iterations):
        current = snapshot()  # W(t)
        history.append(current)
        read = current if rule == "sync" else _read_version(history, max(t - 1, 0), model)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(read[n])

        @torch.no_grad()
        def pipedream_weights(j: int, t=t) -> None:
            for n, p in params.items():
                version = _pipedream_reads(n, depth, microbatches, layers, t, j,
                                           sync_iters)
                p.copy_(history[version][n])

        def newest_weights(j: int, t=t, current=current) -> None:
            """PipeMare's backward: every stage at W(t), corrected by T2 where the forward
            read W(t-1); ``.data`` is re-pointed, not copied into, as autograd holds the
            parameters the forward saved."""
            for n, p in params.items():
                lag = t - _pipedream_reads(n, depth, microbatches, layers, t, j,
                                           sync_iters)
                p.data = current[n] - lag * delta[n] if n in delta else current[n].clone()

        if per_stage:
            grads, batch_losses = _gradients(
                gpt, params, t, replicas, microbatches, model, weights_of=pipedream_weights,
                backward_weights=newest_weights if rule == "pipemare" else None)
        elif sizes is None:
            replica_aux: list = []  # a MoE model's aux losses, per replica
            if model.moe:
                _clear_aux_losses()
            grads, batch_losses = _gradients(
                gpt, params, t, replicas, microbatches, model,
                after_replica=(lambda: replica_aux.append(_aux_losses(model, microbatches)))
                if model.moe else None)
            if model.moe:
                aux.append(replica_aux)
            if (model.moe or {}).get("moe_router_enable_expert_bias"):
                update_expert_bias(gpt, model.moe.get("moe_router_bias_update_rate", 1e-3))
        else:
            first = sum(sizes[:t])  # batch t's first microbatch in each replica's stream
            grads, batch_losses = _gradients(
                gpt, params, t, replicas, sizes[t], model,
                data=lambda r, j: stream_microbatch(model, r, first + j))
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(current[n])
        if split_tie:  # Megatron's embedding all-reduce; the norm counts the sum once
            summed = grads["embedding.word_embeddings.weight"] + grads.pop("output_layer.weight")
            grads["embedding.word_embeddings.weight"] = summed
        norms.append(clip_grads(grads, model.clip_grad))
        if split_tie:
            grads["output_layer.weight"] = summed.clone()
        if model.correction == "dc":  # DC-ASGD: g + lambda g^2 (W(t) - W(t-1))
            for n in grads:
                grads[n] += model.correction_coeff * grads[n] ** 2 * (current[n] - previous[n])
        for n, p in params.items():
            p.grad = grads[n]
        warmup = model.lr_warmup_iters
        lr = model.lr * min(t, warmup) / warmup if warmup else model.lr
        lr = lrs[t] if lrs is not None else lr
        for group in optimizer.param_groups:
            group["lr"] = lr
            if rule == "pipemare" and lr_warmup_steps:  # T1
                tau = max(-(-(depth - group["stage"] - 1) // microbatches), 1)
                group["lr"] /= tau ** (1.0 - min(t / lr_warmup_steps, 1.0))
        optimizer.step()
        muon_step(muon, {n: grads[n] for n in muon}, muon_state, model, lr)
        if model.correction == "ef":  # W(t+1) = W(t) - U_t - beta (U_t - U_{t-1}), t >= 1
            with torch.no_grad():
                update = {n: current[n] - p for n, p in params.items()}
                for n, p in params.items():
                    if last_update is not None:
                        p.sub_(update[n] - last_update[n], alpha=model.correction_coeff)
            last_update = update
        with torch.no_grad():
            for n, d in delta.items():
                d.copy_(gammas[n] * d + (1 - gammas[n]) * (params[n] - current[n]))
        losses.append(batch_losses)
        previous = current
    weights = snapshot()
    if split_tie:
        copy = weights.pop("output_layer.weight")
        assert torch.equal(copy, weights["embedding.word_embeddings.weight"]), "tied copies apart"
    return {"weights": weights, "losses": losses, "grad_norms": norms, "aux_losses": aux}


def _clear_aux_losses() -> None:
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def _aux_losses(model: Model, microbatches: int) -> dict[str, float]:
    """One replica's aux losses of the batch: per name the model tracks, the mean over the
    replica's microbatches of each MoE layer's loss (over its coefficient), summed over the
    layers and divided by their number; read from megatron-core's tracker (each router adds
    its forward's), which is then cleared."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    freq = model.moe.get("moe_layer_freq", 1)
    layers = sum(freq) if isinstance(freq, list) else len(range(0, model.num_layers, freq))
    kinds = model.moe.get("moe_router_load_balancing_type", "aux_loss")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    names = [name for kind, name in (("aux_loss", "load_balancing_loss"),
                                     ("seq_aux_loss", "seq_load_balancing_loss")) if kind in kinds]
    names += ["z_loss"] if model.moe.get("moe_z_loss_coeff") is not None else []
    tracker = get_moe_layer_wise_logging_tracker()
    values = {name: float(tracker[name]["values"].sum()) / microbatches / layers
              for name in names}
    _clear_aux_losses()
    return values


def _read_version(history: list[dict], version: int, model: Model) -> dict:
    """What 2BW's microbatches read as ``version``: W(v), or under the "predict" correction
    R(v) = W(v) + s (W(v) - W(v-1)), R(0) = W(0)."""
    if model.correction != "predict" or version == 0:
        return history[version]
    s = model.correction_coeff
    return {n: w + s * (w - history[version - 1][n]) for n, w in history[version].items()}


def _initial_weights(model: Model) -> dict:
    """The untied model's initial weights (the tied model uses all but output_layer.weight)."""
    from megatron_2bw.runtime import distributed

    distributed.set_seed(model.seed)
    gpt = _gpt(model, tie=False)
    if model.moe:  # each expert from its own generator, as megatron-2bw draws them on the CPU
        from megatron_2bw.training.moe import init_experts_by_global_index

        init_experts_by_global_index(gpt, gpt.config, model.seed)
    return {n: p.detach().clone() for n, p in gpt.named_parameters()}


LLAMA_PREFIX = "llama:"
"""Where the initial weights file keeps the Llama-style model's weights (``initial_weights_of``)."""


def init_prefix(model: Model) -> str:
    """Where the initial weights file keeps `model`'s style: "" for the GPT-2-style model,
    LLAMA_PREFIX for the Llama-style one, and a prefix naming the MoE fields for a MoE model
    (its parameters depend on them)."""
    if not model.moe:
        return LLAMA_PREFIX if model.llama else ""
    fields = json.dumps(model.moe, sort_keys=True, separators=(",", ":"))
    return f"moe{fields}{'-llama' if model.llama else ''}:"


def initial_weights_of(init: dict, model: Model) -> dict:
    """The initial weights of `model`'s style from a file ``run_jobs`` wrote: the GPT-2-style
    model's under their names, the others' under their ``init_prefix`` + name."""
    prefix = init_prefix(model)
    if not prefix:
        return {n: t for n, t in init.items() if ":" not in n}
    return {n.removeprefix(prefix): t for n, t in init.items() if n.startswith(prefix)}


def run_jobs(init_path: str, out: str, jobs: dict) -> None:
    """In a process whose torch.distributed environment (world size 1) is set: write the initial
    weights to `init_path` and each job's result to `out`/<job>.pt. A job is {rule, replicas,
    microbatches, iterations, tie[, model: {Model field: value}]}. The initial weights are
    those of the deepest job's model; a shallower one takes its first layers (and the rest).
    Where a job is Llama-style, the file also holds that model's (``initial_weights_of``)."""
    from megatron_2bw.runtime import distributed

    distributed.initialize(1, 1, MODEL.seed, force_cpu=True)
    layers = max([MODEL.num_layers] + [job.get("model", {}).get("num_layers", 0)
                                       for job in jobs.values()])
    init = _initial_weights(replace(MODEL, num_layers=layers))
    if any(job.get("model", {}).get("llama") for job in jobs.values()):
        llama = _initial_weights(replace(MODEL, num_layers=layers, llama=True))
        init.update({LLAMA_PREFIX + n: t for n, t in llama.items()})
    styles: dict = {}  # MoE models: prefix -> the deepest job's model of that style
    for job in jobs.values():
        fields = job.get("model", {})
        if fields.get("moe"):
            model = replace(MODEL, moe=fields["moe"], llama=fields.get("llama", False),
                            num_layers=fields.get("num_layers", MODEL.num_layers))
            known = styles.get(init_prefix(model))
            if known is None or known.num_layers < model.num_layers:
                styles[init_prefix(model)] = model
    for prefix, model in styles.items():
        init.update({prefix + n: t for n, t in _initial_weights(model).items()})
    torch.save(init, init_path + ".partial")
    Path(init_path + ".partial").rename(init_path)  # whole, for a reader that waits for it
    for name, job in jobs.items():
        job = dict(job)
        model = replace(MODEL, **job.pop("model", {}))
        torch.save(reference_run(init, model=model, **job), Path(out) / f"{name}.pt")
    distributed.destroy()


def main(spec_path: str) -> None:
    """``python tests/reference.py SPEC.json``: the spec's "reference" jobs on their own."""
    import os

    spec = json.loads(Path(spec_path).read_text())
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(spec.get("port", 29500)))
    run_jobs(spec["init"], spec["out"], spec["reference"])


if __name__ == "__main__":
    main(sys.argv[1])
