"""Training side of tests/test_batch_rampup.py: the real entry set-up and training loop
(``entry.setup`` + ``entry.run``: flags, ``Trainer``, checkpoints, the log line) on the tiny GPT
of tests/reference.py, started from the reference's initial weights and reading the
reference's data streams.

    torchrun --nproc-per-node 2 tests/rampup_worker.py INIT.pt FLAGS...

Each rank loads its pipeline-stage slice of INIT.pt into the model megatron-core builds
(tests/schedule_worker.py ``_load_slice``). Data-parallel replica r reads
``stream_microbatch(MODEL, r, k)`` for k = 0, 1, ...: a batch of any size takes the next
microbatches of the stream, as tests/reference.py's reference does; a resumed run starts at
the checkpoint's consumed samples / (micro batch x DP).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `tests` and `pretrain_gpt_2bw` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _model_provider(config, pre_process: bool, post_process: bool, *, args, init_path: str):
    import torch

    import pretrain_gpt_2bw
    from tests.reference import MODEL
    from tests.schedule_worker import _load_slice

    gpt = pretrain_gpt_2bw.model_provider(config, pre_process, post_process, args=args,
                                          vocab_size=MODEL.vocab_size)
    _load_slice(gpt, torch.load(init_path), tie=True, num_layers=args.num_layers,
                schedule=args.pipeline_schedule)
    return gpt


def _stream(replica: int, start: int):
    from tests.reference import MODEL, stream_microbatch

    index = start
    while True:
        yield stream_microbatch(MODEL, replica, index)
        index += 1


def _data_provider(args, state):
    from megatron.core import parallel_state as ps

    from megatron_2bw.training.loop import DataIterators

    per_microbatch = args.micro_batch_size * args.data_parallel_size
    return DataIterators(train=_stream(ps.get_data_parallel_rank(),
                                       state.consumed_train_samples // per_microbatch),
                         valid=None)


def main(argv: list[str]) -> None:
    import pretrain_gpt_2bw
    from megatron_2bw import entry
    from tests.reference import MODEL

    init_path, flags = argv[0], argv[1:]
    args, _ = entry.setup("gpt", flags)
    entry.run(args, partial(_model_provider, args=args, init_path=init_path), _data_provider,
              pretrain_gpt_2bw.forward_step, MODEL.vocab_size)


if __name__ == "__main__":  # the checkpoint writer spawns a helper process
    main(sys.argv[1:])
