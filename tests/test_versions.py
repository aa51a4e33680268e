"""The start-up check of the megatron-core (and torch) pieces megatron-2bw calls.

References: the installed megatron-core 0.16.1 (the pin) passes; a function removed or given
other parameter names (monkeypatch) fails with one line naming the pin and the installed
version; through the entry script that line is the only error line, exit code 2, no traceback.
"""

from __future__ import annotations

import importlib
import textwrap

import pytest

from megatron_2bw.runtime import cpu, versions
from tests import dist as launch

FINALIZE = "megatron.core.distributed.finalize_model_grads"


@pytest.fixture(scope="module", autouse=True)
def cpu_runtime_first():
    """As in the entry scripts, the CPU runtime (which turns off megatron-core's torch.compile
    decorators) is in place before the check imports megatron-core's modules."""
    was_installed = cpu.is_installed()
    if not cpu.cuda_usable():
        cpu.install()
    yield
    if not was_installed:
        cpu.uninstall()


def _one_line(error: versions.VersionError) -> str:
    text = str(error)
    assert "\n" not in text, text
    return text


def test_installed_megatron_core_passes():
    assert versions.installed_megatron_core() == versions.MEGATRON_CORE_PIN
    assert versions.mismatches() == []
    versions.check()


def test_every_private_name_we_import_is_in_the_table():
    """Each ``from megatron.core... import _name`` in megatron_2bw is checked at start-up."""
    import ast
    from pathlib import Path

    package = Path(versions.__file__).resolve().parents[1]
    imported = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.core"):
                imported |= {alias.name for alias in node.names if alias.name.startswith("_")}
    assert imported, "no private megatron-core import found: the scan reads nothing"
    assert imported <= {e.name for e in versions.MEGATRON_CORE}, imported


def test_missing_function_fails_with_one_line(monkeypatch):
    module = importlib.import_module(FINALIZE)
    monkeypatch.delattr(module, "_allreduce_non_tensor_model_parallel_grads")
    with pytest.raises(versions.VersionError) as caught:
        versions.check()
    line = _one_line(caught.value)
    assert line.startswith("megatron-core: ")
    assert f"{FINALIZE}._allreduce_non_tensor_model_parallel_grads is missing" in line
    assert "megatron-core==0.16.1" in line and "installed 0.16.1" in line


def test_changed_signature_fails_with_one_line(monkeypatch):
    module = importlib.import_module(FINALIZE)
    monkeypatch.setattr(module, "reset_model_temporary_tensors", lambda model, config: None)
    with pytest.raises(versions.VersionError) as caught:
        versions.check()
    line = _one_line(caught.value)
    assert ("reset_model_temporary_tensors(model, config) differs from the expected "
            "(config, model)") in line
    assert "megatron-core==0.16.1" in line


def test_several_problems_still_one_line(monkeypatch):
    module = importlib.import_module(FINALIZE)
    monkeypatch.delattr(module, "_allreduce_non_tensor_model_parallel_grads")
    monkeypatch.delattr(module, "reset_model_temporary_tensors")
    with pytest.raises(versions.VersionError) as caught:
        versions.check()
    assert "(and 1 more)" in _one_line(caught.value)


def test_parameters_we_pass_by_name_need_only_be_present(monkeypatch):
    from megatron.core import parallel_state as ps

    def fewer(tensor_model_parallel_size=1, pipeline_model_parallel_size=1):
        pass

    monkeypatch.setattr(ps, "initialize_model_parallel", fewer)
    assert any("distributed_timeout_minutes" in p for p in versions.mismatches())


@pytest.mark.parametrize("version, ok", [
    ("2.13.0+cpu", True), ("2.7.0", True), ("2.7.0a0+git1234", True), ("2.10.1+cu128", True),
    ("2.6.0+cu124", False), ("1.13.1", False)])
def test_torch_floor(version, ok):
    problem = versions._torch_problem(version)
    assert (problem is None) is ok
    if not ok:
        assert "torch>=2.7" in problem and version in problem


def test_entry_script_fails_with_one_error_line(tmp_path):
    script = tmp_path / "entry_without_a_function.py"  # a script: its launch forks (tests/dist.py)
    script.write_text(textwrap.dedent("""
        import importlib
        import sys
        m = importlib.import_module("megatron.core.distributed.finalize_model_grads")
        del m.reset_model_temporary_tensors
        import pretrain_gpt_2bw
        pretrain_gpt_2bw.main(sys.argv[1:])
    """))
    result = launch.python([str(script), "--cpu", "--mock-data", "--num-layers", "2",
                            "--hidden-size", "32", "--num-attention-heads", "4",
                            "--seq-length", "16", "--max-position-embeddings", "16",
                            "--micro-batch-size", "2", "--lr", "1e-3",
                            "--train-iters", "1"], timeout=120)
    assert result.returncode == 2, result.tail()
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors == [line for line in result.output.splitlines() if line.strip()][-1:], \
        result.tail()
    assert errors[0].startswith("error: megatron-core: ")
    assert "reset_model_temporary_tensors is missing" in errors[0]
    assert "megatron-core==0.16.1" in errors[0] and "installed 0.16.1" in errors[0]
    assert "Traceback" not in result.output
