"""What ``pretrain_gpt_2bw.py`` and ``pretrain_bert_2bw.py`` share: flag parsing with one-line
errors, tokenizer and data checks before any process group exists, the per-rank data
iterators, and the run wrapper.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Callable, Sequence

from megatron_2bw.arguments import parse_args
from megatron_2bw.data.errors import DataError
from megatron_2bw.flag_types import FlagError
from megatron_2bw.runtime.distributed import is_rank_zero
from megatron_2bw.runtime.versions import VersionError
from megatron_2bw.training.checkpointing import CheckpointError

__all__ = ["setup", "run", "fail", "padded_vocab", "next_batch", "gpt_data", "bert_data"]

_USER_ERRORS = (FlagError, DataError, VersionError, CheckpointError)


def fail(error: Exception, code: int = 2) -> None:
    """One error line on stderr and exit code ``code`` (2: bad input), on every rank that sees
    the error."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    sys.exit(code)


def setup(model_type: str, argv: Sequence[str] | None = None,
          parser: argparse.ArgumentParser | None = None):
    """Parse and validate flags, choose the device, check megatron-core's version, check data
    files and build the tokenizer.

    ``parser`` replaces ``arguments.build_parser()`` for a model with flags of its own (BERT's).
    Any user error ends the process here with one line, before torch.distributed starts.
    Flags are checked before megatron-core is imported, so a bad flag fails at once. The device
    is chosen next (``torch.cuda.set_device`` on CUDA; on the CPU the runtime, which must precede
    the import of megatron-core's model modules: it switches off their torch.compile
    decorators), before anything can create a CUDA tensor."""
    from megatron_2bw.runtime import device, lifetime, versions
    from megatron_2bw.training import checkpointing

    lifetime.remember_launcher()  # before anything can take long: the launcher may die meanwhile
    warnings.filterwarnings("ignore", message=".*Apex (is|are) not installed.*")
    try:
        args = parse_args(argv, parser=parser)
        args.model_type = model_type
        if is_rank_zero():
            for note in args.flag_notes:  # Megatron-LM flags without effect here
                print(note, flush=True)
        _check_model_type_flags(args)
        _check_output_paths(args)
        checkpointing.check_paths(args)
        device.select_device(args.cpu)
        versions.check()
        if args.mock_data:
            return args, None
        from megatron_2bw.data import tokenizer as tokenizers

        tokenizer = tokenizers.TokenizerSpec.from_args(args).build()
        _check_corpus(args, tokenizer)
    except _USER_ERRORS as error:
        fail(error)
    return args, tokenizer


def _check_model_type_flags(args: argparse.Namespace) -> None:
    """What one model type needs of the shared flags: a BERT sample is [CLS] A [SEP] B [SEP]
    with A and B non-empty (megatron-core's sample mapping divides by --seq-length - 4)."""
    if args.model_type == "bert" and args.seq_length < 5:
        raise FlagError("--seq-length", f"BERT needs at least 5 ([CLS] A [SEP] B [SEP]), got "
                        f"{args.seq_length}")


def _check_output_paths(args: argparse.Namespace) -> None:
    """Up front, on every rank: the folders a run writes besides --save (TensorBoard events,
    megatron-core's dataset index cache) can be written, and --load is not a file."""
    from megatron_2bw.flag_types import require_writable_dir

    for flag in ("--tensorboard-dir", "--data-cache-path"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            require_writable_dir(flag, value)
    if args.load is not None and os.path.exists(args.load) and not os.path.isdir(args.load):
        raise FlagError("--load", f"{args.load} is a file; --load takes the checkpoint "
                        "directory (the one holding latest_checkpointed_iteration.txt)")


def _check_corpus(args: argparse.Namespace, tokenizer) -> None:
    """Every dataset of ``--data-path`` is whole, and each split asked for samples can give them
    (megatron-core's builder would otherwise loop forever on an empty split); BERT's tokenizer
    has its special tokens."""
    from megatron_2bw.data import bert, gpt

    counts = _sample_counts(args)
    if args.model_type == "bert":
        bert.check_bert_tokenizer(tokenizer)
    for prefix in gpt.blend_from_flags(args.data_path, args.split)[0]:
        if args.model_type == "bert":
            bert.check_splits_have_samples(prefix, args.split, counts, args.bert_binary_head)
        else:
            gpt.check_splits_have_tokens(prefix, args.split, counts, args.seq_length)


def padded_vocab(args: argparse.Namespace, tokenizer) -> int:
    """The embedding's rows, also kept as ``args.padded_vocab_size`` (saved with the flags):
    Megatron-LM's build_tokenizer sets it for every tokenizer type, and its loader reads it."""
    from megatron_2bw.data.tokenizer import padded_vocab_size

    size = args.vocab_size if tokenizer is None else tokenizer.vocab_size
    if tokenizer is None and args.tokenizer_type == "NullTokenizer":
        size += 1  # Megatron-LM builds it under --mock-data too: --vocab-size ids and eod
    args.padded_vocab_size = padded_vocab_size(size, args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)
    return args.padded_vocab_size


def run(args: argparse.Namespace, model_provider: Callable, data_provider: Callable,
        forward_step_func: Callable, vocab_size: int) -> dict:
    """Train this rank; every way it can fail that is not a bug ends with one line.

    From here on the rank is a job's member: SIGTERM and SIGINT are stop requests (a
    checkpoint, exit code 0), the rank gets SIGTERM when its launcher ends, and the processes it
    forks (data loader workers, checkpoint writers) ignore both signals and end with it
    (``runtime.lifetime``). A lost peer, whatever the rank was doing when it found out (an
    exchange, a collective, a checkpoint save), ends it with exit code 1 and one line."""
    import megatron_2bw
    from megatron_2bw.runtime import lifetime
    from megatron_2bw.training.guard import Divergence, catch_stop_signals
    from megatron_2bw.training.loop import pretrain

    catch_stop_signals()
    lifetime.end_helpers_with_this_process()
    lifetime.bind_to_launcher()
    megatron_2bw.install(args.pipeline_schedule)
    try:
        return pretrain(args, model_provider, data_provider, forward_step_func, vocab_size)
    except _USER_ERRORS as error:
        fail(error)
    except Divergence as error:  # every rank reads the same verdict: all end with this line
        fail(error, code=1)
    except RuntimeError as error:
        if _DATA_WORKER_GONE in str(error):  # a worker killed by something else than a signal
            fail(f"a data loader worker of this rank ended, so this rank stops: "
                 f"{_first_line(error)}", code=1)
        if not _lost_peer(error):
            raise  # a bug: its traceback
        if getattr(error, "reported_by_stage", None) is not None:
            sys.exit(1)  # the pipeline stage printed its line and its program
        fail(f"a peer process ended, stalled or cannot be reached, so this rank stops: "
             f"{_first_line(error)}", code=1)


# Messages of gloo's and NCCL's transports when the process at the other end is gone, or did
# not answer within the process group's timeout (--distributed-timeout-minutes).
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "NCCL communicator was aborted", "remote process exited", "Timed out",
              "timed out", "Connection refused")


# torch's DataLoader (--num-workers > 0) when one of its worker processes dies.
_DATA_WORKER_GONE = "DataLoader worker"


def _lost_peer(error: BaseException) -> bool:
    """torch.distributed's own errors (DistBackendError, DistNetworkError, DistStoreError), a
    pipeline exchange's CommError, or a transport's message naming a lost or silent peer."""
    import torch.distributed as dist

    from megatron_2bw.schedules.p2p import CommError

    return (isinstance(error, (getattr(dist, "DistError", ()), CommError)) or
            any(marker in str(error) for marker in _PEER_GONE))


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:240]


def next_batch(data_iterator, every_stage: bool = False, vp_stage: int | None = None, *,
               model=None) -> dict:
    """The microbatch this pipeline stage needs, every tensor on the training device: GPT reads
    tokens on the first stage and labels on the last, nothing on the stages between (they read
    their input from the previous stage); with ``every_stage`` (BERT: every stage needs the
    padding mask) each stage reads the whole batch. With virtual pipeline stages the stage is
    the model chunk's (``vp_stage``): first and last of the whole virtual pipeline. Given the
    (unwrapped) ``model`` chunk, its own ``pre_process`` and ``post_process`` say so, whatever
    the placement of the chunks (the V of zb-v and dualpipev holds both on rank 0)."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.runtime import device

    ignore_virtual = vp_stage is None
    if model is not None:
        first, last = model.pre_process, model.post_process
    else:
        first = ps.is_pipeline_first_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
        last = ps.is_pipeline_last_stage(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
    if not (every_stage or first or last):
        return {"tokens": None, "position_ids": None, "labels": None, "loss_mask": None}
    return device.to_device(next(data_iterator), device.training_device())


def _sample_counts(args: argparse.Namespace) -> tuple[int, int, int]:
    """Samples each split must provide: --train-samples, or every batch of --train-iters (as
    Megatron-LM's train_valid_test_num_samples), and --eval-iters batches per evaluation
    (evaluations reuse the same batches) and for the test split."""
    eval_samples = args.eval_iters * args.global_batch_size
    train_samples = getattr(args, "train_samples", None) or \
        args.train_iters * args.global_batch_size
    return train_samples, eval_samples, eval_samples


def _iterators(args: argparse.Namespace, state, vocab_size: int, train, valid, test):
    """This data-parallel rank's iterators: training from ``state.consumed_train_samples``,
    validation and test restarting at their first sample at every evaluation; every batch's
    token ids checked against ``vocab_size``."""
    from megatron.core import parallel_state as ps

    from megatron_2bw.data.gpt import make_data_iterator
    from megatron_2bw.training.loop import DataIterators

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()

    def iterator(dataset, split, consumed=0):
        if dataset is None:
            return None
        batches = make_data_iterator(dataset, args.micro_batch_size, dp_rank, dp_size,
                                     consumed_samples=consumed, num_workers=args.num_workers)
        return _in_vocabulary(batches, vocab_size, split)

    return DataIterators(
        train=iterator(train, "training", state.consumed_train_samples),
        valid=None if valid is None else (lambda: iterator(valid, "validation")),
        test=None if test is None else (lambda: iterator(test, "test")),
    )


def _in_vocabulary(batches, vocab_size: int, split: str):
    """``batches`` unchanged, each checked on the host before it reaches the model: a token id
    outside the vocabulary (a damaged .bin, data tokenized with another tokenizer) raises
    DataError instead of an embedding's index error (a device-side assert on CUDA)."""
    import torch

    for batch in batches:
        tokens = batch["tokens"] if "tokens" in batch else batch["text"]  # GPT, BERT
        low, top = (int(value) for value in torch.aminmax(tokens))
        if top >= vocab_size or low < 0:
            raise DataError("--data-path", f"a {split} batch holds token id {top}, outside the "
                            f"tokenizer's vocabulary of {vocab_size} (a damaged .bin file, or "
                            f"data tokenized with another tokenizer than --tokenizer-model)")
        yield batch


def _vocabulary(args: argparse.Namespace, tokenizer) -> int:
    return args.vocab_size if tokenizer is None else tokenizer.vocab_size


def gpt_data(args: argparse.Namespace, state, tokenizer):
    """Per-rank GPT iterators; training resumes at ``state.consumed_train_samples``."""
    from megatron_2bw.data import gpt

    if args.mock_data:
        train, valid, test = gpt.build_mock_gpt_datasets(args.seq_length, args.seed,
                                                         args.vocab_size, _sample_counts(args))
    else:
        train, valid, test = gpt.build_gpt_datasets(
            args.data_path, args.split, args.seq_length, args.seed, tokenizer,
            _sample_counts(args), cache_dir=args.data_cache_path,
            mmap_bin_files=args.mmap_bin_files,
            create_attention_mask=args.create_attention_mask_in_dataloader)
    return _iterators(args, state, _vocabulary(args, tokenizer), train, valid, test)


def bert_data(args: argparse.Namespace, state, tokenizer):
    """Per-rank BERT iterators (every pipeline stage reads the batch: all of them need the
    padding mask); training resumes at ``state.consumed_train_samples``."""
    from megatron_2bw.data import bert

    counts = _sample_counts(args)
    if args.mock_data:
        train, valid, test = bert.build_mock_bert_datasets(
            args.seq_length, args.seed, args.vocab_size, counts,
            binary_head=args.bert_binary_head, masking_probability=args.mask_prob)
    else:
        train, valid, test = bert.build_bert_datasets(
            args.data_path, args.split, args.seq_length, args.seed, tokenizer, counts,
            binary_head=args.bert_binary_head, masking_probability=args.mask_prob,
            short_sequence_probability=args.short_seq_prob, cache_dir=args.data_cache_path)
    return _iterators(args, state, _vocabulary(args, tokenizer), train, valid, test)
