"""The planner is a line, not a circle: model -> cost -> search -> flags depend one way, and the
modules that produce measured numbers sit beside the line, importing it, never imported by it.

Read from the source with `ast` by tests/imports.py (every import statement at any depth: module
level, inside functions, under TYPE_CHECKING), so a lazy import that closes a circle fails here
too; tests/test_import_layers.py holds the whole package to the same rule. Pure Python,
milliseconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.imports import imports

PACKAGE = "megatron_2bw.planner"
PLANNER = Path(__file__).resolve().parents[1] / "megatron_2bw" / "planner"

MODEL_PARTS = {"model_params", "model_flops", "model_memory"}
"""ModelSpec's parameter, FLOP and activation counts (its mixins)."""
LINE = {"model_params": 0, "model_memory": 0, "cluster": 0, "bubble": 0, "model_flops": 1,
        "model": 2, "profile": 3, "layout": 3, "compute": 4, "comm_cost": 5, "memory": 5,
        "timing": 6, "cost": 7, "search": 8, "evaluate": 9, "flags": 9}
"""The planning line, by level: a module imports only modules of lower levels (cluster, bubble
and the model's parts: none but the parts below them; profile, the measured numbers as data:
cluster and model; the cost model's terms, compute, comm_cost, memory, timing, under cost;
flags, the end, writes what search chose)."""
BESIDE = {"measure", "links", "e2e", "accuracy"}
"""Profiling: measures layers, links and whole runs and compares them with the cost model."""


def _imports(path: Path) -> set[str]:
    """Every module the file imports, as dotted names (tests/imports.py): `from
    megatron_2bw.planner import x` and `from . import x` name the submodule `x` when there is
    one, else the package."""
    return imports(path, PLANNER.parent)


def _graph() -> dict[str, set[str]]:
    """Planner module -> the planner modules it imports (`__init__` for the package)."""
    graph = {}
    for path in sorted(PLANNER.glob("*.py")):
        deps = set()
        for name in _imports(path):
            if name == PACKAGE:
                deps.add("__init__")
            elif name.startswith(PACKAGE + "."):
                deps.add(name[len(PACKAGE) + 1:].split(".")[0])
        graph[path.stem] = deps
    return graph


def test_every_module_has_a_place_on_the_line_or_beside_it():
    modules = set(_graph()) - {"__init__"}
    assert modules == set(LINE) | BESIDE, (
        f"place {sorted(modules - set(LINE) - BESIDE)} in LINE or BESIDE; "
        f"gone: {sorted(set(LINE) | BESIDE - modules)}")


def test_the_line_depends_one_way():
    graph = _graph()
    wrong = {(module, dep) for module, level in LINE.items() for dep in graph[module]
             if LINE.get(dep, level) >= level}
    assert not wrong, f"imports against the line (module, imported): {sorted(wrong)}"
    assert graph["model"] == MODEL_PARTS and graph["cluster"] == set()
    assert not {"search", "flags", "evaluate"} & graph["cost"]


def test_profiling_feeds_the_line_and_the_graph_has_no_circle():
    graph = _graph()
    into_line = {(m, d) for m in LINE for d in graph[m] if d in BESIDE}
    assert not into_line, f"the line imports profiling: {sorted(into_line)}"
    package = sorted(m for m, deps in graph.items() if "__init__" in deps)
    assert not package, f"{package} import the package itself (its __init__ imports them all)"
    order: list[str] = []
    remaining = {m: set(deps) for m, deps in graph.items()}
    while remaining:  # Kahn: peel modules whose imports are all placed
        ready = sorted(m for m, deps in remaining.items() if deps <= set(order))
        assert ready, f"import circle among {sorted(remaining)}: {remaining}"
        order += ready
        for m in ready:
            del remaining[m]


def test_profile_data_types_import_only_the_standard_library():
    graph = _graph()
    closure, todo = set(), ["profile"]
    while todo:
        module = todo.pop()
        if module not in closure:
            closure.add(module)
            todo += graph[module]
    assert closure == {"profile", "cluster", "model"} | MODEL_PARTS
    for module in closure:
        outside = {name for name in _imports(PLANNER / f"{module}.py")
                   if not name.startswith(PACKAGE)
                   and name.split(".")[0] not in sys.stdlib_module_names | {"__future__"}}
        assert not outside, f"{module}.py imports {sorted(outside)} (torch, training code?)"


def test_the_import_reader_sees_lazy_and_relative_imports(tmp_path):
    # The checks above are only as good as `_imports`: a function-level relative import and a
    # TYPE_CHECKING one are both seen.
    planner = tmp_path / "megatron_2bw" / "planner"
    planner.mkdir(parents=True)
    (planner / "flags.py").write_text("")
    source = planner / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from .search import Plan\n"
                      "def f():\n    import torch\n    from . import flags\n"
                      "    from ..logparse import parse_log\n")
    assert imports(source, planner.parent) >= {f"{PACKAGE}.search", f"{PACKAGE}.flags", "torch",
                                "megatron_2bw.logparse"}
