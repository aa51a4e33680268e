"""Both sides of the BERT exactness tests (tests/test_bert.py): a single-process reference and
the pipeline runs, forked from one launcher as in tests/schedule_worker.py (the groups beside
the reference jobs once the initial weights are written).

    python tests/bert_worker.py SPEC.json

The model is tests.reference.MODEL's size as a BertModel with tied embeddings; the reference
trains it by torch.optim.AdamW as megatron-core sets it up, under the sync or the 2bw rule, on
masked-LM + sentence-order loss; each pipeline process builds its stage with
pretrain_bert_2bw's parser, model provider and forward_step and trains like the loop.

Invariant: both sides read the same microbatches (``microbatch(batch, replica, j)`` over
megatron_2bw.data.bert.MockBERTDataset) and write results under PP=1 names.
The spec and the rules: docs/testing.md, "The pipeline workers".
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `tests` and `pretrain_bert_2bw` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from tests.reference import MODEL, clip_grads, no_weight_decay
from tests.schedule_worker import (_wait, fork_all, fork_beside, train_iterations,
                                   training_flags)

BERT = replace(MODEL, adam_eps=1e-6)
SAMPLES_PER_DATASET = 1 << 30


def microbatch(batch: int, replica: int, j: int, binary_head: bool) -> dict:
    """Microbatch j of batch `batch` for data-parallel replica `replica` (a pure function)."""
    from megatron_2bw.data.bert import MockBERTDataset

    dataset = MockBERTDataset(SAMPLES_PER_DATASET, BERT.seq_length, BERT.vocab_size,
                              BERT.data_seed, binary_head)
    first = (batch * 10_007 + replica * 101 + j) * BERT.micro_batch_size
    samples = [dataset[first + i] for i in range(BERT.micro_batch_size)]
    return torch.utils.data.default_collate(samples)


# ---- the reference ----------------------------------------------------------------------------

def _config():
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=BERT.num_layers, hidden_size=BERT.hidden_size,
        ffn_hidden_size=4 * BERT.hidden_size, num_attention_heads=BERT.num_attention_heads,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=BERT.init_method_std,
        params_dtype=torch.float32, use_cpu_initialization=True, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False)


def _bert(binary_head: bool):
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel

    return BertModel(config=_config(), num_tokentypes=2 if binary_head else 0,
                     transformer_layer_spec=bert_layer_local_spec, vocab_size=BERT.vocab_size,
                     max_sequence_length=BERT.seq_length, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=True, add_binary_head=binary_head)


def _losses(bert, data: dict, binary_head: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(masked-LM loss, sentence-order loss or None) of one microbatch."""
    types = data["types"] if binary_head else None
    per_token, sop_logits = bert(data["text"], data["padding_mask"], tokentype_ids=types,
                                 lm_labels=data["labels"])  # (b, s), (b, 2)
    mask = data["loss_mask"].float()
    lm = (per_token.float() * mask).sum() / mask.sum()
    sop = None if sop_logits is None else F.cross_entropy(sop_logits.float(), data["is_random"])
    return lm, sop


def reference_run(init: dict, *, rule: str, microbatches: int, iterations: int,
                  binary_head: bool, replicas: int = 1) -> dict:
    """Train the PP=1 model from `init` with `rule` ("sync" or "2bw"); returns the final
    weights and, per iteration and replica, the mean masked-LM and sentence-order losses."""
    bert = _bert(binary_head)
    params = dict(bert.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(init[name])
    groups = [{"params": [p for n, p in params.items() if not no_weight_decay(n, p)],
               "weight_decay": BERT.weight_decay},
              {"params": [p for n, p in params.items() if no_weight_decay(n, p)],
               "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=BERT.lr, betas=(BERT.adam_beta1, BERT.adam_beta2),
                                  eps=BERT.adam_eps)
    snapshot = lambda: {n: p.detach().clone() for n, p in params.items()}  # noqa: E731
    previous, lm_losses, sop_losses = snapshot(), [], []
    for t in range(iterations):
        current = snapshot()
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(current[n] if rule == "sync" else previous[n])
        for p in params.values():
            p.grad = None
        lm_seen, sop_seen = [], []
        for r in range(replicas):
            lm_sum = sop_sum = 0.0
            for j in range(microbatches):
                lm, sop = _losses(bert, microbatch(t, r, j, binary_head), binary_head)
                loss = lm if sop is None else lm + sop
                (loss / (microbatches * replicas)).backward()
                lm_sum += float(lm)
                sop_sum += 0.0 if sop is None else float(sop)
            lm_seen.append(lm_sum / microbatches)
            sop_seen.append(sop_sum / microbatches)
        grads = {n: p.grad.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(current[n])
        clip_grads(grads, BERT.clip_grad)
        for n, p in params.items():
            p.grad = grads[n]
        optimizer.step()
        previous = current
        lm_losses.append(lm_seen)
        sop_losses.append(sop_seen)
    return {"weights": snapshot(), "lm_losses": lm_losses, "sop_losses": sop_losses}


def run_reference_jobs(init_path: str, out: str, jobs: dict) -> None:
    from megatron_2bw.runtime import distributed

    distributed.initialize(1, 1, BERT.seed, force_cpu=True)
    distributed.set_seed(BERT.seed)
    init = {n: p.detach().clone() for n, p in _bert(binary_head=True).named_parameters()}
    torch.save(init, init_path + ".partial")
    Path(init_path + ".partial").rename(init_path)  # whole, for the launcher that waits for it
    for name, job in jobs.items():
        torch.save(reference_run(init, **job), Path(out) / f"{name}.pt")
    distributed.destroy()


# ---- the pipeline -----------------------------------------------------------------------------

def _flags(run: dict, world_size: int) -> list[str]:
    flags = training_flags({"tp": 1, **run}, BERT, world_size)
    return flags if run["binary_head"] else flags + ["--bert-no-binary-head"]


def _global_name(name: str, stage: int, depth: int) -> str:
    """A stage's parameter name as it is in the PP=1 model (layers numbered from 0 per stage)."""
    parts = name.removeprefix("module.").split(".")
    if parts[:2] == ["encoder", "layers"]:
        parts[2] = str(int(parts[2]) + stage * BERT.num_layers // depth)
    return ".".join(parts)


def _data(m: int, binary_head: bool):
    """This rank's microbatches of every batch in order (2BW reads ahead into the next batch)."""
    from megatron.core import parallel_state as ps

    replica, k = ps.get_data_parallel_rank(), 0
    while True:
        yield microbatch(k // m, replica, k % m, binary_head)
        k += 1


def _run(run: dict, init_path: str, out: Path, timeout_minutes: float) -> None:
    import megatron_2bw
    from megatron.core import parallel_state as ps
    from megatron.core import pipeline_parallel

    import pretrain_bert_2bw
    from megatron_2bw.arguments import parse_args
    from megatron_2bw.runtime import distributed
    from megatron_2bw.schedules import executor
    from megatron_2bw.training import build

    world = int(os.environ["WORLD_SIZE"])
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    info = distributed.initialize(1, run["pp"], BERT.seed, force_cpu=True,
                                  timeout_minutes=timeout_minutes)
    args = parse_args(_flags(run, world), world_size=world, parser=pretrain_bert_2bw.parser())
    config = build.transformer_config(args, info.device)
    provider = partial(pretrain_bert_2bw.model_provider, args=args, vocab_size=BERT.vocab_size)
    model = build.build_model(args, config, provider)
    init = torch.load(init_path)
    with torch.no_grad():
        for name, p in model[0].module.named_parameters():
            key = _global_name(name, info.pp_rank, run["pp"])
            if key == "output_layer.weight":  # the last stage's copy of the word embeddings
                key = "embedding.word_embeddings.weight"
            p.copy_(init[key])
    optimizer = build.build_optimizer(args, model)
    scheduler = build.build_scheduler(args, optimizer)
    build.attach_config_hooks(config, model, optimizer)
    executor.reset_runners()
    megatron_2bw.install(run["schedule"])
    fb = pipeline_parallel.get_forward_backward_func()

    started = time.perf_counter()
    losses = train_iterations(run["name"], args, fb, pretrain_bert_2bw.forward_step,
                              _data(args.num_microbatches, run["binary_head"]), model, optimizer,
                              scheduler)
    seconds = time.perf_counter() - started
    if run["schedule"] == "2bw" and run["pp"] > 1:
        assert fb.step_mode == "deferred", f"{run['name']}: optimizer step {fb.step_mode}"

    params = {}
    for name, p in model[0].module.named_parameters():
        key = _global_name(name, info.pp_rank, run["pp"])
        if key == "output_layer.weight":
            key = "tied:output_layer.weight"
        params[key] = p.detach().clone()
    (out / run["name"]).mkdir(parents=True, exist_ok=True)
    torch.save({"pp": info.pp_rank, "dp": info.dp_rank, "params": params, "losses": losses,
                "seconds": seconds}, out / run["name"] / f"rank{info.rank}.pt")
    print(f"rank {info.rank}: {run['name']} finished {args.train_iters} iterations in "
          f"{seconds:.1f} s", flush=True)


def run_group(spec: dict, group: str) -> None:
    from megatron_2bw.runtime import distributed

    for run in spec["groups"][group]["runs"]:
        _run(run, spec["init"], Path(spec["out"]), spec.get("timeout_minutes", 2.0))
    distributed.destroy()


# ---- the launcher -----------------------------------------------------------------------------

def launch(spec_path: str) -> None:
    from megatron.core import jit

    jit.disable_jit_fuser()  # before any model module is imported (as the CPU runtime does)
    import megatron.core.distributed  # noqa: F401  (imported once here, shared by every fork)
    import megatron.core.models.bert.bert_model  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401

    import megatron_2bw.schedules.executor  # noqa: F401
    import megatron_2bw.training.build  # noqa: F401
    import pretrain_bert_2bw  # noqa: F401

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    referencing = fork_beside(out / "reference", spec["init"], 300, run_reference_jobs,
                              spec["init"], spec["out"], spec["reference"])
    summary = {}
    if Path(spec["init"]).exists():  # the groups run beside the rest of the reference jobs
        for name, group in spec["groups"].items():
            summary[name] = fork_all(group["world"], out / name, group.get("timeout_s", 120),
                                      run_group, spec, name)
            print(f"{name}:", summary[name], flush=True)
    summary = {"reference": _wait(*referencing, 300), **summary}
    print("reference:", summary["reference"], flush=True)
    (out / "launch.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    launch(sys.argv[1])
