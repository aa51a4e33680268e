"""Read a package's imports from its source with `ast`, for the tests that hold its layers.

    graph = import_graph(REPO / "megatron_2bw")    # {"megatron_2bw.cli": {"megatron_2bw..."}}
    circles(within(graph, "megatron_2bw"))   # [["a", "b", "a"], ...]: one per knot, [] if none

Invariants: every import statement counts, at any depth (functions, ``if TYPE_CHECKING:``; a
lazy import that closes a circle is still a circle); an import names one module (``a.b``, or
``a.b.c`` where that is a module of the package), not the parent packages initialised on the
way; nothing is imported or run.

More: docs/testing.md, "Reading imports".
"""

from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["module_name", "imports", "import_graph", "within", "find_cycle", "circles"]


def module_name(path: Path, package_dir: Path) -> str:
    """The dotted name of ``path`` under the package folder ``package_dir`` (whose own name is
    the package's): ``.../megatron_2bw/planner/cost.py`` -> ``megatron_2bw.planner.cost``,
    ``.../planner/__init__.py`` -> ``megatron_2bw.planner``."""
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module of ``from X import ...`` written in ``module``."""
    if not node.level:
        return node.module or ""
    base = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def imports(path: Path, package_dir: Path) -> set[str]:
    """Every module the file ``path`` (inside ``package_dir``) imports, as dotted names."""
    module = module_name(path, package_dir)
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            subs = {f"{base}.{a.name}" for a in node.names
                    if _is_module(package_dir, f"{base}.{a.name}")}
            names |= subs or {base}
    return names


def _is_module(package_dir: Path, dotted: str) -> bool:
    top, _, rest = dotted.partition(".")
    if top != package_dir.name or not rest:
        return False
    path = package_dir.joinpath(*rest.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Each module of the package (every ``*.py`` below ``package_dir``) -> what it imports."""
    return {module_name(path, package_dir): imports(path, package_dir)
            for path in sorted(package_dir.rglob("*.py"))}


def within(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """``graph`` with only the edges that stay inside ``package`` (its modules)."""
    return {module: {dep for dep in deps if dep in graph and dep != module}
            for module, deps in graph.items() if module == package
            or module.startswith(package + ".")}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path that returns to its start
    (``["a", "b", "a"]``), or None when the graph has none (depth-first search)."""
    done: set[str] = set()
    for start in sorted(graph):
        stack, path, on_path = [(start, iter(sorted(graph[start])))], [start], {start}
        while stack:
            module, deps = stack[-1]
            dep = next(deps, None)
            if dep is None:
                stack.pop()
                path.pop()
                on_path.discard(module)
                done.add(module)
            elif dep in on_path:
                return path[path.index(dep):] + [dep]
            elif dep not in done and dep in graph:
                stack.append((dep, iter(sorted(graph[dep]))))
                path.append(dep)
                on_path.add(dep)
        done.add(start)
    return None


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (as :func:`find_cycle` gives it) for each knot of modules that reach each
    other (each strongly connected component of more than one module), largest knot first."""
    reach = {module: _reachable(graph, module) for module in graph}
    knots = {frozenset(m for m in reach[module] if module in reach[m]) for module in graph}
    knots = sorted((k for k in knots if len(k) > 1), key=lambda k: (-len(k), sorted(k)))
    return [find_cycle({m: graph[m] & knot for m in knot}) for knot in knots]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen and module in graph:
            seen.add(module)
            todo += graph[module]
    return seen
