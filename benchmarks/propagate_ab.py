"""Propagation of this tree against an earlier revision's, on the propagations a search makes.

    .venv/bin/python benchmarks/propagate_ab.py REV [NAME ...]     # e.g. 8e61854 llama-maxtext t5

For each corpus model at 96 layers, one `search(..., devices=1024, level="fast")` records every
`propagate` call it makes; then those calls are replayed with this tree's `partitioner.propagate`
and with REV's (loaded from git into a module beside it), alternating, five rounds, GC paused as
`search` pauses it. Prints medians, their ratio, and whether the two give the same shardings,
factor assignments and communication for every call.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import importlib.util
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def old_module(rev: str):
    source = subprocess.run(
        ["git", "show", f"{rev}:partitioner/propagate.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    spec = importlib.util.spec_from_loader("partitioner._propagate_at_rev", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "partitioner"
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    exec(compile(source, f"{rev}:partitioner/propagate.py", "exec"), module.__dict__)
    return module


def main(rev: str, names) -> None:
    from _harness import in_turn

    import partitioner.helper as pricing_helper
    import partitioner.propagate as new
    from partitioner.search import search
    from tests.corpus import load

    old = old_module(rev)
    calls = []
    recorded = pricing_helper.propagate

    def recording(graph, annotations, mesh, first=()):
        calls.append((graph, annotations, mesh, first))
        return recorded(graph, annotations, mesh, first=first)

    pricing_helper.propagate = recording
    for name in names or ("llama-maxtext", "t5"):
        calls.clear()
        module, options = load(name)
        fn, args = module.build(layers=96, **options)
        # pricing_helper=False: every propagation made (and recorded) in this process
        search(fn, *args, devices=1024, hardware="h100", compile_check=False, pricing_helper=False)
        graphs = {tag: _uncached(calls[0][0]) for tag in ("rev", "now")}  # each revision's own per-graph caches
        times, same = {"rev": [], "now": []}, True
        gc.disable()
        for r in range(5):
            results = {}
            for tag, m in in_turn((("rev", old), ("now", new)), r):
                graph = graphs[tag]
                (new.first_stages(graph) if tag == "now" else graph._first_stage).clear()
                t = time.perf_counter()
                results[tag] = [m.propagate(graph, a, mesh, first=f) for _, a, mesh, f in calls]
                for p in results[tag]:  # (found when asked since dd51f82; priced candidates ask)
                    p.communication  # noqa: B018
                times[tag].append(time.perf_counter() - t)
            same &= all(
                a.shardings == b.shardings and a.factor_axes == b.factor_axes and _moves(a) == _moves(b)
                for a, b in zip(results["rev"], results["now"])
            )
        gc.enable()
        r, n = statistics.median(times["rev"]), statistics.median(times["now"])
        print(f"{name}: {len(calls)} propagations, {rev} {r:.3f} s, now {n:.3f} s, {r / n:.2f}x, identical: {same}")


def _moves(p) -> list[tuple]:
    """A propagation's communication as plain tuples: each revision has its own `Communication`
    class, and instances of two classes never compare equal."""
    return [dataclasses.astuple(c) for c in p.communication]


def _uncached(graph):
    """A shallow copy of `graph` with none of what propagation keeps on it: a new graph, so
    nothing this tree keeps by graph (`memo`), and the attributes an older revision kept on the
    graph itself emptied."""
    copied = copy.copy(graph)
    for cache in ("_propagation", "_op_info", "_constants"):
        setattr(copied, cache, None)
    copied._first_stage = {}
    return copied


if __name__ == "__main__":
    from _harness import fake_devices

    fake_devices(8, unless_set=True)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    main(sys.argv[1], sys.argv[2:])
