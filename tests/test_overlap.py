"""Overlapped data-parallel communication (Megatron-LM's --overlap-grad-reduce,
--overlap-param-gather with --use-distributed-optimizer) under our schedules, on 2 CPU
processes.

References: the plain run (no distributed optimizer, no overlap), whose losses the
overlapped flush run must log to 1e-6, and 2bw without --overlap-grad-reduce, whose weights
and losses 2bw with it must end with. Inside spawned processes it checks when bucket
reductions launch and that the parameter all-gather is completed before evaluation and
checkpoints; bad flags end in one FlagError line. Guards: overlap changes timing, never values.
The steps in detail: docs/testing.md, "What each test module checks", test_overlap.py.
"""

from __future__ import annotations

import hashlib

import pytest

from megatron_2bw.arguments import FlagError, parse_args
from megatron_2bw.logparse import parse_log
from tests import dist as launch

TINY = ["--cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "4",
        "--global-batch-size", "16", "--mock-data", "--log-interval", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--lr", "5e-3", "--lr-warmup-iters", "1", "--train-iters", "4",
        "--distributed-timeout-minutes", "1"]
OVERLAP = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
           "--ddp-bucket-size", "2000"]
RTOL = 1e-6


def _losses(flags: list[str], nproc: int = 2) -> tuple[dict, dict, str]:
    """torchrun on ``nproc`` processes; (training losses, validation losses, output) by
    iteration."""
    result = launch.torchrun(["pretrain_gpt_2bw.py", *TINY, *flags], nproc, timeout=180)
    assert result.returncode == 0, result.tail(60)
    log = parse_log(result.output)
    return ({r.iteration: r.loss for r in log.iterations},
            {r.iteration: r.loss for r in log.valid()}, result.output)


def _same(actual: dict, expected: dict, iterations) -> None:
    assert sorted(actual) == sorted(expected) == list(iterations), (actual, expected)
    for i in iterations:
        assert abs(actual[i] - expected[i]) <= RTOL * abs(expected[i]), \
            f"iteration {i}: {actual[i]!r}, expected {expected[i]!r}"


def test_flush_distributed_optimizer_with_overlaps_matches_plain_run(tmp_path):
    paused = ["--eval-interval", "2", "--eval-iters", "1", "--save", str(tmp_path / "ckpt"),
              "--save-interval", "2", "--pipeline-schedule", "flush"]
    plain, plain_valid, _ = _losses(paused[:4] + paused[-2:])
    overlapped, overlapped_valid, output = _losses(
        paused + OVERLAP + ["--check-weight-hash-across-dp-replicas-interval", "2"])
    _same(overlapped, plain, range(1, 5))
    _same(overlapped_valid, plain_valid, [2, 4])
    for iteration in (2, 4):
        assert (f"weight hashes match across data-parallel replicas after iteration "
                f"{iteration}") in output
    assert (tmp_path / "ckpt" / "iter_0000004").is_dir()


def test_flush_pp2_dp2_overlaps_match_plain_run():
    """PP=2 x DP=2: stage 1 reduces its buckets through config.grad_sync_func after its last
    backward (Megatron's 1F1B order), stage 0 from that backward's hooks; the losses are the
    plain run's to 1e-6."""
    pipeline = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "flush",
                "--train-iters", "3", "--eval-iters", "0"]
    plain, _, _ = _losses(pipeline, nproc=4)
    overlapped, _, _ = _losses(pipeline + OVERLAP, nproc=4)
    _same(overlapped, plain, range(1, 4))


def _digest(model) -> str:
    """A hash of this rank's full copy of the weights."""
    data = b"".join(p.detach().contiguous().numpy().tobytes() for p in model[0].parameters())
    return hashlib.sha256(data).hexdigest()


def _build(world: int, schedule: str, flags: list[str]):
    """Model, optimizer, scheduler, schedule and data of one run (fresh model-parallel groups,
    seeded as every run), built as megatron_2bw/training/loop.py builds them."""
    from functools import partial

    import megatron_2bw
    import pretrain_gpt_2bw
    from megatron.core import parallel_state as ps
    from megatron.core import pipeline_parallel

    from megatron_2bw.runtime import distributed
    from megatron_2bw.schedules import executor
    from megatron_2bw.training import build
    from tests.reference import MODEL
    from tests.schedule_worker import _data, training_flags

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    info = distributed.initialize(1, 1, MODEL.seed, force_cpu=True, timeout_minutes=1.0)
    run = {"tp": 1, "pp": 1, "m": 2, "iters": 3, "schedule": schedule}
    args = parse_args(training_flags(run, MODEL, world) + flags, world_size=world)
    config = build.transformer_config(args, info.device)
    model = build.build_model(args, config, partial(pretrain_gpt_2bw.model_provider, args=args,
                                                    vocab_size=MODEL.vocab_size))
    optimizer = build.build_optimizer(args, model)
    scheduler = build.build_scheduler(args, optimizer)
    build.attach_config_hooks(config, model, optimizer, align_grad_reduce=args.align_grad_reduce)
    executor.reset_runners()
    megatron_2bw.install(schedule)
    fb = pipeline_parallel.get_forward_backward_func()
    return args, config, model, optimizer, scheduler, fb, _data(MODEL, args.num_microbatches)


def _train(name: str, built) -> list[dict]:
    import pretrain_gpt_2bw

    from tests.schedule_worker import train_iterations

    args, _, model, optimizer, scheduler, fb, data = built
    return train_iterations(name, args, fb, pretrain_gpt_2bw.forward_step, data, model,
                            optimizer, scheduler)


def _overlap_worker(rank: int, world: int) -> dict:
    from megatron_2bw.training import build
    from megatron_2bw.training.housekeeping import replica_mismatches

    built = _build(world, "flush", OVERLAP)
    config, model = built[1], built[2]
    chunk, finalize, launched = model[0], config.finalize_model_grads_func, []

    def finalize_recording(*a, **k):  # the state of every bucket when finalization starts
        launched.append([g.grad_reduce_handle is not None for g in chunk.bucket_groups])
        return finalize(*a, **k)

    config.finalize_model_grads_func = finalize_recording
    _train("flush-overlap", built)
    before = _digest(model)
    stale = replica_mismatches(model, "cpu")
    with build.forward_pre_hook_paused(model):
        hooks_while_paused = len(chunk.remove_forward_pre_hook_handles)
        after = _digest(model)
        gathered = replica_mismatches(model, "cpu")
    result = {"buckets": len(chunk.bucket_groups), "launched": launched,
              "before": before, "after": after, "hooks_while_paused": hooks_while_paused,
              "hooks_after": len(chunk.remove_forward_pre_hook_handles),
              "stale": stale, "gathered": gathered,
              "grad_sync_func": config.grad_sync_func is not None,
              "bucket_size": chunk.ddp_config.bucket_size}
    for name, flags in (("2bw", []), ("2bw-overlap", ["--overlap-grad-reduce",
                                                      "--ddp-bucket-size", "2000"])):
        built = _build(world, "2bw", flags)
        losses = _train(name, built)
        result[name] = {"losses": [d["lm loss"] for d in losses],
                        "weights": {n: p.detach().clone()
                                    for n, p in built[2][0].module.named_parameters()},
                        "step_mode": built[5].step_mode,
                        "buckets": len(built[2][0].bucket_groups)}
    return result


def test_overlap_launches_reductions_in_backward_and_gathers_before_pauses(tmp_path):
    results = launch.spawn(_overlap_worker, 2, out_dir=tmp_path, timeout=120)
    for r in results:
        assert r["bucket_size"] == 2000
        assert r["buckets"] >= 3, r["buckets"]
        assert r["grad_sync_func"]  # Megatron-LM's default --align-grad-reduce
        # megatron-core counts each bucket's gradients in the first batch and launches its
        # reductions from the hooks from the second batch on
        assert len(r["launched"]) == 3 and all(all(b) for b in r["launched"][1:]), r["launched"]
        assert r["hooks_while_paused"] == 0 and r["hooks_after"] > 0
    assert results[0]["before"] != results[1]["before"], "the step gathered the weights itself"
    assert results[0]["after"] == results[1]["after"], "pausing the hooks did not gather"
    # --check-weight-hash-across-dp-replicas-interval's comparison agrees with the digests
    assert all(r["stale"].endswith("on data-parallel ranks [0, 1]") for r in results), results
    assert all(r["gathered"] == "" for r in results), [r["gathered"] for r in results]
    _check_2bw_overlap_matches_plain(results)


def _check_2bw_overlap_matches_plain(results: list[dict]) -> None:
    """2bw with --overlap-grad-reduce (several buckets; the step is then taken in place)
    ends with the weights and losses of 2bw without it, to 1e-6."""
    for r in results:
        plain, overlapped = r["2bw"], r["2bw-overlap"]
        assert overlapped["buckets"] >= 3 and plain["buckets"] == 1
        assert "--overlap-grad-reduce" in overlapped["step_mode"] or \
            "one pipeline stage" in overlapped["step_mode"], overlapped["step_mode"]
        diff = sum(float((overlapped["weights"][n] - w).double().norm()) ** 2
                   for n, w in plain["weights"].items()) ** 0.5
        norm = sum(float(w.double().norm()) ** 2 for w in plain["weights"].values()) ** 0.5
        assert diff <= RTOL * norm, f"2bw weights {diff / norm:.3g} apart"
        assert len(plain["losses"]) == 3
        for a, b in zip(overlapped["losses"], plain["losses"]):
            assert abs(a - b) <= RTOL * abs(b), (overlapped["losses"], plain["losses"])
    assert results[0]["2bw"]["weights"].keys() == results[1]["2bw"]["weights"].keys()


BASE = ["--cpu", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "4",
        "--global-batch-size", "16", "--mock-data", "--lr", "1e-3", "--train-iters", "3"]


@pytest.mark.parametrize("flags, flag, words", [
    (["--overlap-param-gather", "--overlap-grad-reduce"], "--overlap-param-gather",
     "--use-distributed-optimizer"),
    (["--overlap-param-gather", "--use-distributed-optimizer"], "--overlap-param-gather",
     "--overlap-grad-reduce"),
    (["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
      "--overlap-param-gather-with-optimizer-step"], "--overlap-param-gather-with-optimizer-step",
     "interleaved"),
    (["--use-distributed-optimizer", "--optimizer", "sgd"], "--use-distributed-optimizer",
     "Adam only"),
    (["--use-torch-fsdp2"], "--use-torch-fsdp2", "not supported"),
    (["--use-megatron-fsdp"], "--use-megatron-fsdp", "not supported"),
    (["--num-distributed-optimizer-instances", "2", "--use-distributed-optimizer"],
     "--num-distributed-optimizer-instances", "only 1"),
    (["--ddp-num-buckets", "2", "--ddp-bucket-size", "100"], "--ddp-num-buckets", "not both"),
    (["--ddp-average-in-collective"], "--ddp-average-in-collective", "gloo"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size", ">= 1"),
])
def test_refusals_are_one_flag_line(flags, flag, words):
    with pytest.raises(FlagError) as error:
        parse_args(BASE + flags, world_size=2)
    message = str(error.value)
    assert error.value.flag == flag and words in message and "\n" not in message, message


def test_flags_map_as_megatron_lm_maps_them():
    """align_param_gather is off without virtual pipeline stages; bf16 reduces in fp32 unless
    --grad-reduce-in-bf16; --no-align-grad-reduce is Megatron-LM's spelling."""
    args = parse_args(BASE + ["--bf16", "--no-align-grad-reduce"], world_size=2)
    assert (args.accumulate_allreduce_grads_in_fp32, args.align_param_gather,
            args.align_grad_reduce, args.ddp_bucket_size) == (True, False, False, None)
    args = parse_args(BASE + ["--bf16", "--grad-reduce-in-bf16"], world_size=2)
    assert args.accumulate_allreduce_grads_in_fp32 is False
    args = parse_args(BASE, world_size=2)
    assert (args.accumulate_allreduce_grads_in_fp32, args.overlap_grad_reduce,
            args.check_weight_hash_across_dp_replicas_interval) == (False, False, None)
