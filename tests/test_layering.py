"""The package's layering: no import cycle between its modules, variants built on the public
contract only, and the README's layout section naming exactly the modules that exist.

Imports are read with ``ast`` (function-local ones included: a deferred import is still a
dependency, and a cycle through one is how a layering mistake hides).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lora_func"


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """``module -> modules of the package it imports``. The package itself is not a node: every
    submodule's import runs the package's ``__init__`` first, which is not a dependency edge."""
    paths = {module_name(p, package.parent): p for p in sorted(package.rglob("*.py"))}
    top = package.name
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                wanted = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base for alias in node.names]
            else:
                continue
            for target in wanted:
                while target and target not in paths:
                    target = target.rpartition(".")[0]
                if target and target not in (name, top):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph(PACKAGE)) == []


def test_a_cycle_through_a_function_local_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.a import f\n")
    (package / "a.py").write_text("from pkg.sub.b import g\n\ndef f():\n    return g()\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def g():\n    from ..a import f\n    return f\n")
    (package / "c.py").write_text("import pkg.a\n")
    graph = import_graph(package)
    assert graph["pkg.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]


def _readme_layout() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1]


def _layout_items(column: str) -> list[str]:
    """The paths a first-column entry names: ``a/b.py, c.py`` is ``a/b.py`` and ``a/c.py``."""
    items: list[str] = []
    folder = ""
    for item in (part.strip() for part in column.split(",")):
        if "/" in item.rstrip("/"):
            folder = item.rstrip("/").rsplit("/", 1)[0] + "/"
            items.append(item)
        else:
            items.append(folder + item)
    return items


def _layout_rows(block: str) -> list[list[str]]:
    return [_layout_items(re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]) for line in block.strip().splitlines()]


def _row_of(module: str, rows: list[list[str]]) -> int | None:
    """The layout row a module belongs to: its file's row, its package folder's row, or (for a
    variant file) the ``variants/<name>.py`` row."""
    path = module.replace(".", "/")
    is_variant_file = path.startswith("lora_func/variants/") and not path.rsplit("/", 1)[1].startswith("_")
    for i, items in enumerate(rows):
        for item in items:
            if "<name>" in item:
                if is_variant_file:
                    return i
            elif item == f"{path}.py" or (item.endswith("/") and (path + "/").startswith(item) and not is_variant_file):
                return i
    return None


def test_every_module_imports_only_from_rows_above_it_in_the_readme_layout():
    rows = _layout_rows(_readme_layout())
    graph = import_graph(PACKAGE)
    unplaced = sorted(m for m in graph if m != "lora_func" and _row_of(m, rows) is None)
    assert not unplaced, f"README.md's layout section has no row for {unplaced}"
    upward = sorted(
        f"{module} (row {_row_of(module, rows)}) imports {target} (row {_row_of(target, rows)})"
        for module in graph
        if module != "lora_func"
        for target in graph[module]
        if _row_of(target, rows) > _row_of(module, rows)  # type: ignore[operator]
    )
    assert not upward, "imports against the layout's order (move the row, or the code):\n" + "\n".join(upward)


def test_the_readme_layout_names_every_module_and_nothing_else():
    listed = {item for items in _layout_rows(_readme_layout()) for item in items}
    package_files = {
        str(p.relative_to(ROOT))
        for p in PACKAGE.glob("*.py")
        if p.name != "__init__.py"
    } | {str(p.relative_to(ROOT)) + "/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    missing = sorted(package_files - listed)
    assert not missing, f"README.md's layout section does not name {missing}"
    stale = sorted(n for n in listed if "<" not in n and not (ROOT / n).exists())
    assert not stale, f"README.md's layout section names {stale}, which do not exist"
