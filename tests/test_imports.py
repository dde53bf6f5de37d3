"""The package's import graph has no circle: no module imports, at any depth and lazily or not, a module
that imports it back. Package `__init__` files, which only re-export, are left out."""
from __future__ import annotations

import ast
import os

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _modules() -> dict[str, str]:
    out = {}
    root = os.path.join(SRC, "tokenmill")
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py") and f != "__init__.py":
                path = os.path.join(folder, f)
                name = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                out[name] = path
    return out


def _imports(path: str, modules: dict[str, str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n for n in names if n in modules}
    return found


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)
