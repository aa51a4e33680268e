"""``scripts/gpu_check.py --cpu``: every part of the single-GPU check runs end to end (tiny sizes,
gloo, one process), so the script a lent GPU runs in one call cannot rot in between.

One run of the script (about 30 s); each part's row of its table and summary.json is checked
on its own. What the rows assert is the script's (flush's losses equal megatron's and 2bw's
only at the first iteration; a resumed run's losses equal the uninterrupted run's; gradients
after a version switch bit-equal to a no-step reference; the deferred step's weights equal the
in-place step's and its gradient copy is one fp32 buffer of the stage's parameters), each
against an independent run, never the code's own output.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.dist import python

PARTS = ("matmul", "train", "resume", "versions", "deferred", "waits", "profile")


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu_check")
    launch = python(["scripts/gpu_check.py", "--cpu", "--out", str(out)], timeout=240)
    summary = out / "summary.json"
    assert summary.exists(), f"exit {launch.returncode}:\n{launch.tail()}"
    return json.loads(summary.read_text()), launch.output


def test_the_table_comes_last_with_a_row_per_part(check):
    rows, output = check
    assert list(rows) == list(PARTS)
    table = output[output.rindex("part      result"):].splitlines()
    assert [line.split()[0] for line in table[1:]] == list(PARTS), output[-3000:]
    for line, name in zip(table[1:], PARTS):
        assert re.match(rf"{name}\s+(OK|FAIL)\s+\d+\.\d", line), line


@pytest.mark.parametrize("part", PARTS)
def test_part_passes(check, part):
    rows, _ = check
    assert rows[part]["ok"], f"{part}: {rows[part]['summary']}"


def test_train_compares_the_three_schedules(check):
    """Each schedule trained every iteration; flush equals megatron at every one, 2bw at the
    first only (the 1-stale rule)."""
    runs = check[0]["train"]["runs"]
    megatron, flush, twobw = (runs[s]["losses"] for s in ("megatron", "flush", "2bw"))
    assert len(megatron) == len(flush) == len(twobw) >= 3
    assert flush == megatron
    assert twobw[0] == megatron[0] and twobw[1:] != megatron[1:]
