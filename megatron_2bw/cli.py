"""What the command-line tools under ``tools/`` share: bad input ends a tool with ONE line.

Invariant: a tool given bad input (a flag out of range, a missing or unparsable input file, an
output folder it cannot write) prints exactly one line ``error: <flag or file>: <what is
wrong>`` to stderr and exits with code 2: no argparse usage block, no traceback. A bug in the
tool still ends in a traceback: only user errors are caught.

:class:`ToolParser` is argparse whose errors raise :class:`FlagError` naming the flag; the
``type=`` helpers (:func:`positive_int`, :func:`existing_file`, :func:`writable_dir`, ...)
reject a value at parse time; :func:`reading` turns an unreadable input into a
:class:`ToolError` naming the flag and the file; :func:`main_guard` turns every user error into
the one line, also when a test calls a tool's ``main`` in-process. This module imports nothing
heavy (no torch, no megatron-core), so a tool that parses its flags first fails fast.
See docs/checkpoints_and_faults.md, "Bad flags and bad data".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Sequence

from megatron_2bw.arguments import SCHEDULES, _Parser, parse_args
from megatron_2bw.data.errors import DataError
from megatron_2bw.flag_types import (CORRECTION_RULES, FlagError, _writable_folder,
                                     int_at_least, number_in, require_writable_dir, writable_dir)

__all__ = ["EXIT_USAGE", "add_model_size_flags", "FlagError", "ToolError", "ToolParser",
           "RunName", "run_name", "check_training_flags",
           "comma_list", "existing_dir", "existing_file", "fraction", "main_guard",
           "nonneg_float", "nonneg_int", "output_file", "output_prefix", "positive_float",
           "positive_int", "reading", "require_writable_dir", "writable_dir"]

EXIT_USAGE = 2
"""The exit code of every user error (argparse's own code for a bad command line)."""


class ToolError(FlagError):
    """A bad input to a tool; ``what`` is the flag or file to fix, ``str()`` the line after
    ``error: `` (``what: message``)."""

    def __init__(self, what: str, message: str):
        super().__init__(str(what), message)

    @property
    def what(self) -> str:
        return self.flag


class ToolParser(_Parser):
    """argparse whose every error raises :class:`FlagError` naming a flag, never printing the
    usage block; subparsers made with :meth:`add_subparsers` are ToolParsers too."""

    _REQUIRED = re.compile(r"the following arguments are required: ([^,\s]+)(?:, )?(.*)")
    _ONE_OF = re.compile(r"one of the arguments (.*) is required")
    _AMBIGUOUS = re.compile(r"ambiguous option: (\S+?)(?:=\S*)? (could match .*)")

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # as the training entry: flags are spelled out
        super().__init__(*args, **kwargs)

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", ToolParser)
        return super().add_subparsers(**kwargs)

    def error(self, message: str) -> NoReturn:
        required = self._REQUIRED.match(message)
        if required:
            others = f"; also missing {required.group(2)}" if required.group(2) else ""
            raise FlagError(required.group(1), f"is required{others}; see --help")
        one_of = self._ONE_OF.match(message)
        if one_of:
            flags = one_of.group(1).split()
            raise FlagError(flags[0], f"give one of {' '.join(flags)}; see --help")
        ambiguous = self._AMBIGUOUS.match(message)
        if ambiguous:
            raise FlagError(ambiguous.group(1), f"is ambiguous ({ambiguous.group(2)})")
        super().error(message)


# ---- argparse type= helpers: each returns the converted value or raises ArgumentTypeError ----

positive_int = int_at_least(1)
"""An integer >= 1 (a count)."""
nonneg_int = int_at_least(0)
positive_float = number_in(0, low_open=True)
"""A finite number > 0."""
nonneg_float = number_in(0)
fraction = number_in(0, 1, low_open=True)
"""A number in (0, 1]."""


def add_model_size_flags(parser: argparse.ArgumentParser, *, num_layers: int,
                         micro_batch_size: int, hidden_size: int = 256,
                         num_attention_heads: int = 4, seq_length: int = 128) -> None:
    """The training flags of a tool's model and micro batch, with the tool's defaults."""
    for flag, default in (("--num-layers", num_layers), ("--hidden-size", hidden_size),
                          ("--num-attention-heads", num_attention_heads),
                          ("--seq-length", seq_length), ("--micro-batch-size", micro_batch_size)):
        parser.add_argument(flag, type=positive_int, default=default)


def comma_list(item: Callable, choices: Sequence[str] | None = None) -> Callable:
    """A ``type=`` for a non-empty comma-separated list; each item converted by ``item`` (a
    ``type=`` itself) and, with ``choices``, one of them. Returns a tuple."""

    def parse(text: str) -> tuple:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        bad = [part for part in parts if choices is not None and part not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, bad))} in {text!r}; choose from "
                f"{','.join(choices)}")
        return tuple(item(part) for part in parts)

    return parse


def existing_file(text: str) -> str:
    """A path to an existing, readable file (not a folder)."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file, got the folder {text!r}")
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not readable")
    return text


def existing_dir(text: str) -> str:
    """A path to an existing folder."""
    if not os.path.isdir(text):
        what = "is a file, not a folder" if os.path.exists(text) else "no such folder"
        raise argparse.ArgumentTypeError(f"{what}: {text!r}")
    return text


def output_prefix(text: str) -> str:
    """A file name prefix (``PREFIX.model``, ``PREFIX_text_document.bin``) whose folder is
    writable."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file name prefix, got ''")
    _writable_folder(Path(text).absolute().parent, text)
    return text


def output_file(text: str) -> Path:
    """A file path the tool can write: not a folder, and its folder is writable."""
    path = Path(text)
    if not text or text.endswith(os.sep) or path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file name, got the folder {text!r}")
    _writable_folder(path.absolute().parent, text)
    return path


# ---- inputs read after parsing ----------------------------------------------------------------

@contextlib.contextmanager
def reading(what: str, path: str | os.PathLike | None = None) -> Iterator[None]:
    """Inside: an input that cannot be read or parsed (OSError; ValueError, JSON errors
    included; a KeyError or TypeError from a malformed record) raises :class:`ToolError`
    naming ``what`` (the flag) and ``path``. Keep the block to reading and parsing only."""
    try:
        yield
    except (FlagError, DataError):
        raise
    except OSError as err:
        raise ToolError(what, f"{path or err.filename}: {err.strerror or err}") from err
    except (ValueError, KeyError, TypeError) as err:
        if isinstance(err, json.JSONDecodeError):
            detail = f"not valid JSON ({err})"
        elif isinstance(err, KeyError):
            detail = f"a record lacks the field {err}"
        elif isinstance(err, TypeError):
            detail = f"a record has the wrong fields or types ({err})"
        else:
            detail = str(err) or type(err).__name__
        shown = "" if path is None or str(path) in detail else f"{path}: "
        raise ToolError(what, shown + detail) from err


def check_training_flags(flags: Sequence[str], world_size: int, what: str,
                         parser: argparse.ArgumentParser | None = None,
                         rename: dict[str, str] | None = None) -> argparse.Namespace:
    """The parsed training command line, validated by the training entry's own validator
    (``parser``: the entry script's, default GPT's) before anything runs. A bad one raises
    :class:`ToolError` naming the training flag, or the tool's flag that set it
    (``rename[training flag]``), and ``what`` (the run it belongs to)."""
    try:
        return parse_args(list(flags), world_size=world_size, parser=parser)
    except FlagError as err:
        message = str(err)[len(err.flag) + 2:]
        raise ToolError((rename or {}).get(err.flag, err.flag), f"{what}: {message}") from None


# ---- the one error line -----------------------------------------------------------------------

_USER_ERRORS = (FlagError, DataError, FileNotFoundError, PermissionError, IsADirectoryError,
                NotADirectoryError, json.JSONDecodeError)


def _one_line(err: BaseException) -> str:
    """``<flag or file>: <what is wrong>`` on one line."""
    if isinstance(err, OSError) and err.filename is not None:
        text = f"{err.filename}: {err.strerror or err}"
    elif isinstance(err, json.JSONDecodeError):
        text = f"input: not valid JSON ({err})"
    else:
        text = str(err)
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


def main_guard(main: Callable) -> Callable:
    """``main`` as a command: a user error raised inside (bad flag, data error, missing or
    unparsable file, :class:`ToolError`) prints one ``error:`` line to stderr and raises
    ``SystemExit(2)``; any other exception (a bug) propagates with its traceback."""

    @functools.wraps(main)
    def guarded(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except _USER_ERRORS as err:
            sys.stdout.flush()
            print(f"error: {_one_line(err)}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_USAGE) from None

    return guarded


T2_SCHEDULE = "pipemare-t2"
"""The run name of PipeMare with its discrepancy correction T2."""
OPTIMIZERS = ("adam", "muon", "dist_muon")
STALE_RULES = CORRECTION_RULES[1:]
"""The corrections a run name may give (all but none)."""


@dataclasses.dataclass(frozen=True)
class RunName:
    """A run the tools compare, named SCHEDULE[-CORRECTION][+OPTIMIZER]: ``2bw-ef+muon`` is
    2bw with --stale-weight-correction ef and --optimizer muon, ``flush`` flush with Adam,
    ``pipemare-t2`` pipemare with its discrepancy correction T2."""

    name: str
    schedule: str
    correction: str | None = None
    optimizer: str = "adam"

    @classmethod
    def parse(cls, name: str) -> "RunName":
        """The run ``name``; argparse.ArgumentTypeError saying what is wrong with it."""
        base, _, optimizer = name.partition("+")
        optimizer = optimizer or "adam"
        if optimizer not in OPTIMIZERS:
            raise argparse.ArgumentTypeError(f"unknown optimizer {optimizer!r} in {name!r}; "
                                             f"choose from {','.join(OPTIMIZERS)}")
        schedule, _, correction = base.rpartition("-")
        if correction not in STALE_RULES:
            schedule, correction = base, None
        if schedule not in (*SCHEDULES, T2_SCHEDULE):
            raise argparse.ArgumentTypeError(
                f"unknown schedule {schedule!r} in {name!r}; choose from "
                f"{','.join((*SCHEDULES, T2_SCHEDULE))}, then -CORRECTION and +OPTIMIZER")
        if correction and schedule != "2bw":
            raise argparse.ArgumentTypeError(f"{name!r}: a correction applies to 2bw only")
        return cls(name, schedule, correction, optimizer)

    @property
    def real_schedule(self) -> str:
        """Its --pipeline-schedule."""
        return "pipemare" if self.schedule == T2_SCHEDULE else self.schedule

    def flags(self, t2_decay: float = 0.9, coefficients: dict | None = None) -> list[str]:
        """Its --pipeline-schedule, --pipemare-discrepancy-decay, --stale-weight-correction
        (with a coefficient from ``coefficients``, by rule) and --optimizer flags."""
        flags = ["--pipeline-schedule", self.real_schedule]
        if self.schedule == T2_SCHEDULE:
            flags += ["--pipemare-discrepancy-decay", f"{t2_decay:g}"]
        if self.correction:
            flags += ["--stale-weight-correction", self.correction]
            coeff = (coefficients or {}).get(self.correction)
            if coeff is not None:
                flags += ["--stale-weight-correction-coeff", f"{coeff:g}"]
        if self.optimizer != "adam":
            flags += ["--optimizer", self.optimizer]
        return flags

    def reference(self, reference: str) -> str:
        """The run ``reference`` (a schedule) with this run's optimizer."""
        return reference if self.optimizer == "adam" else f"{reference}+{self.optimizer}"


def run_name(text: str) -> str:
    """A ``type=`` for a run name (:class:`RunName`)."""
    return RunName.parse(text).name

