"""megatron-core chooses its fuser when ``megatron.core.jit`` is imported (``jit_fuser =
torch.compile``), and decorating its fused kernels with ``torch.compile`` imports TorchDynamo
and Inductor: more than a second of every process's start-up on a small CPU machine. The CPU
runtime replaces ``jit_fuser`` with megatron's no-op decorator anyway
(``cpu._disable_megatron_jit_fuser``), but only once megatron-core is imported and the
decorators have run.

:func:`register` makes that choice at the import itself, on machines without a usable CUDA
device only: while ``megatron.core.jit`` executes, ``torch.compile`` is the identity decorator,
so ``jit_fuser`` is that identity and megatron-core's fused functions stay plain functions (as
the CPU runtime would leave them). ``torch.compile`` is restored as soon as the module has run.
Where CUDA is usable the import is untouched and the GPU path keeps ``torch.compile``.
"""

from __future__ import annotations

import importlib.machinery
import sys

__all__ = ["register"]

_JIT_MODULE = "megatron.core.jit"


def register() -> None:
    """Install the one-shot import hook (idempotent; a no-op once megatron-core's jit module is
    imported)."""
    if _JIT_MODULE in sys.modules or any(isinstance(f, _JitImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitImport())


def _identity_decorator(fn=None, **_options):
    return fn if fn is not None else _identity_decorator


def _cuda_usable() -> bool:
    from megatron_2bw.runtime.cpu import cuda_usable

    return cuda_usable()


class _JitImport:
    """Finds ``megatron.core.jit`` as the path finder does and, without CUDA, wraps its loader."""

    def find_spec(self, name, path, target=None):
        if name != _JIT_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None and not _cuda_usable():
            spec.loader = _WithoutCompile(spec.loader)
        return spec


class _WithoutCompile:
    """Executes a module while ``torch.compile`` is the identity decorator."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        import torch

        compile_ = torch.compile
        torch.compile = _identity_decorator
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = compile_
