"""Checkpoints with megatron-core's dist_checkpointing, in Megatron-LM's directory layout.

    {save}/iter_0000100/                 one dist_checkpointing directory per save
    {save}/latest_checkpointed_iteration.txt

Invariants: a checkpoint directory is complete before the tracker file names it (written under
a temporary name, renamed after every rank finished), so a crash mid-save leaves the previous
checkpoint as the latest; a checkpoint saved again at the same iteration replaces the old one
only once the new one is complete (the old one is moved aside, then deleted), and the tracker
is replaced atomically, last. Loading falls back from an unreadable newest checkpoint to the
newest readable one, with a warning; all ranks agree on which one they loaded. A checkpoint
holds the model, the optimizer (Adam moments and step), the LR schedule, the iteration, the
consumed samples, the TP/PP/DP layout and each model-parallel rank's RNG state: a resumed run
continues exactly as an uninterrupted one would. A run with another layout loads the model and
optimizer resharded and, where TP or PP changed, its own RNG state from --seed (said in a
warning).
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["TrainState", "save_checkpoint", "load_checkpoint", "latest_iteration",
           "checkpoint_dir", "saved_iterations", "check_paths", "CheckpointError"]

TRACKER_FILE = "latest_checkpointed_iteration.txt"


class CheckpointError(ValueError):
    """A --load/--save problem the user must fix; ``str()`` is the one line they see."""


@dataclass
class TrainState:
    """Where training stands; saved and restored with the weights."""

    iteration: int = 0
    consumed_train_samples: int = 0


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> int | None:
    """The iteration the tracker file names, or None when there is no checkpoint."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise CheckpointError(f"--load: {path} does not hold an iteration number: {text!r}")
    return int(text)


def _rng_state():
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    return ShardedObject("rng_state", state, (pp, tp),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank())


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _layout() -> dict:
    """This run's parallel layout, saved in every checkpoint's common state."""
    from megatron.core import parallel_state as ps

    return {"tensor": ps.get_tensor_model_parallel_world_size(),
            "pipeline": ps.get_pipeline_model_parallel_world_size(),
            "data": ps.get_data_parallel_world_size()}


def _describe(layout: dict) -> str:
    return f"TP={layout['tensor']} PP={layout['pipeline']} DP={layout['data']}"


def _sharded_state_dict(model, optimizer, scheduler, state: TrainState, is_loading: bool,
                        extra: Callable[[dict], None] | None = None,
                        with_rng: bool = True) -> dict:
    """Everything a checkpoint holds; ``extra`` adds a schedule's own entries. The model and
    optimizer entries are keyed by global layer and parameter names (dist_checkpointing
    reshards them for any layout); the RNG state is one object per (PP rank, TP rank)."""
    sharded = {"model": model[0].module.sharded_state_dict()}
    if optimizer is not None:
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded, is_loading=is_loading)
    if scheduler is not None:
        sharded["opt_param_scheduler"] = scheduler.state_dict()
    sharded["iteration"] = state.iteration
    sharded["consumed_train_samples"] = state.consumed_train_samples
    sharded["layout"] = _layout()
    if with_rng:
        sharded["rng_state"] = _rng_state()
    if extra is not None:
        extra(sharded)
    return sharded


def save_checkpoint(root: str, model, optimizer, scheduler, state: TrainState,
                    extra: Callable[[dict], None] | None = None, keep: int | None = None) -> str:
    """Save on every rank (collective); return the checkpoint directory.

    ``extra(sharded_state_dict)`` may add entries (the 2BW schedule adds its second weight
    version). With ``keep``, only the ``keep`` newest checkpoints remain, older ones deleted
    after the new one is complete and named by the tracker. A write that fails on any rank (a
    full disk) fails on every rank with CheckpointError; the partial directory is removed and
    the previous checkpoints and the tracker are untouched."""
    from megatron.core import dist_checkpointing

    final = checkpoint_dir(root, state.iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp, exist_ok=True)
    dist.barrier()
    sharded = _sharded_state_dict(model, optimizer, scheduler, state, is_loading=False,
                                  extra=extra)
    error = _attempt(lambda: dist_checkpointing.save(sharded, tmp))
    _fail_unless_all_wrote(error, root, final, tmp, state.iteration)
    if dist.get_rank() == 0:
        error = _attempt(lambda: _publish(root, tmp, final, state.iteration))
    _fail_unless_all_wrote(error, root, final, tmp, state.iteration)
    if dist.get_rank() == 0 and keep is not None:
        _delete_older(root, keep)
    dist.barrier()
    return final


def _attempt(action: Callable[[], None]) -> BaseException | None:
    """Run ``action``; its exception, or None (torch's CheckpointException is a
    BaseException)."""
    try:
        action()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as caught:
        return caught
    return None


def _fail_unless_all_wrote(error: BaseException | None, root: str, final: str, tmp: str,
                           iteration: int) -> None:
    """Collective: CheckpointError on every rank when any rank's write failed, after rank 0
    removed the partial ``tmp``; the tracker still names the last complete checkpoint."""
    if _all_ranks_agree(error is None):
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    why = _reason(error) if error is not None else "it failed on another rank"
    try:
        previous = latest_iteration(root)
    except CheckpointError:
        previous = None
    kept = ("no earlier checkpoint exists" if previous is None else
            f"the last complete checkpoint, iteration {previous}, is intact")
    raise CheckpointError(f"--save: could not write the checkpoint of iteration {iteration} "
                          f"to {final} ({why}); {kept}")


def _publish(root: str, tmp: str, final: str, iteration: int) -> None:
    """Rank 0, after every rank wrote ``tmp``: rename it to ``final`` and point the tracker at
    it, atomically and last; an older copy of the same iteration is replaced only after."""
    aside = final + ".old"
    if os.path.isdir(final):  # the same iteration saved again: replace, never lose both
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)
    tracker_tmp = os.path.join(root, TRACKER_FILE + ".tmp")
    with open(tracker_tmp, "w") as f:
        f.write(str(iteration))
    os.replace(tracker_tmp, os.path.join(root, TRACKER_FILE))


def _delete_older(root: str, keep: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (``--ckpt-keep``)."""
    for iteration in saved_iterations(root)[keep:]:
        shutil.rmtree(checkpoint_dir(root, iteration), ignore_errors=True)


def saved_iterations(root: str) -> list[int]:
    """Iterations with a complete checkpoint directory under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    found = [int(name[len("iter_"):]) for name in os.listdir(root)
             if name.startswith("iter_") and name[len("iter_"):].isdigit()
             and os.path.isdir(os.path.join(root, name))]
    return sorted(found, reverse=True)


def check_paths(args) -> None:
    """Up front, on every rank: --save is a writable directory, and a --load that holds no
    checkpoint must not let a fresh run overwrite the checkpoints of another run in --save (a
    mistyped --load would otherwise start from scratch and rewind that run's tracker). Raises
    FlagError."""
    from megatron_2bw.arguments import FlagError

    if args.save is None:
        return
    _probe_writable(args.save, FlagError)
    if args.overwrite_save:
        return
    if args.load is None or os.path.abspath(args.load) == os.path.abspath(args.save):
        return  # no --load: Megatron-LM's behaviour, --save is written to
    theirs = _candidates(args.save)
    if theirs and not _candidates(args.load):
        raise FlagError("--load", f"{args.load} holds no checkpoint, but --save {args.save} "
                        f"holds another run's (iteration {theirs[0]}): fix --load, or pass "
                        f"--overwrite-save to start from scratch there")


def _probe_writable(root: str, error_type) -> None:
    """--save must take a file now, not hours in at the first save: create it, write and
    remove a probe file (one per process: every rank probes, on a shared file system too)."""
    probe = os.path.join(root, f".write-probe-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as error:
        raise error_type("--save", f"{root} is not a writable directory: "
                                   f"{error.strerror or error}") from None


def _candidates(root: str) -> list[int]:
    """The tracker's iteration first, then older complete checkpoints, newest first."""
    try:
        named = latest_iteration(root)
    except CheckpointError:  # a torn tracker: the directories still tell what was saved
        named = None
    older = [i for i in saved_iterations(root) if named is None or i < named]
    return ([named] if named is not None else []) + older


def _all_ranks_agree(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (an all-reduce on the default group, on the
    training device as its backend needs)."""
    from megatron_2bw.runtime.distributed import training_device

    flag = torch.tensor([0.0 if ok else 1.0], device=training_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return not flag.item()


def load_checkpoint(root: str, model, optimizer, scheduler, load_optim: bool = True,
                    load_rng: bool = True,
                    extra: Callable[[dict, str], None] | None = None,
                    on_loaded: Callable[[dict], None] | None = None,
                    warn: Callable[[str], None] = print) -> TrainState | None:
    """Restore the newest readable checkpoint under ``root`` into the given objects; None when
    there is none. ``extra(sharded, checkpoint_path)`` lets a schedule request its own entries,
    ``on_loaded(loaded)`` read them back. A checkpoint that fails to load on any rank is
    skipped on every rank, with a warning; when none loads, ValueError names the newest."""
    candidates = _candidates(root)
    if not candidates:
        return None
    failures = []
    for iteration in candidates:
        path = checkpoint_dir(root, iteration)
        try:
            state = _load_one(path, model, optimizer, scheduler, load_optim, load_rng, extra,
                              on_loaded, warn)
            error = None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as caught:  # torch's CheckpointException is a BaseException
            state, error = None, caught
        if _all_ranks_agree(error is None):
            if failures:
                warn(f" warning: skipped unreadable checkpoint(s) {'; '.join(failures)}; "
                     f"loaded {path}")
            return state
        why = "unreadable on another rank" if error is None else _reason(error)
        failures.append(f"{path} ({why})")
    raise CheckpointError(f"--load: no readable checkpoint in {root}: {failures[0]}")


def _reason(error: BaseException) -> str:
    """One line for a failed load: torch's CheckpointException wraps each rank's error."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and not failures:  # torch's: the failing rank is elsewhere
        return "it failed on another rank"
    if isinstance(failures, dict):
        error = next(iter(failures.values()))
        if isinstance(error, tuple) and error:  # (exception, its traceback frames)
            error = error[0]
        error = getattr(error, "exc", error)  # a wrapped remote traceback
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1][:200]}" if text else type(error).__name__


def _load_one(path: str, model, optimizer, scheduler, load_optim: bool, load_rng: bool,
              extra, on_loaded, warn: Callable[[str], None]) -> TrainState:
    from megatron.core import dist_checkpointing

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is missing")
    saved_layout = dist_checkpointing.load_common_state_dict(path).get("layout")
    layout = _layout()
    rng_keyed_alike = saved_layout is None or all(
        saved_layout[k] == layout[k] for k in ("tensor", "pipeline"))
    if saved_layout is not None and saved_layout != layout:
        rng = ("RNG state kept" if rng_keyed_alike else
               "RNG state re-seeded from --seed (it is kept per TP and PP rank)")
        warn(f" warning: {path} was saved with {_describe(saved_layout)}, this run is "
             f"{_describe(layout)}: model and optimizer state resharded; {rng}")
    load_rng = load_rng and rng_keyed_alike
    sharded = _sharded_state_dict(model, optimizer if load_optim else None,
                                  scheduler if load_optim else None,
                                  TrainState(), is_loading=True,
                                  extra=None if extra is None else lambda sd: extra(sd, path),
                                  with_rng=load_rng)
    loaded = dist_checkpointing.load(sharded, path)
    model[0].module.load_state_dict(loaded["model"])
    if load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if load_rng:
        _set_rng_state(loaded["rng_state"])
    if on_loaded is not None:
        on_loaded(loaded)
    return TrainState(iteration=loaded["iteration"],
                      consumed_train_samples=loaded["consumed_train_samples"])
