"""An explicit CPU runtime for megatron-core: CUDA calls mapped to the CPU, collectives on gloo.

megatron-core assumes a CUDA device (``torch.cuda.current_device()``, ``device="cuda"``,
``.cuda()``, CUDA RNG state, synchronize/streams/events, ``torch.cuda.FloatTensor`` type
checks); this module maps exactly those to the CPU, so the same megatron-core code trains on
CPU processes (laptops, CI, debugging).

Invariants:
  * Installed only by :func:`install`, which refuses when CUDA is available; everything
    patched is recorded and restored by :func:`uninstall`.
  * Seeding is real: the "CUDA" generator is the CPU default generator.
  * Device remapping stays active inside autograd's backward (recomputation replays forwards).

More: docs/gpu.md, "The runtime, module by module".
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install", "uninstall", "is_installed", "cuda_usable", "install_moe"]

_CPU = torch.device("cpu")
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def cuda_usable() -> bool:
    """True when this process can run on a CUDA device (a fact; the decision is
    ``device.choose_device``'s)."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False  # ints are device ordinals only on CUDA code paths; we hand out "cpu"


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU on every torch function call.

    Roughly:
        torch.empty(n, device="cuda")      -> torch.empty(n, device="cpu")
        t.cuda() / t.to("cuda")            -> t / t.to("cpu")
        t.type()                           -> "torch.cuda.FloatTensor" for a float32 t

    torch pops a mode while its handler runs, so ``loss.backward()`` reaches autograd's engine
    without it; ``_engine_with_mode`` pushes it back for the engine (recomputation replays
    forward code inside backward).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # every op of a step passes here: the common case (no device argument) first
        if func in _SPECIAL:
            return _special(func, args, kwargs or {})
        if kwargs:
            device = kwargs.get("device")
            if device is not None and _is_cuda_device(device):
                kwargs["device"] = _CPU
            return func(*args, **kwargs)
        return func(*args)


def _special(func, args: tuple, kwargs: dict):
    """Tensor.cuda, Tensor.type and Tensor.to under ``_CudaToCpuMode``."""
    if func is torch.Tensor.cuda:
        return args[0]
    if func is torch.Tensor.type and len(args) == 1 and not kwargs:
        return _CUDA_TYPE_NAMES.get(args[0].dtype, func(*args))
    if _is_cuda_device(kwargs.get("device")):
        kwargs["device"] = _CPU
    if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
        args = (args[0], _CPU, *args[2:])
    return func(*args, **kwargs)


_SPECIAL = frozenset({torch.Tensor.cuda, torch.Tensor.type, torch.Tensor.to})


class _Stream:
    """A CUDA stream stand-in: CPU work is already ordered, so every wait is immediate."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        event = event or _Event()
        event.record()
        return event

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    """A CUDA event stand-in that records wall-clock time (for megatron's timers)."""

    def __init__(self, enable_timing: bool = False, **kwargs):
        self._time = None

    def record(self, stream=None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_Event") -> float:
        return (end._time - self._time) * 1000.0


_DEFAULT_STREAM = _Stream()


class _Nvtx:
    @staticmethod
    def range_push(msg):
        pass

    @staticmethod
    def range_pop():
        pass

    @staticmethod
    @contextlib.contextmanager
    def range(msg, *args, **kwargs):
        yield


def _cuda_attribute_patches() -> dict[str, Callable]:
    """torch.cuda attributes megatron-core calls on the paths we run, mapped to the CPU."""
    return {
        "current_device": lambda: _CPU,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "Stream": _Stream,
        "Event": _Event,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "current_stream": lambda device=None: _DEFAULT_STREAM,
        "default_stream": lambda device=None: _DEFAULT_STREAM,
        "nvtx": _Nvtx,
        # The "CUDA" generator is the CPU default generator: seeding stays real.
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda state, device="cuda": torch.set_rng_state(state),
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
    }


def _engine_with_mode(mode: _CudaToCpuMode, engine_run_backward: Callable) -> Callable:
    """autograd's engine entry, run with ``mode`` on the function-mode stack."""

    def run_backward(*args, **kwargs):
        with _entered(mode):
            return engine_run_backward(*args, **kwargs)

    return run_backward


def _megatron_rng_patches() -> list[tuple[Any, str, Callable]]:
    """megatron-core's private CUDA RNG helpers, mapped to the CPU default generator."""
    from megatron.core.tensor_parallel import random as tp_random

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()  # already a copy

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    return [(tp_random, "_get_cuda_rng_state", get_state),
            (tp_random, "_set_cuda_rng_state", set_state)]


class _Installed:
    """What install() changed, so uninstall() can put it back."""

    def __init__(self):
        self.saved: list[tuple[Any, str, Any]] = []
        self.log_filters: list[tuple[logging.Logger, logging.Filter]] = []
        self.mode: _CudaToCpuMode | None = None

    def patch(self, owner: Any, name: str, value: Any) -> None:
        self.saved.append((owner, name, getattr(owner, name, None)))
        setattr(owner, name, value)


_installed: _Installed | None = None


def is_installed() -> bool:
    return _installed is not None


def install(force: bool = False) -> None:
    """Map megatron-core's CUDA calls to the CPU for this process. Idempotent.

    Raises RuntimeError on a machine where CUDA is usable unless ``force`` (the user's ``--cpu``):
    by default the GPU path is the only one there.
    """
    global _installed
    if _installed is not None:
        return
    if cuda_usable() and not force:
        raise RuntimeError("the CPU runtime is not installed on a machine with CUDA; pass --cpu")
    state = _Installed()
    _disable_megatron_jit_fuser(state)
    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    log_filter = _SameGeneratorWarningFilter()
    logger.addFilter(log_filter)
    state.log_filters.append((logger, log_filter))
    for name, value in _cuda_attribute_patches().items():
        state.patch(torch.cuda, name, value)
    for owner, name, value in _megatron_rng_patches():
        state.patch(owner, name, value)
    state.mode = _CudaToCpuMode()
    state.patch(torch.autograd, "_engine_run_backward",
                _engine_with_mode(state.mode, torch.autograd._engine_run_backward))
    state.mode.__enter__()
    _installed = state


def install_moe() -> None:
    """The MoE token dispatcher's host copies on the CPU (after :func:`install`; idempotent).

    megatron-core's alltoall dispatcher moves its split sizes to the host with
    ``moe_utils.maybe_move_tensor_to_cpu``, which converts CUDA tensors only (to numpy when
    asked): on the CPU they stay tensors, and gloo's ``all_to_all_single`` refuses tensors as
    split sizes. Here a CPU tensor gets what a CUDA one gets: the numpy array when asked,
    itself otherwise."""
    from megatron.core.transformer.moe import token_dispatcher

    if _installed is None:
        raise RuntimeError("install_moe() before install()")
    original = token_dispatcher.maybe_move_tensor_to_cpu
    if getattr(original, "_cpu_runtime", False):
        return

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    to_host._cpu_runtime = True
    _installed.patch(token_dispatcher, "maybe_move_tensor_to_cpu", to_host)


def _entered(mode: "_CudaToCpuMode | None"):
    """``mode`` as a context, or a no-op when it is None or already on this thread's stack."""
    import contextlib

    if mode is None or mode in torch.overrides._get_current_function_mode_stack():
        return contextlib.nullcontext()
    return mode


def uninstall() -> None:
    """Undo :func:`install` (tests use it; training processes keep the runtime to the end)."""
    global _installed
    if _installed is None:
        return
    _installed.mode.__exit__(None, None, None)
    for owner, name, value in reversed(_installed.saved):
        setattr(owner, name, value)
    for logger, log_filter in _installed.log_filters:
        logger.removeFilter(log_filter)
    _installed = None


class _SameGeneratorWarningFilter(logging.Filter):
    """megatron's RNG tracker warns when the CPU generator changes inside a "CUDA" RNG fork;
    here the two are one generator by design, so that warning carries no information."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _disable_megatron_jit_fuser(state: _Installed) -> None:
    """megatron-core decorates fusable functions with torch.compile; compiling them on CPU costs
    minutes of start-up for no gain on tiny models. Must run before model modules are imported."""
    from megatron.core import jit

    state.patch(jit, "jit_fuser", jit.noop_decorator)
