"""Eager checks of Megatron indexed datasets (`{prefix}.bin` + `{prefix}.idx`).

megatron-core opens these files deep inside dataset building, where a bad file surfaces as an
assert or a NumPy error. `check_indexed_dataset` reads only the `.idx` and the `.bin` size, and
raises `DataError` naming the flag before any dataset is built.

The `.idx` layout written by megatron-core's `_IndexWriter` (all little-endian):

    b"MMIDIDX\\x00\\x00"   9-byte magic header
    <Q version = 1     <B dtype code     <Q sequence count S     <Q document count D
    int32[S] sequence lengths (tokens)   int64[S] byte offsets into .bin
    int64[D] document boundaries (sequence indices: 0, ..., S)
"""

import os
import struct
from dataclasses import dataclass

import numpy

from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType
from megatron_2bw.data.errors import DataError

_FIXED_BYTES = len(_INDEX_HEADER) + 8 + 1 + 8 + 8


@dataclass(frozen=True)
class IndexedDatasetSummary:
    """What a valid `.idx` describes."""

    dtype: type
    num_sequences: int
    num_documents: int
    num_tokens: int


def check_indexed_dataset(prefix: str, flag: str = "--data-path") -> IndexedDatasetSummary:
    """Validate the pair `{prefix}.idx` / `{prefix}.bin`; raise DataError naming `flag`.

    Checks: both files exist; the magic header, version and dtype code; the `.idx` size equals
    the size its counts imply; document boundaries run from 0 to S without going backwards;
    byte offsets are the running sum of the lengths; the `.bin` size is exactly the tokens
    times the dtype size.
    """
    idx_path, bin_path = f"{prefix}.idx", f"{prefix}.bin"
    _check_exists(prefix, idx_path, bin_path, flag)
    with open(idx_path, "rb") as f:
        header = f.read(_FIXED_BYTES)
    dtype, num_sequences, num_documents = _parse_header(header, idx_path, flag)
    lengths, pointers, boundaries = _map_arrays(idx_path, num_sequences, num_documents, flag)
    _check_arrays(lengths, pointers, boundaries, DType.size(dtype), idx_path, flag)
    num_tokens = int(lengths.sum(dtype=numpy.int64))
    expected_bin = num_tokens * DType.size(dtype)
    if os.path.getsize(bin_path) != expected_bin:
        raise DataError(
            flag,
            f"{bin_path} has {os.path.getsize(bin_path)} bytes but {idx_path} describes "
            f"{num_tokens} tokens of {DType.size(dtype)} bytes ({expected_bin} bytes); "
            "the pair is truncated or from different runs",
        )
    return IndexedDatasetSummary(dtype, num_sequences, num_documents - 1, num_tokens)


def _check_exists(prefix: str, idx_path: str, bin_path: str, flag: str) -> None:
    missing = [p for p in (idx_path, bin_path) if not os.path.isfile(p)]
    if missing:
        hint = " (give the prefix, without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
        found = " and ".join(missing)
        raise DataError(flag, f"{found} not found for dataset prefix {prefix}{hint}")


def _parse_header(header: bytes, idx_path: str, flag: str) -> tuple[type, int, int]:
    """Return (dtype, sequence count, document boundary count) from the fixed-size header."""
    if header[: len(_INDEX_HEADER)] != _INDEX_HEADER:
        raise DataError(
            flag, f"{idx_path} is not a Megatron indexed dataset index (bad magic header)"
        )
    if len(header) < _FIXED_BYTES:
        raise DataError(
            flag, f"{idx_path} is truncated: {len(header)} bytes, the header is {_FIXED_BYTES}"
        )
    version, code, num_sequences, num_documents = struct.unpack_from(
        "<QBQQ", header, len(_INDEX_HEADER)
    )
    if version != 1:
        raise DataError(flag, f"{idx_path} has index version {version}, expected 1")
    if code not in {d.value for d in DType}:
        raise DataError(flag, f"{idx_path} has unknown dtype code {code}")
    return DType.dtype_from_code(code), num_sequences, num_documents


def _map_arrays(idx_path: str, num_sequences: int, num_documents: int, flag: str):
    """Return (lengths, byte offsets, document boundaries), memory-mapped, after checking the
    `.idx` size against the counts in its header."""
    expected = _FIXED_BYTES + num_sequences * (4 + 8) + num_documents * 8
    size = os.path.getsize(idx_path)
    if size != expected:
        raise DataError(
            flag,
            f"{idx_path} is truncated or corrupt: {size} bytes, expected {expected} for "
            f"{num_sequences} sequences and {num_documents} document boundaries",
        )
    raw = numpy.memmap(idx_path, dtype=numpy.uint8, mode="r")
    lengths = numpy.frombuffer(raw, numpy.int32, num_sequences, _FIXED_BYTES)
    offset = _FIXED_BYTES + lengths.nbytes
    pointers = numpy.frombuffer(raw, numpy.int64, num_sequences, offset)
    boundaries = numpy.frombuffer(raw, numpy.int64, num_documents, offset + pointers.nbytes)
    return lengths, pointers, boundaries


def _check_arrays(lengths, pointers, boundaries, itemsize: int, idx_path: str, flag: str) -> None:
    if (lengths < 0).any():
        raise DataError(flag, f"{idx_path} is corrupt: negative sequence length")
    starts = numpy.concatenate([[0], numpy.cumsum(lengths[:-1], dtype=numpy.int64)]) * itemsize
    if len(lengths) and not numpy.array_equal(pointers, starts):
        raise DataError(flag, f"{idx_path} is corrupt: sequence offsets do not match lengths")
    if len(boundaries) == 0 or boundaries[0] != 0 or boundaries[-1] != len(lengths):
        raise DataError(
            flag, f"{idx_path} is corrupt: document boundaries must run from 0 to {len(lengths)}"
        )
    if (numpy.diff(boundaries) < 0).any():
        raise DataError(flag, f"{idx_path} is corrupt: document boundaries go backwards")
