"""The leaf of the argument layer: :class:`FlagError`, what a bad flag raises, and the argparse
types that check one value (a number in range, a writable folder). Standard library only, so
every layer can raise a flag error or check a flag's value without importing the parser
(megatron_2bw.arguments) or anything above it.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

__all__ = ["FlagError", "int_at_least", "number_in", "writable_dir", "require_writable_dir",
           "CORRECTION_RULES"]

CORRECTION_RULES = ("none", "predict", "dc", "ef")
"""--stale-weight-correction's values (megatron_2bw.corrections holds the rules), here so that
the parsers know them without importing torch."""


class FlagError(ValueError):
    """A bad command-line flag; ``str()`` is the one line the user sees."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def int_at_least(low: int):
    """An argparse type: an integer >= ``low`` (the message names the bound and the value)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def number_in(low: float, high: float = math.inf, low_open: bool = False,
              high_open: bool = False):
    """An argparse type: a finite number in the interval from ``low`` to ``high``, each end
    open or closed as asked (``high=inf``: no upper bound)."""
    interval = (f"{'(' if low_open else '['}{low:g}, "
                f"{'inf)' if high == math.inf else f'{high:g}' + (')' if high_open else ']')}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        inside = (math.isfinite(value) and (value > low if low_open else value >= low)
                  and (value < high if high_open else value <= high))
        if not inside:
            raise argparse.ArgumentTypeError(f"expected a finite number in {interval}, "
                                             f"got {text!r}")
        return value

    parse.__name__ = f"number in {interval}"
    return parse


def _probe(folder: Path, shown: str) -> None:
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise argparse.ArgumentTypeError(
            f"cannot write into {str(folder)!r} ({err.strerror or err}) for {shown!r}") from None


def _writable_folder(folder: Path, shown: str) -> None:
    """``folder`` exists and takes a temporary file, or does not exist yet and its nearest
    existing ancestor is such a folder (the tool creates it); ``shown`` is the value the
    user gave. Nothing is left behind by the check."""
    ancestor = folder.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise argparse.ArgumentTypeError(f"{str(ancestor)!r} is a file, not a folder, so "
                                         f"{shown!r} cannot be written")
    _probe(ancestor, shown)


def writable_dir(text: str) -> Path:
    """A folder the tool can write into (see :func:`_writable_folder`), not a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a folder, got the file {text!r}")
    _writable_folder(path, text)
    return path


def require_writable_dir(flag: str, value: str) -> None:
    """A training run's output folder (``--save``, ``--tensorboard-dir``, ...) is checked as
    :func:`writable_dir` checks a tool's, before anything starts; raises FlagError naming
    ``flag``."""
    try:
        writable_dir(value)
    except argparse.ArgumentTypeError as error:
        raise FlagError(flag, str(error)) from None
