"""Shared test set-up: one thread per process, the strict NCCL mode in every child process, a
tiny GPT dataset built once per session, and the ``fast`` marker.

Every child process inherits OMP_NUM_THREADS=1 (CI has 2 cores and the multi-process tests
run 2 processes each: more threads only make them contend), and PYTHONPATH with
``tests/strict`` first, whose ``sitecustomize`` installs strict NCCL mode before anything else
runs (off with ``MEGATRON_2BW_STRICT=0``). After each test the collectives recorded by the runs
it started are compared member by member; a disagreement fails the test (records no test read,
at the end of the session: a disagreement there fails the session).

`make test-fast` runs the tests marked ``fast`` (`FAST`): the unit tests, which start no
training process, and one exactness run of every schedule. docs/testing.md says more.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):  # pytest -n N: a port range each,
    _worker = int(os.environ["PYTEST_XDIST_WORKER"][2:])  # below the OS's ephemeral ports
    os.environ["MEGATRON_2BW_PORT_RANGE"] = f"{20000 + 2000 * _worker}-{21999 + 2000 * _worker}"

STRICT_DIR = Path(__file__).resolve().parent / "strict"
if os.environ.get("MEGATRON_2BW_STRICT", "1") != "0":
    os.environ["MEGATRON_2BW_STRICT_DIR"] = tempfile.mkdtemp(prefix="megatron-2bw-strict-")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(STRICT_DIR), os.environ.get("PYTHONPATH")) if p)

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

TINY_CORPUS_CHARS = 200_000
TINY_VOCAB = 512


@dataclass(frozen=True)
class TinyData:
    """A GPT indexed dataset, its sentencepiece model, and a directory for megatron-core's
    index caches (shared by the runs of a session, so only the first run builds them)."""

    data_prefix: str
    tokenizer_model: str
    vocab_size: int
    index_cache: str

    def flags(self) -> list[str]:
        return ["--data-path", self.data_prefix, "--tokenizer-model", self.tokenizer_model,
                "--data-cache-path", self.index_cache]


@pytest.fixture(scope="session")
def tiny_gpt_data(tmp_path_factory) -> TinyData:
    """Standard-library source text (200 kB) -> 512-piece BPE -> GPT .bin/.idx, in ~5 s."""
    from megatron_2bw.data.corpus import build_corpus
    from megatron_2bw.data.preprocess import preprocess_jsonl
    from megatron_2bw.data.tokenizer import train_sentencepiece

    root = tmp_path_factory.mktemp("tiny_gpt_data")
    corpus = str(root / "corpus.jsonl")
    assert build_corpus(corpus, max_chars=TINY_CORPUS_CHARS) > 0
    model = train_sentencepiece(corpus, str(root / "tokenizer"), TINY_VOCAB)
    prefix = preprocess_jsonl(corpus, str(root / "gpt"), "GPTSentencePieceTokenizer", model,
                              append_eod=True)["text"]
    return TinyData(prefix, model, TINY_VOCAB, str(root / "index-cache"))


@pytest.fixture(scope="session")
def example_data(tmp_path_factory) -> Path:
    """scripts/examples/prepare_data.py's tokenizer files (GPT-2 BPE, WordPiece, a HuggingFace
    folder) and indexed datasets, built once for the session (~12 s)."""
    from tests import dist as launch

    root = tmp_path_factory.mktemp("example_data")
    done = launch.python([str(launch.REPO / "scripts" / "examples" / "prepare_data.py"),
                          str(root)], timeout=120)
    assert done.returncode == 0, done.tail()
    return root


FAST = (
    # unit tests: schedules as data, the simulator, the planner, flags, parsers, tokenizers
    "tests/test_compare.py::", "tests/test_flag_table.py::", "tests/test_fusions.py::",
    "tests/test_host_waits.py::", "tests/test_import_layers.py::",
    "tests/test_interleaved_data.py::", "tests/test_layer_split.py::", "tests/test_moe.py::",
    "tests/test_planner.py::", "tests/test_planner_megatron_memory.py::",
    "tests/test_planner_moe.py::", "tests/test_planner_published.py::",
    "tests/test_planner_split.py::", "tests/test_planner_structure.py::",
    "tests/test_schedules_data.py::", "tests/test_schedules_nccl.py::",
    "tests/test_tokenizers.py::", "tests/test_trace.py::", "tests/test_versions.py::",
    "tests/test_vshape.py::", "tests/test_weights.py::", "tests/test_wgrad.py::",
    # one exactness run of every schedule against its single-process reference, in one launch
    # group of 2 processes: the loop, virtual stages and the V, each on an uneven split
    "tests/test_layouts_exact.py::",
)
"""Node-id prefixes of the tests `make test-fast` runs (marked ``fast``), but FAST_EXCEPT."""
FAST_EXCEPT = (
    "tests/test_planner.py::test_every_combination_the_planner_accepts_launches",
    "tests/test_planner.py::test_written_launch_script_trains_from_another_folder",
    "tests/test_planner_moe.py::test_every_feasible_moe_layout_passes_the_trainings_validation",
    "tests/test_planner.py::test_gpt3_175b_on_1024_h100s_plans_fast",
)
"""Tests under FAST that train, validate every feasible layout (9 s), or hold a wall-clock bound
that a machine busy with other runs breaks: `make test` only."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "fast: in `make test-fast` (unit tests and one exactness run per schedule)")


def _fast_only(config) -> bool:
    return config.getoption("markexpr", "") == "fast"


def pytest_ignore_collect(collection_path, config):
    """Under ``-m fast`` a test module without fast tests is not even imported."""
    if _fast_only(config) and collection_path.suffix == ".py" \
            and collection_path.name.startswith("test_"):
        module = collection_path.relative_to(config.rootpath).as_posix() + "::"
        if module not in FAST:
            return True
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(FAST) and not item.nodeid.startswith(FAST_EXCEPT):
            item.add_marker(pytest.mark.fast)


_records = None


@pytest.fixture(autouse=True)
def strict_collectives():
    """Fail the test when the members of a process group that one of its runs created issued
    different collectives (op, shape, dtype), in strict mode."""
    global _records
    yield
    directory = os.environ.get("MEGATRON_2BW_STRICT_DIR")
    if os.environ.get("MEGATRON_2BW_STRICT", "1") == "0" or not directory:
        return
    from tests.strict import strict_comm

    _records = _records or strict_comm.Records(directory)
    problems = _records.problems(_records.update())
    if problems:
        pytest.fail("strict NCCL mode: members of a group issued different collectives:\n"
                    + "\n".join(problems), pytrace=False)


def pytest_sessionfinish(session, exitstatus):
    """Records no test's check read (written after the last one, e.g. by a fixture's teardown)
    are checked here: a disagreement fails the session. The records' directory is removed after
    a session that passed, and kept (its path reported) where strict mode found something."""
    directory = os.environ.get("MEGATRON_2BW_STRICT_DIR")
    if os.environ.get("MEGATRON_2BW_STRICT", "1") == "0" or not directory \
            or not Path(directory).name.startswith("megatron-2bw-strict-"):
        return
    from tests.strict import strict_comm

    records = _records or strict_comm.Records(directory)
    problems = records.problems(records.update())
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if problems:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line("strict NCCL mode: members of a group issued different "
                                f"collectives (records in {directory}):", red=True)
            for problem in problems:
                reporter.write_line("  " + problem, red=True)
    elif exitstatus == pytest.ExitCode.OK:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
