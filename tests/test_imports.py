"""The import graph goes down the floors: no package of snapctl imports one that imports it back
(directly or around a longer loop), and inside a package no module does either. Every import
counts, at module level or inside a function, under TYPE_CHECKING too: a loop of imports is a
loop of knowledge, whenever it is executed."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import snapctl

ROOT = Path(snapctl.__file__).parent


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("snapctl")}


def _graph(group: dict[str, str]) -> dict[str, set[str]]:
    """Arrows between the groups ``group`` maps each module to (no arrow inside a group)."""
    known = dict(_modules())
    arrows: dict[str, set[str]] = {name: set() for name in set(group.values())}
    for module, path in known.items():
        for name in _imports(module, path):
            while name and name not in known:
                name = name.rpartition(".")[0]
            if module.startswith(f"{name}."):
                continue  # its own package: imported before it in any case (the face)
            if name and group[name] != group[module]:
                arrows[group[module]].add(group[name])
    return arrows


def _cycle(arrows: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> list[str] | None:
        if node in trail:
            return [*trail[trail.index(node) :], node]
        if node in done:
            return None
        for target in sorted(arrows.get(node, ())):
            if loop := visit(target, [*trail, node]):
                return loop
        done.add(node)
        return None

    for node in sorted(arrows):
        if loop := visit(node, []):
            return loop
    return None


def _floor(module: str) -> str:
    """``snapctl.pool.warm`` → ``snapctl.pool``; a module of snapctl itself stands alone."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_package_imports_one_that_imports_it_back() -> None:
    modules = [name for name, _ in _modules()]
    assert _cycle(_graph({name: _floor(name) for name in modules})) is None


def test_no_module_imports_one_that_imports_it_back() -> None:
    modules = [name for name, _ in _modules()]
    assert _cycle(_graph({name: name for name in modules})) is None


def test_the_check_finds_a_loop() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
