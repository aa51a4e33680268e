"""megatron_2bw/ imports one way: no import circle among its modules, and nothing in it imports
an entry script (``pretrain_*.py``) or ``tools/``; those import the package, never the reverse.

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


def test_the_package_has_no_import_circle():
    found = circles(within(import_graph(PACKAGE_DIR), PACKAGE))
    assert not found, "import circles:\n" + "\n".join(
        f"  {' -> '.join(circle)}" for circle in found)


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
