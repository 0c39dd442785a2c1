"""The shape the code promises: runtime modules stay small, and the import graph of the
runtime packages has no cycle (module-level imports, the ones that run at import)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("messages", "orchestrator", "engines")
MAX_LINES = 400


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).glob("*.py"):
            out[f"{pkg}.{p.stem}" if p.stem != "__init__" else pkg] = p
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    top = list(tree.body) + [n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]
    for node in top:  # module and class level; imports inside functions are deliberate
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def test_no_runtime_module_is_over_the_limit():
    big = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, big


def test_the_import_graph_has_no_cycle():
    mods = modules()
    graph = {m: imports(p, set(mods)) - {m} for m, p in mods.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError(" -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
