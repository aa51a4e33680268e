"""End to end: ``torchrun pretrain_gpt_2bw.py`` on 2 CPU processes with a tiny GPT and data set.

References:
  * learning: the logged training loss of TP=2, PP=2 and DP=2 runs falls clearly below the
    first iteration's (which is ~ln(vocab) for a fresh model), and the validation loss printed
    at the end lies below that first loss too;
  * layouts: TP=2 and DP=2 runs of the same model log the same losses (to 1e-4);
  * precision: PP=2 2BW runs in bf16 (deferred step) and fp16 (dynamic loss scaling, step in
    place) log the losses of the same fp32 run to 1e-2 (bf16) and 1e-3 (fp16) at every
    iteration; both keep fp32 main weights, so only the low-precision forward/backward differs;
  * checkpoints: a run stopped at iteration K (--exit-interval K --save DIR) and resumed with
    --load DIR logs, for iterations K+1..N, the losses of an uninterrupted run to 1e-5 (fp32,
    dropout 0), once per schedule in RESUME_SCHEDULES.
Each torchrun launch costs ~10-15 s of start-up, so runs with identical flags are launched
once per session and shared between tests.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megatron_2bw.logparse import parse_log
from tests import dist as launch

TRAIN_ITERS = 24
STOP_AT = 12
# schedules whose checkpoint/resume is tested; add a schedule here once it trains end to end
RESUME_SCHEDULES = ("megatron", "2bw")
LAYOUTS = {  # name -> (tensor, pipeline); data-parallel = 2 / (tensor x pipeline)
    "TP=2": (2, 1),
    "PP=2": (1, 2),
    "DP=2": (1, 1),
}
RTOL = 1e-5



@dataclass
class Run:
    """A finished training run and what its log says."""

    launch: launch.Launch
    losses: dict[int, float]        # iteration -> logged training loss
    validation: dict[int, float]    # iteration -> validation loss

    def check_succeeded(self) -> None:
        assert self.launch.returncode == 0, (
            f"{' '.join(self.launch.command)} exited with {self.launch.returncode}:\n"
            f"{self.launch.tail(60)}")


def _parse(result: launch.Launch) -> Run:
    log = parse_log(result.output)
    losses = {record.iteration: record.loss for record in log.iterations}
    validation = {record.iteration: record.loss for record in log.valid()}
    return Run(result, losses, validation)


def model_flags(data, tp: int, pp: int, schedule: str = "megatron") -> list[str]:
    """A 2-layer GPT, hidden 32, sequence 32, 16 samples per batch in microbatches of 4."""
    return [*launch.tiny_training_flags(seq_length=32, train_iters=TRAIN_ITERS),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--pipeline-schedule", schedule, *data.flags()]


_RUNS: dict[tuple[str, ...], Run] = {}


def train(flags: list[str], nproc: int = 2) -> Run:
    """torchrun the GPT entry script; identical flags run once per session."""
    key = (str(nproc), *flags)
    if key not in _RUNS:
        _RUNS[key] = _parse(launch.torchrun(["pretrain_gpt_2bw.py", *flags], nproc, timeout=240))
    return _RUNS[key]


def _same(actual: dict[int, float], expected: dict[int, float], iterations,
          rtol: float = RTOL) -> None:
    for i in iterations:
        assert i in actual, f"iteration {i} not logged"
        assert abs(actual[i] - expected[i]) <= rtol * abs(expected[i]), (
            f"iteration {i}: loss {actual[i]!r}, expected {expected[i]!r}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_reduces_loss(tiny_gpt_data, layout):
    tp, pp = LAYOUTS[layout]
    run = train(model_flags(tiny_gpt_data, tp, pp))
    run.check_succeeded()
    assert f"TP={tp} PP={pp} DP={2 // (tp * pp)}" in run.launch.output
    assert sorted(run.losses) == list(range(1, TRAIN_ITERS + 1)), run.launch.tail()
    first = run.losses[1]
    # a fresh model predicts ~uniformly over the 512-piece vocabulary
    assert abs(first - math.log(tiny_gpt_data.vocab_size)) < 0.3, first
    last = sum(run.losses[i] for i in range(TRAIN_ITERS - 2, TRAIN_ITERS + 1)) / 3
    assert last < first - 0.8, f"{layout}: loss went from {first:.3f} to only {last:.3f}"
    assert list(run.validation) == [TRAIN_ITERS], run.launch.tail()
    assert math.isfinite(run.validation[TRAIN_ITERS])
    assert run.validation[TRAIN_ITERS] < first - 0.5, run.validation


def test_tensor_and_data_parallel_runs_agree(tiny_gpt_data):
    """TP=2 and DP=2 train the same model: the same seed on pipeline stage 0, and megatron's
    CPU initialization draws each full weight before splitting it over tensor-parallel ranks.
    The two layouts share no parallel code path (tensor-parallel all-reduces over 4
    microbatches of 4, against 2 microbatches per replica and a gradient all-reduce), so
    their loss curves must agree step by step."""
    runs = {name: train(model_flags(tiny_gpt_data, *LAYOUTS[name])) for name in ("TP=2", "DP=2")}
    for run in runs.values():
        run.check_succeeded()
    _same(runs["DP=2"].losses, runs["TP=2"].losses, range(1, TRAIN_ITERS + 1), rtol=1e-4)
    _same(runs["DP=2"].validation, runs["TP=2"].validation, [TRAIN_ITERS], rtol=1e-4)


@pytest.mark.parametrize("schedule", RESUME_SCHEDULES)
def test_resume_matches_uninterrupted_run(tiny_gpt_data, tmp_path, schedule):
    """PP=2: stop at STOP_AT with a checkpoint, resume to TRAIN_ITERS, compare every logged
    loss after the stop (and the final validation loss) with an uninterrupted run."""
    flags = model_flags(tiny_gpt_data, tp=1, pp=2, schedule=schedule)  # megatron's full run
    # is test_training_reduces_loss[PP=2]'s (one run per flag set)
    checkpoint = str(tmp_path / "checkpoint")

    full = train(flags)
    full.check_succeeded()
    stopped = train([*flags, "--save", checkpoint, "--exit-interval", str(STOP_AT)])
    stopped.check_succeeded()
    assert sorted(stopped.losses) == list(range(1, STOP_AT + 1)), stopped.launch.tail()
    _same(stopped.losses, full.losses, range(1, STOP_AT + 1))  # the same run up to the stop

    resumed = train([*flags, "--load", checkpoint])
    resumed.check_succeeded()
    assert f"resumed from {checkpoint} at iteration {STOP_AT}" in resumed.launch.output
    assert sorted(resumed.losses) == list(range(STOP_AT + 1, TRAIN_ITERS + 1)), \
        resumed.launch.tail()
    _same(resumed.losses, full.losses, range(STOP_AT + 1, TRAIN_ITERS + 1))
    _same(resumed.validation, full.validation, [TRAIN_ITERS])


def test_evaluations_and_a_resume_leave_the_dropout_masks_alone(tiny_gpt_data, tmp_path):
    """With dropout (0.1), DP=2, 6 iterations: a run that evaluates after iterations 2 and 4,
    stopped at 3 with a checkpoint and resumed, logs the training losses of a run that
    evaluates only at the end. Data iterators (the resumed run's, each evaluation's) draw
    their seed from the generator dropout reads; drawn from it, they shifted every later mask
    (the losses moved by ~1e-3)."""
    flags = [*model_flags(tiny_gpt_data, tp=1, pp=1), "--hidden-dropout", "0.1",
             "--attention-dropout", "0.1", "--train-iters", "6", "--eval-iters", "1"]
    checkpoint = str(tmp_path / "checkpoint")
    quiet = train([*flags, "--eval-interval", "6"])
    quiet.check_succeeded()
    evaluating = [*flags, "--eval-interval", "2"]
    stopped = train([*evaluating, "--save", checkpoint, "--exit-interval", "3"])
    stopped.check_succeeded()
    resumed = train([*evaluating, "--load", checkpoint])
    resumed.check_succeeded()
    assert list(stopped.validation) == [2] and list(resumed.validation) == [4, 6], \
        (stopped.validation, resumed.validation)
    _same(stopped.losses, quiet.losses, range(1, 4), rtol=1e-6)
    _same(resumed.losses, quiet.losses, range(4, 7), rtol=1e-6)


def _saved_tensors(root: Path, iteration: int, prefix: str) -> dict:
    """The tensors under ``prefix`` keys of a saved checkpoint, read offline."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from megatron_2bw.training.checkpointing import checkpoint_dir

    flat = root / f"flat{iteration}.pt"
    dcp_to_torch_save(checkpoint_dir(str(root), iteration), str(flat))
    state = torch.load(flat, weights_only=False)
    return {key: value for key, value in state.items() if key.startswith(prefix)}


def test_pipemare_discrepancy_correction_resumes_with_its_delta(tiny_gpt_data, tmp_path):
    """PipeMare with T2 (D = 0.9): delta, the running average of each stage's updates, goes
    into the checkpoint and comes back. Its effect on the losses is below their printed
    precision here (about lr^2), so the test reads delta itself: saved at the end of an
    uninterrupted run of 12 iterations and of a run stopped at 6 and resumed, the two are
    equal, while restarting delta at zero would leave 0.9^6 = 53% of the stop's delta
    missing. Stage 0's delta is non-zero, the last stage's (which corrects nothing) zero.
    In bf16, delta is kept and saved in fp32 (a bf16 delta would round its lr-sized steps
    away)."""
    iters, stop_at = 12, 6
    flags = [*model_flags(tiny_gpt_data, tp=1, pp=2, schedule="pipemare"), "--bf16",
             "--pipemare-discrepancy-decay", "0.9", "--train-iters", str(iters)]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    full = train([*flags, "--save", str(whole)])
    full.check_succeeded()
    train([*flags, "--save", str(parts), "--exit-interval", str(stop_at)]).check_succeeded()
    resumed = train([*flags, "--load", str(parts), "--save", str(parts)])
    resumed.check_succeeded()
    _same(resumed.losses, full.losses, range(stop_at + 1, iters + 1))

    expected = _saved_tensors(whole, iters, "pipemare_delta.")
    actual = _saved_tensors(parts, iters, "pipemare_delta.")
    assert expected and sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert tensor.dtype == torch.float32, (key, tensor.dtype)
        torch.testing.assert_close(actual[key], tensor, rtol=1e-5, atol=1e-9, msg=key)
    layers = expected["pipemare_delta.decoder.layers.mlp.linear_fc1.weight"]  # (L, f, h)
    assert layers[0].abs().max() > 0 and layers[1].abs().max() == 0  # stage 0, stage 1


PRECISIONS = {  # flags -> (relative tolerance against fp32, the 2BW step mode rank 0 reports)
    "bf16": (["--bf16"], 1e-2, "deferred"),
    "fp16": (["--fp16", "--initial-loss-scale", "4096"], 1e-3, "at the loop's optimizer.step()"),
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_half_precision_2bw_tracks_fp32(tiny_gpt_data, precision):
    extra, rtol, step_mode = PRECISIONS[precision]
    flags = model_flags(tiny_gpt_data, tp=1, pp=2, schedule="2bw")
    fp32 = train(flags)
    fp32.check_succeeded()
    half = train([*flags, *extra])
    half.check_succeeded()
    assert f"2bw optimizer step on stage 0: {step_mode}" in half.launch.output
    _same(half.losses, fp32.losses, range(1, TRAIN_ITERS + 1), rtol=rtol)
    _same(half.validation, fp32.validation, [TRAIN_ITERS], rtol=rtol)


# ---- the V schedules from a seed: flush's initial weights, flush's losses --------------------

V_ITERS = 4
V_LOSS_RTOL = 1e-5  # the log's 7 significant digits (5e-7) and the I/W split's summation order
V_FLAGS = ["--num-layers", "4", "--untie-embeddings-and-output-weights"]  # L % 2d, untied


def _v_flags(data, schedule: str) -> list[str]:
    """4 layers (a multiple of 2d = 4), untied, m = 4 (DualPipeV's 2d), V_ITERS iterations."""
    return [*model_flags(data, tp=1, pp=2, schedule=schedule), *V_FLAGS,
            "--train-iters", str(V_ITERS), "--eval-interval", str(V_ITERS)]


@pytest.mark.parametrize("schedule,precision", [("zb-v", []), ("dualpipev", []),
                                                ("zb-v", ["--bf16"])],
                         ids=["zb-v", "dualpipev", "zb-v-bf16"])
def test_v_schedules_from_a_seed_log_flush_losses(tiny_gpt_data, schedule, precision):
    """zb-v and dualpipev, d = 2, from --seed alone (no shared checkpoint), log flush's losses at
    every iteration and at the end's validation. Flush's rank r holds the V's stages 2r and
    2r+1 (the V puts stages 0 and 3 on rank 0, 1 and 2 on rank 1), so equal losses need
    the V chunks initialized as flush's ranks initialize them; from shared weights the schedules
    are exact (test_schedules_exact, case 2c). Built under each rank's own seed (before the
    V chunks were built as flush's), both V runs logged 6.254274 at iteration 1 against flush's
    6.234636 (3e-3 relative) and 6.107661 against 6.059353 at iteration 4; now the printed
    digits agree. In bf16 the casts follow the V (megatron-core's wrapper would cast rank
    d-1's second chunk, mid-V, to fp32: the first exchange then refused its dtype)."""
    flush = train([*_v_flags(tiny_gpt_data, "flush"), *precision])
    flush.check_succeeded()
    v = train([*_v_flags(tiny_gpt_data, schedule), *precision])
    v.check_succeeded()
    assert sorted(v.losses) == sorted(flush.losses) == list(range(1, V_ITERS + 1)), v.launch.tail()
    _same(v.losses, flush.losses, range(1, V_ITERS + 1), rtol=V_LOSS_RTOL)
    _same(v.validation, flush.validation, [V_ITERS], rtol=V_LOSS_RTOL)


V_WEIGHT_FLAGS = ["--cpu", "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
                  "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data",
                  "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1",
                  "--lr", "1e-3", "--seed", "1234", *V_FLAGS[2:]]


def _initial_weights_worker(rank: int, world_size: int, tp: int) -> dict:
    """This rank's initial weights under flush, then under zb-v (the seed set afresh, as a new
    run's start sets it), from pretrain_gpt_2bw's provider and build.build_model, with CPU
    initialization (full weights from torch's generator, then split) and with the GPU's
    (each TP shard drawn inside megatron-core's RNG tracker): for each,
    {(init, tp rank, global layer index or None, name without the layer prefix): tensor};
    and whether zb-v's build left the generator and the tracker as they were."""
    import re
    from functools import partial

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    import pretrain_gpt_2bw
    from megatron_2bw.arguments import parse_args
    from megatron_2bw.runtime import distributed
    from megatron_2bw.schedules import Placement
    from megatron_2bw.training import build

    def random_state() -> list:
        return [torch.get_rng_state(), *get_cuda_rng_tracker().get_states().values()]

    pp = world_size // tp
    distributed.initialize(tp, pp, seed=1234, force_cpu=True)
    stage, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    weights, state_kept = {"flush": {}, "zb-v": {}}, []
    for init, schedule in itertools.product(("cpu", "gpu"), weights):
        args = parse_args([*V_WEIGHT_FLAGS, "--tensor-model-parallel-size", str(tp),
                           "--pipeline-model-parallel-size", str(pp), "--pipeline-schedule",
                           schedule], world_size=world_size)
        distributed.set_seed(args.seed)
        before = random_state()
        config = build.transformer_config(args, "cpu", use_cpu_initialization=init == "cpu")
        chunks = build.build_model(args, config, partial(pretrain_gpt_2bw.model_provider,
                                                         args=args, vocab_size=512))
        if schedule == "zb-v":
            state_kept.append(all(map(torch.equal, before, random_state())))
        per_chunk = args.num_layers // (pp * len(chunks))
        for index, chunk in enumerate(chunks):
            first_layer = per_chunk * (stage if schedule == "flush" else
                                       Placement.v(pp).virtual(stage, index))
            for name, param in chunk.module.named_parameters():
                layer = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
                key = (first_layer + int(layer[1]), layer[2]) if layer else (None, name)
                weights[schedule][(init, tp_rank, *key)] = param.detach().clone()
    distributed.destroy()
    return {"weights": weights, "state_kept": state_kept}


def test_v_chunks_start_from_flush_weights(tmp_path):
    """The parameters zb-v builds (8 layers, TP = 2 x PP = 2: 4 chunks of 2 layers in a V,
    each tensor-parallel rank holding its shard) equal flush's, parameter by parameter under
    global layer numbers, with CPU and with GPU-style initialization: the embedding and
    position embedding (V stage 0, rank 0), the layers of V stages 1 and 2 (rank 1's, built
    under flush rank 0's and rank 1's seeding), the final norm and output layer (V stage 3,
    back on rank 0). Building them leaves each rank's random state as it was."""
    ranks = launch.spawn(_initial_weights_worker, 4, 2, out_dir=tmp_path, timeout=240)
    flush, v = ({k: t for rank in ranks for k, t in rank["weights"][schedule].items()}
                for schedule in ("flush", "zb-v"))
    assert sorted(v, key=str) == sorted(flush, key=str)
    assert {layer for _, _, layer, _ in flush} == {None, *range(8)}
    assert {name for _, _, layer, name in flush if layer is None} >= {
        "embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
        "decoder.final_layernorm.weight", "output_layer.weight"}
    qkv = "self_attention.linear_qkv.weight"  # GPU-style: another generator, other draws
    assert not torch.equal(flush[("cpu", 1, 0, qkv)], flush[("gpu", 1, 0, qkv)])
    differ = {key: float((v[key] - t).abs().max()) for key, t in flush.items()
              if not torch.equal(v[key], t)}
    assert not differ, f"{len(differ)} of {len(flush)} tensors differ: {list(differ.items())[:4]}"
    assert all(all(rank["state_kept"]) for rank in ranks), [r["state_kept"] for r in ranks]
