"""Imports point one way. Within each package no module imports another that imports it back,
counting imports inside functions too (as Ray's test_circular_imports does for its own): a cycle
dodged by a late import is still one. Across orchestrator's subpackages, each imports only the
layers below it (`LAYERS`), so the protocol and the worker never reach up into the controller or
the command line."""

import ast
import os

import pytest

from tests.helpers.paths import ROOT

PACKAGES = ("partitioner", "checkpoint", "orchestrator")
# orchestrator's layers, lowest first: a module may import its own layer and those before it.
LAYERS = ("job", "protocol", "metrics", "worker", "hosts", "control", "telemetry", "fleet", "testing", "cli")


def modules(package: str) -> dict[str, str]:
    """Dotted module name (within the package) -> its file, `__init__` files included."""
    found = {}
    top = os.path.join(ROOT, package)
    for folder, _, files in os.walk(top):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), top)[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__") if rel != "__init__" else ""] = os.path.join(folder, f)
    return found


def imports(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in its source."""
    files = modules(package)
    out = {}
    for name, path in sorted(files.items()):
        here = name.split(".") if name else []
        base = here if path.endswith("__init__.py") else here[:-1]
        found = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.level:
                anchor = base[: len(base) - node.level + 1]
                target = [*anchor, *(node.module.split(".") if node.module else [])]
                candidates = [".".join([*target, a.name]) for a in node.names] + [".".join(target)]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package + "."):
                target = node.module.split(".")[1:]
                candidates = [".".join([*target, a.name]) for a in node.names] + [".".join(target)]
            elif isinstance(node, ast.Import):
                candidates = [a.name.split(".", 1)[1] for a in node.names if a.name.startswith(package + ".")]
            else:
                continue
            found.update(c for c in candidates if c in files)
        out[name] = found - {name}
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


def upward(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Imports from a lower layer into a higher one, as 'a -> b'. The package's `__init__` (its
    public surface, which re-exports from every layer) stands above them all."""
    rank = {layer: i for i, layer in enumerate(layers)}
    level = lambda m: rank.get(m.split(".")[0], len(layers)) if m else len(layers) + 1
    return sorted(f"{m} -> {n}" for m in graph for n in graph[m] if level(n) > level(m))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package):
    graph = imports(package)
    assert len(graph) > 1, f"no modules found in {package}"
    found = cycle({m: {n for n in deps if n} for m, deps in graph.items() if m})
    assert found is None, f"{package} has an import cycle: {' -> '.join(found)}"


def test_orchestrator_imports_point_down_its_layers():
    graph = imports("orchestrator")
    assert {m.split(".")[0] for m in graph if m} <= set(LAYERS), "a subpackage of orchestrator is missing from LAYERS"
    assert upward(graph) == [], "these imports point up orchestrator's layers (LAYERS, lowest first)"


def test_the_checks_find_a_cycle_and_an_upward_import():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
    assert upward({"worker.segment": {"control.controller"}, "control.controller": {"worker.segment"}}) == [
        "worker.segment -> control.controller"
    ]
