"""megatron_2bw/ imports one way: no import circle among its modules, each part (a subpackage or
a top-level module) imports only parts of lower layers (`LAYERS`), and nothing in it imports an
entry script (``pretrain_*.py``) or ``tools/``; those import the package, never the reverse.

Counted (tests/imports.py reads them with `ast`, nothing is imported): every import statement
at any depth, module level and function level alike (and under ``TYPE_CHECKING``), because a
lazy import that closes a circle still makes one. An edge goes to the module named, not to the
parent packages Python initialises on the way. Pure Python, milliseconds.
"""

from __future__ import annotations

from pathlib import Path

from tests.imports import circles, find_cycle, import_graph, within

PACKAGE = "megatron_2bw"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE
ENTRY_SCRIPTS = tuple(path.stem for path in PACKAGE_DIR.parent.glob("pretrain_*.py"))

LAYERS = (
    {"flag_types", "errors", "logparse"},
    {"runtime"},
    {"data", "weights", "deferred", "megatron_lm_flags"},
    {"discrepancy", "corrections"},
    {"schedules"},
    {"__init__"},
    {"arguments"},
    {"training"},
    {"cli", "planner", "trace"},
    {"entry"},
)
"""The package's parts, lowest first: a part imports only parts of lower layers (inside itself,
anything without a circle). Leaves of the standard library first (errors, flag types, log
lines); the runtime (device, process groups); the schedules, which run any step function and
know nothing of the training loop, its checkpoints or its flags; the argument layer; the
training; what the tools use (the planner, the command line, the timelines) beside each
other; `entry`, which the
entry scripts call, last. `__init__` is the package's own file (it patches megatron-core's
schedules when the package is imported)."""


def part(module: str) -> str:
    """'megatron_2bw.schedules.executor' -> 'schedules'; the package itself -> '__init__'."""
    return module.split(".")[1] if "." in module else "__init__"


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, imported module) pairs against `LAYERS`: into the same or a higher layer of
    another part, or from or into a part `LAYERS` does not place."""
    level = {name: i for i, names in enumerate(LAYERS) for name in names}
    return sorted((module, dep) for module, deps in graph.items() for dep in deps
                  if part(module) != part(dep)
                  and level.get(part(dep), len(LAYERS)) >= level.get(part(module), -1))


def test_the_package_has_no_import_circle():
    found = circles(within(import_graph(PACKAGE_DIR), PACKAGE))
    assert not found, "import circles:\n" + "\n".join(
        f"  {' -> '.join(circle)}" for circle in found)


def test_each_part_imports_only_lower_layers():
    graph = within(import_graph(PACKAGE_DIR), PACKAGE)
    unplaced = {part(module) for module in graph} - set().union(*LAYERS)
    assert not unplaced, f"place {sorted(unplaced)} in LAYERS"
    wrong = upward_imports(graph)
    assert not wrong, "imports against LAYERS (module, imported):\n" + "\n".join(
        f"  {module} -> {dep}" for module, dep in wrong)


def test_the_package_imports_no_entry_script_and_no_tool():
    assert ENTRY_SCRIPTS, "no pretrain_*.py beside the package"
    upward = sorted((module, name) for module, names in import_graph(PACKAGE_DIR).items()
                    for name in names
                    if name.split(".")[0] in ENTRY_SCRIPTS + ("tools", "tests"))
    assert not upward, f"the package imports an entry script or a tool: {upward}"


def test_a_circle_through_a_lazy_import_is_found(tmp_path):
    # The checks above are only as good as the reader: a relative import inside a function
    # closes a circle as surely as one at the top of a file.
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    (package / "c.py").write_text("import pretrain_x\n")
    graph = import_graph(package)
    assert find_cycle(within(graph, "pkg")) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    assert circles(within(graph, "pkg")) == [["pkg.a", "pkg.sub.b", "pkg.a"]]
    assert "pretrain_x" in graph["pkg.c"]
    (package / "sub" / "b.py").write_text("def f():\n    import pkg.c\n")
    assert find_cycle(within(import_graph(package), "pkg")) is None
    assert circles(within(import_graph(package), "pkg")) == []


def test_the_layer_rule_finds_a_lower_part_importing_a_higher_one():
    # The executor once imported the training's checkpointing (lazily) for an error class.
    graph = {"megatron_2bw.schedules.executor": {"megatron_2bw.training.checkpointing",
                                                 "megatron_2bw.schedules.p2p",
                                                 "megatron_2bw.errors"},
             "megatron_2bw.training.loop": {"megatron_2bw.schedules.executor"},
             "megatron_2bw.newpart": {"megatron_2bw.runtime"}}
    assert upward_imports(graph) == [
        ("megatron_2bw.newpart", "megatron_2bw.runtime"),
        ("megatron_2bw.schedules.executor", "megatron_2bw.training.checkpointing")]
