"""The private (and signature-sensitive) pieces of megatron-core and torch that megatron-2bw calls.

megatron-2bw is pinned to ``megatron-core==0.16.1``; it calls functions there that are not public
API (underscore names, helpers of the pipeline schedules) and passes some arguments by name.
:func:`check` runs at start-up, before any process group exists, and turns a different
megatron-core (or a torch below the floor) into one :class:`VersionError` line instead of an
``AttributeError``/``TypeError`` deep inside the first training step.

Invariant: every entry of :data:`MEGATRON_CORE` names a function we call (or a constant we read)
with the parameter names we rely on, in megatron-core 0.16.1's order. Add a row whenever
megatron_2bw starts using another private megatron-core name.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from importlib import metadata

import torch

__all__ = ["Expected", "MEGATRON_CORE", "MEGATRON_CORE_PIN", "TORCH_FLOOR", "VersionError",
           "check", "mismatches", "installed_megatron_core"]

MEGATRON_CORE_PIN = "0.16.1"
TORCH_FLOOR = (2, 7)  # torch._C._autograd._unsafe_set_version_counter takes tuples (weights.py)


class VersionError(RuntimeError):
    """An installed dependency differs from what megatron-2bw calls; ``str()`` is one line."""


@dataclass(frozen=True)
class Expected:
    """``module.name`` must exist; with ``params``, its parameters must be exactly these names
    (``exact``) or include them (not ``exact``: we pass only those, by name)."""

    module: str
    name: str
    params: tuple[str, ...] | None = None
    exact: bool = True
    user: str = ""  # where megatron_2bw calls it

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


_FINALIZE = "megatron.core.distributed.finalize_model_grads"
_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_RANDOM = "megatron.core.tensor_parallel.random"
_CLIP = "megatron.core.optimizer.clip_grads"
_LAYERS = "megatron.core.tensor_parallel.layers"

MEGATRON_CORE: tuple[Expected, ...] = (
    Expected(_FINALIZE, "_allreduce_non_tensor_model_parallel_grads",
             ("model", "config", "tp_group"), user="deferred.py"),
    Expected(_FINALIZE, "reset_model_temporary_tensors", ("config", "model"), user="deferred.py"),
    Expected(_FINALIZE, "finalize_model_grads",
             ("model", "num_tokens", "pg_collection", "force_all_reduce"),
             user="schedules/stepping.py"),
    Expected(_RANDOM, "_get_cuda_rng_state", ("device", "clone", "graph_safe"),
             user="runtime/cpu.py (replaced)"),
    Expected(_RANDOM, "_set_cuda_rng_state", ("new_state", "device", "graph_safe"),
             user="runtime/cpu.py (replaced)"),
    Expected(_SCHEDULES, "forward_step",
             ("forward_step_func", "data_iterator", "model", "num_microbatches", "input_tensor",
              "forward_data_store", "config", "cp_group_size", "collect_non_loss_data",
              "checkpoint_activations_microbatch", "is_first_microbatch", "current_microbatch",
              "vp_stage", "is_last_stage"), user="schedules/passes.py, schedules/executor.py"),
    Expected(_SCHEDULES, "backward_step",
             ("input_tensor", "output_tensor", "output_tensor_grad", "model_type", "config"),
             user="schedules/passes.py"),
    Expected(_SCHEDULES, "deallocate_output_tensor", ("out", "deallocate_pipeline_outputs"),
             user="schedules/mailbox.py"),
    Expected(_CLIP, "get_grad_norm_fp32",
             ("grads_for_norm", "norm_type", "grad_stats_parallel_group"), user="deferred.py"),
    Expected(_CLIP, "clip_grad_by_total_norm_fp32",
             ("parameters", "max_norm", "total_norm", "use_decoupled_grad"), user="deferred.py"),
    Expected("megatron.core.parallel_state", "initialize_model_parallel",
             ("tensor_model_parallel_size", "pipeline_model_parallel_size",
              "distributed_timeout_minutes"), exact=False, user="runtime/distributed.py"),
    Expected("megatron.core.parallel_state", "update_pg_timeout", ("timeout", "pg"),
             user="runtime/distributed.py"),
    Expected("megatron.core.parallel_state", "_global_process_group_list",
             user="runtime/distributed.py (through update_pg_timeout)"),
    Expected(_LAYERS, "LinearWithGradAccumulationAndAsyncCommunication",
             user="schedules/wgrad.py (its backward swapped during zb-h1's I)"),
    Expected(_LAYERS, "custom_bwd", user="schedules/wgrad.py"),
    Expected(_LAYERS, "dist_all_gather_func", user="schedules/wgrad.py"),
    Expected(_LAYERS, "dist_reduce_scatter_func", user="schedules/wgrad.py"),
    Expected("megatron.core.jit", "noop_decorator", ("func",), user="runtime/cpu.py"),
    Expected("megatron.core.jit", "jit_fuser", user="runtime/cpu.py (replaced)"),
    Expected("megatron.core.datasets.indexed_dataset", "_INDEX_HEADER", user="data/indexed.py"),
    Expected("megatron.core.dist_checkpointing.utils", "_clean_metadata_for_serialization",
             ("metadata",), user="training/checkpointing.py"),
    Expected("megatron.core.transformer.transformer_layer", "get_transformer_layer_offset",
             ("config", "vp_stage", "pp_rank"), user="training/layer_numbers.py (wrapped)"),
    Expected("megatron.core.transformer.transformer_block", "get_num_layers_to_build",
             ("config", "vp_stage", "pp_rank"), user="training/layer_numbers.py (wrapped)"),
    Expected("megatron.core.transformer.module", "float16_to_fp32", user="training/build.py"),
    Expected("megatron.core.transformer.module", "fp32_to_float16", user="training/build.py"),
)


def installed_megatron_core() -> str:
    """The installed megatron-core's version, or "unknown"."""
    for distribution in ("megatron-core", "megatron_core"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _problem(expected: Expected) -> str | None:
    """Why ``expected`` does not hold in the installed megatron-core, or None when it does."""
    try:
        owner = importlib.import_module(expected.module)
    except ImportError as error:
        return f"cannot import {expected.module} ({error})"
    if not hasattr(owner, expected.name):
        return f"{expected.qualname} is missing"
    if expected.params is None:
        return None
    try:
        found = tuple(inspect.signature(getattr(owner, expected.name)).parameters)
    except (TypeError, ValueError):
        return f"{expected.qualname} has no inspectable signature"
    ok = found == expected.params if expected.exact else set(expected.params) <= set(found)
    if ok:
        return None
    return (f"{expected.qualname}({', '.join(found)}) differs from the expected "
            f"({', '.join(expected.params)})")


def mismatches(table: tuple[Expected, ...] = MEGATRON_CORE) -> list[str]:
    """Every way the installed megatron-core differs from ``table``, in table order."""
    return [p for p in map(_problem, table) if p is not None]


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "2.7.0a0+git..." or "2.13.0+cpu"."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def _torch_problem(version: str | None = None) -> str | None:
    version = version or torch.__version__
    if _release(version) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        return (f"torch>={floor} required (torch._C._autograd._unsafe_set_version_counter "
                f"with tuples), installed {version}")
    return None


def check(table: tuple[Expected, ...] = MEGATRON_CORE) -> None:
    """Raise :class:`VersionError` (one line) unless torch is at least :data:`TORCH_FLOOR` and
    every function of ``table`` exists with the expected parameters."""
    torch_problem = _torch_problem()
    if torch_problem is not None:
        raise VersionError(f"torch: {torch_problem}")
    problems = mismatches(table)
    if not problems:
        return
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise VersionError(
        f"megatron-core: {problems[0]}{more}; megatron-2bw needs "
        f"megatron-core=={MEGATRON_CORE_PIN}, installed {installed_megatron_core()}")
