"""Imports point one way. Within each package no module imports another that imports it back,
counting imports inside functions too (as Ray's test_circular_imports does for its own): a cycle
dodged by a late import is still one. Across orchestrator's parts, each imports only the parts
`ALLOWED` names (import-linter's "layers" and "independence" contracts written as edges), so the
protocol and the worker never reach up into the controller, the fleet and the controller stand
side by side, and fault injection is loaded only where faults are asked for."""

import ast
import glob
import os

import pytest

from tests.helpers.paths import ROOT

PACKAGES = ("partitioner", "checkpoint", "orchestrator")
# orchestrator's parts (a subpackage, or a top-level module) -> the parts it may import.
_BELOW_LAUNCH = {"job", "protocol", "metrics", "worker", "hosts", "control", "fleet", "telemetry", "dashboard"}
ALLOWED = {
    "job": set(),  # the job file, the program contract, its data
    "protocol": {"job"},  # what crosses a process: reports, specs, the fleet's wire messages
    "metrics": set(),
    "worker": {"job", "protocol", "metrics"},  # one process of one group: no Ray, no controller
    "hosts": {"job", "protocol", "metrics", "worker"},  # actors, groups, clusters
    "control": {"job", "protocol", "hosts"},  # the controller and its policies: not the fleet
    "fleet": {"job", "protocol", "hosts"},  # the shared cluster's scheduler: not the controller
    "telemetry": {"job", "protocol", "metrics", "control"},  # callbacks that watch the controller
    "dashboard": {"job", "protocol", "telemetry"},  # the run store and its web pages
    "chaos": {"job", "protocol", "worker", "hosts", "control"},  # fault injection, a feature
    "launch": _BELOW_LAUNCH | {"chaos"},  # run_job wires it all
    "cli": _BELOW_LAUNCH | {"chaos", "launch"},
    "": _BELOW_LAUNCH | {"launch"},  # the package's public surface
}
# Loaded only inside the functions that use it, when faults are given: a job without `--chaos`
# never imports it.
LAZY = {"chaos"}


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


def part(module: str) -> str:
    return module.split(".")[0]


def disallowed(graph: dict[str, set[str]], allowed=ALLOWED) -> list[str]:
    """Imports between orchestrator's parts that `allowed` does not list, as 'a -> b'."""
    return sorted(
        f"{m} -> {n}"
        for m in graph
        for n in graph[m]
        if part(m) != part(n) and part(n) not in allowed.get(part(m), set())
    )


def eager(package: str, lazy=LAZY) -> list[str]:
    """Modules outside the `lazy` parts that import one of them when imported themselves (at
    module level, not inside a function), as 'a -> b'."""
    files, found = modules(package), []
    for name, path in sorted(files.items()):
        if part(name) in lazy:
            continue
        for node in ast.parse(open(path).read()).body:
            if isinstance(node, ast.ImportFrom | ast.Import):
                found += [f"{name} -> {t}" for t in _targets(node, name, path, package) if part(t) in lazy]
    return found


def _targets(node, name: str, path: str, package: str) -> list[str]:
    here = name.split(".") if name else []
    base = here if path.endswith("__init__.py") else here[:-1]
    if isinstance(node, ast.ImportFrom) and node.level:
        return [".".join([*base[: len(base) - node.level + 1], *(node.module.split(".") if node.module else [])])]
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package + "."):
        return [node.module.split(".", 1)[1]]
    if isinstance(node, ast.Import):
        return [a.name.split(".", 1)[1] for a in node.names if a.name.startswith(package + ".")]
    return []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package):
    graph = imports(package)
    assert len(graph) > 1, f"no modules found in {package}"
    found = cycle({m: {n for n in deps if n} for m, deps in graph.items() if m})
    assert found is None, f"{package} has an import cycle: {' -> '.join(found)}"


def test_orchestrator_parts_import_only_what_they_may():
    graph = imports("orchestrator")
    parts = {part(m) for m in graph}
    assert parts <= set(ALLOWED), f"parts of orchestrator missing from ALLOWED: {sorted(parts - set(ALLOWED))}"
    assert disallowed(graph) == [], "these imports cross orchestrator's parts where ALLOWED has no edge"


def test_fault_injection_is_imported_only_where_faults_are_asked_for():
    assert eager("orchestrator") == [], "these modules import fault injection when they are imported"


def test_the_checks_find_a_cycle_a_disallowed_edge_and_an_eager_import():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
    graph = {"fleet.cluster": {"control.state"}, "control.controller": {"hosts.group"}, "hosts.group": set()}
    assert disallowed(graph) == ["fleet.cluster -> control.state"]


def test_test_helpers_are_imported_one_way():
    """As `tests.helpers.X` only: under pytest's prepend mode `helpers.X` would load a second copy
    of the module, with its own module-level state (a port counter, say)."""
    found = []
    for folder in ("tests", "benchmarks"):
        for path in sorted(glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)):
            for node in ast.walk(ast.parse(open(path).read())):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                found += [f"{os.path.relpath(path, ROOT)}: {n}" for n in names if n.split(".")[0] == "helpers"]
    assert found == [], "import the test helpers as tests.helpers.X"
