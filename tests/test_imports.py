"""The packages' imports form no cycle, module by module, counting imports inside functions too
(as Ray's test_circular_imports does for its own): a cycle dodged by a late import is still one."""

import ast
import os

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.unit

PACKAGES = ("partitioner", "checkpoint", "orchestrator")


def imports(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in its source."""
    folder = os.path.join(ROOT, package)
    modules = {f[:-3] for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py"}
    out = {}
    for m in sorted(modules):
        tree = ast.parse(open(os.path.join(folder, m + ".py")).read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package + "."):
                found.add(node.module.split(".")[1])
        out[m] = found & modules - {m}
    return out


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package):
    graph = imports(package)
    assert graph, f"no modules found in {package}"
    found = cycle(graph)
    assert found is None, f"{package} has an import cycle: {' -> '.join(found)}"


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
