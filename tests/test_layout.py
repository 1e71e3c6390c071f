"""The package's shape: no import cycle (imports inside functions included), small files.

Seen red with `from kvgate.cli import engine_config` put back into `kvgate/server/run.py` (the cycle
cli -> server.run -> cli that issue 11 removed), and with a 401-line module.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "kvgate"
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """kvgate modules this file imports, anywhere in it (a function-level import still makes a cycle)."""
    me = module_name(path)
    pkg = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in modules:
                n = n.rpartition(".")[0]
            if n and n != me:
                out.add(n)
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def package_graph() -> dict[str, set[str]]:
    files = sorted(PKG.rglob("*.py"))
    modules = {module_name(f) for f in files}
    # a package's __init__ is not a dependency of its submodules for this check: importing
    # kvgate.core.engine runs kvgate/core/__init__.py, which imports nothing
    return {module_name(f): imports_of(f, modules) - {"kvgate"} for f in files}


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(package_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_module_is_small():
    big = {
        str(f.relative_to(PKG)): n
        for f in PKG.rglob("*.py")
        if (n := len(f.read_text().splitlines())) > MAX_LINES
    }
    assert not big, f"modules over {MAX_LINES} lines: {big}"
