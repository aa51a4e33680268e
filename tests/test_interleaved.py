"""Virtual pipeline stages (Megatron-LM's --num-virtual-stages-per-pipeline-rank V): V model
chunks per pipeline rank, run by megatron-core's own interleaved 1F1B
(``--pipeline-schedule megatron``) and by ours (``--pipeline-schedule flush``).

Checks on 2 CPU processes that V = 2 trains as V = 1 does (compared from a common checkpoint,
resharded between chunk counts), that our flush with V = 2 logs megatron-core's interleaved
run's losses and 2bw with V = 2 those of 2bw with V = 1 (1e-6 relative), and that bad flags
end in one FlagError line each, as Megatron-LM's validate_args (core_v0.16.1) has them.
The runs in detail: docs/testing.md, "What each test module checks", test_interleaved.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_2bw.arguments import FlagError, parse_args
from megatron_2bw.training.checkpointing import TRACKER_FILE, checkpoint_dir, model_keys
from tests import dist as launch

TINY = ["--cpu", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--mock-data", "--log-interval", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "5e-3", "--min-lr", "5e-4",
        "--lr-warmup-iters", "1", "--train-iters", "4", "--eval-interval", "4",
        "--eval-iters", "1", "--pipeline-model-parallel-size", "2",
        "--pipeline-schedule", "megatron", "--distributed-timeout-minutes", "1",
        "--num-workers", "0"]
RTOL = 1e-6


def _train(flags: list[str]) -> tuple[dict, float | None]:
    """One training run of ``pretrain_gpt_2bw.py``'s pieces (megatron_2bw.training.loop's
    Trainer) in this process: (training loss by iteration, final validation loss), None on the
    ranks without the loss. The model-parallel groups are torn down after it; the default
    group stays for the next run."""
    from functools import partial

    import megatron_2bw
    import pretrain_gpt_2bw
    from megatron.core import parallel_state as ps

    from megatron_2bw import entry
    from megatron_2bw.schedules import executor
    from megatron_2bw.training.loop import Trainer

    args = parse_args(TINY + flags, world_size=2)
    args.model_type = "gpt"
    vocab_size = entry.padded_vocab(args, None)
    megatron_2bw.install(args.pipeline_schedule)
    trainer = Trainer(args, partial(pretrain_gpt_2bw.model_provider, args=args,
                                    vocab_size=vocab_size),
                      partial(entry.gpt_data, tokenizer=None), pretrain_gpt_2bw.forward_step,
                      vocab_size)
    losses, step = {}, trainer.train_step

    def recorded_step():
        loss, *rest = step()
        losses[trainer.state.iteration] = loss
        return (loss, *rest)

    trainer.train_step = recorded_step
    last = trainer.train()
    trainer.housekeeping.close()
    trainer.logger.close()
    launch.tear_down_groups()
    executor.reset_runners()  # a schedule's runner keeps its state across calls
    return losses, last["valid_loss"]


def _resume_dir(saved: Path, iteration: int, into: Path) -> str:
    """A --load directory holding only ``saved``'s checkpoint of ``iteration``."""
    into.mkdir()
    shutil.copytree(checkpoint_dir(str(saved), iteration), checkpoint_dir(str(into), iteration))
    (into / TRACKER_FILE).write_text(str(iteration))
    return str(into)


def train_saving(rank: int, flags: list[str], root: Path, saved_at: int, train=None) -> tuple:
    """(the run of ``flags`` saving at ``saved_at`` and at its end, root/saved, root/start: a
    --load directory holding only the ``saved_at`` checkpoint), on every rank; ``train``: the
    trainer (default ``_train``)."""
    import torch.distributed as dist

    saved, start = root / "saved", root / "start"
    full = (train or _train)([*flags, "--save", str(saved), "--save-interval", str(saved_at)])
    if rank == 0:
        _resume_dir(saved, saved_at, start)
    dist.barrier()
    return full, saved, start


def _chunked_worker(rank: int, world: int, out: str) -> dict:
    """V = 2 from scratch (saved at iteration 2), then V = 1 and V = 2 resumed from that
    checkpoint, one after the other on the same processes."""
    import torch.distributed as dist

    out = Path(out)
    runs = {"chunked": _train(["--num-virtual-stages-per-pipeline-rank", "2",
                               "--save", str(out / "v2"), "--save-interval", "2"])}
    if rank == 0:
        _resume_dir(out / "v2", 2, out / "v1_from_2")
        _resume_dir(out / "v2", 2, out / "v2_from_2")
    dist.barrier()
    runs["flush"] = _train(["--pipeline-schedule", "flush",
                            "--num-virtual-stages-per-pipeline-rank", "2"])
    runs["one_chunk"] = _train(["--load", str(out / "v1_from_2")])
    runs["resumed"] = _train(["--num-layers-per-virtual-pipeline-stage", "1",  # V = 2
                              "--load", str(out / "v2_from_2")])
    for name, chunks in (("2bw_v2", ["--num-virtual-stages-per-pipeline-rank", "2"]),
                         ("2bw_v1", [])):
        runs[name] = _train(["--pipeline-schedule", "2bw", "--no-deferred-step", *chunks,
                             "--load", str(out / "v2_from_2")])
    return runs


def _same(actual: dict, expected: dict, iterations) -> None:
    assert sorted(actual) == list(iterations), (actual, expected)
    for i in iterations:
        assert abs(actual[i] - expected[i]) <= RTOL * abs(expected[i]), \
            f"iteration {i}: {actual[i]!r}, expected {expected[i]!r}"


def test_two_chunks_per_rank_train_as_one_chunk_and_resume(tmp_path):
    runs = launch.spawn(_chunked_worker, 2, str(tmp_path), out_dir=tmp_path / "results",
                        timeout=150)[1]  # the last pipeline stage holds the losses
    (chunked, chunked_valid), (one, one_valid), (resumed, resumed_valid) = (
        runs["chunked"], runs["one_chunk"], runs["resumed"])
    ours, ours_valid = runs["flush"]
    _same(ours, chunked, [1, 2, 3, 4])
    _same({4: ours_valid}, {4: chunked_valid}, [4])
    # 2BW-interleaved: 2bw's 1-stale weights with V = 2 as with V = 1 (whose weights equal the
    # single-process 1-stale reference: test_schedules_exact), not the synchronous ones
    (twobw, twobw_valid), (twobw_one, twobw_one_valid) = runs["2bw_v2"], runs["2bw_v1"]
    _same(twobw, twobw_one, [3, 4])
    _same({4: twobw_valid}, {4: twobw_one_valid}, [4])
    assert abs(twobw[4] - chunked[4]) > 1e-4 * abs(chunked[4]), (twobw, chunked)
    assert sorted(chunked) == [1, 2, 3, 4] and chunked_valid is not None
    _same(one, chunked, [3, 4])
    _same({4: one_valid}, {4: chunked_valid}, [4])
    _same(resumed, chunked, [3, 4])
    _same({4: resumed_valid}, {4: chunked_valid}, [4])


# ---- flags --------------------------------------------------------------------------------

def _parse(flags: list[str], world_size: int = 2):
    return parse_args(TINY + flags, world_size=world_size)


def test_virtual_stages_derive_as_in_megatron_lm():
    """V from either flag (layers per stage / layers per virtual stage), V = 1 meaning none;
    overlapped p2p and aligned parameter gathers only with V > 1."""
    given = _parse(["--num-virtual-stages-per-pipeline-rank", "2"])
    derived = _parse(["--num-layers-per-virtual-pipeline-stage", "1"])  # 4 / 2 / 1
    single = _parse(["--num-layers-per-virtual-pipeline-stage", "2"])   # 4 / 2 / 2
    plain = _parse([])
    assert [a.virtual_pipeline_model_parallel_size for a in (given, derived, single, plain)] \
        == [2, 2, None, None]
    assert (given.overlap_p2p_comm, given.align_param_gather) == (True, True)
    assert (plain.overlap_p2p_comm, plain.align_param_gather) == (False, False)
    assert model_keys([object()]) == ["model"]
    assert model_keys([object()] * 3) == ["model0", "model1", "model2"]


def _world(flags: list[str]) -> int:
    """Enough ranks for the flags: the pipeline size, times 2 data-parallel replicas for the
    distributed optimizer."""
    pp = 2
    if "--pipeline-model-parallel-size" in flags:
        pp = int(flags[flags.index("--pipeline-model-parallel-size") + 1])
    return pp * (2 if "--use-distributed-optimizer" in flags else 1)


@pytest.mark.parametrize("flags, flag, words", [
    (["--num-virtual-stages-per-pipeline-rank", "2", "--num-layers-per-virtual-pipeline-stage",
      "1"], "--num-layers-per-virtual-pipeline-stage", "not both"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "gpipe"],
     "--num-virtual-stages-per-pipeline-rank", "--pipeline-schedule gpipe does not run virtual "
     "stages yet"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "2bw",
      "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
      "--overlap-param-gather-with-optimizer-step"],
     "--overlap-param-gather-with-optimizer-step", "not yet under --pipeline-schedule 2bw"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule", "pipedream"],
     "--num-layers-per-virtual-pipeline-stage", "pipedream does not run virtual stages yet"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "4", "--pipeline-schedule", "2bw",
      "--num-virtual-stages-per-pipeline-rank", "2"],  # m = 4: 4 x 2 < 2 x 3 + 4
     "--global-batch-size", "10 warm-up forwards (2(d-1) + (V-1)d) fit in one batch"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-model-parallel-size", "1"],
     "--pipeline-model-parallel-size", "more than 1 pipeline stages"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--no-overlap-p2p-communication"],
     "--pipeline-model-parallel-size", "more than 2 pipeline stages"),
    (["--num-virtual-stages-per-pipeline-rank", "4"], "--num-layers", "4 layers do not split "
     "evenly over 2 pipeline stages x 4 virtual stages"),
    (["--num-layers-per-virtual-pipeline-stage", "3"], "--num-layers-per-virtual-pipeline-stage",
     "2 layers per stage are not divisible by 3"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "6"],
     "--global-batch-size", "3 microbatches is not a multiple of 2"),
    (["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
      "--overlap-param-gather-with-optimizer-step"],
     "--overlap-param-gather-with-optimizer-step", "only supported with interleaved"),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--use-distributed-optimizer",
      "--overlap-grad-reduce", "--overlap-param-gather",
      "--overlap-param-gather-with-optimizer-step", "--save", "ckpt"],
     "--overlap-param-gather-with-optimizer-step", "distributed checkpointing"),
])
def test_virtual_stage_refusals_are_one_flag_line(flags, flag, words):
    with pytest.raises(FlagError) as error:
        _parse(flags, world_size=_world(flags))
    message = str(error.value)
    assert error.value.flag == flag and words in message and "\n" not in message, message
