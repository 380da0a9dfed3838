"""The partitioner on the corpus of training steps written as people write them (`tests/corpus`).

    .venv/bin/python benchmarks/corpus.py tables [NAME ...]   # plans against the experts' (8 devices)
    .venv/bin/python benchmarks/corpus.py depth [NAME ...]    # plan time against depth (1,024 devices)
    .venv/bin/python benchmarks/corpus.py large               # 96 layers, 2M tokens, 1,024 H100s
    .venv/bin/python benchmarks/corpus.py plantime [NAME ...] # fast plan on 8 devices, guard included
    .venv/bin/python benchmarks/corpus.py replan [NAME ...]   # a second device count, the step read once
    .venv/bin/python benchmarks/corpus.py digests DEVICES LAYERS [NAME ...]  # each plan's digest
    .venv/bin/python benchmarks/corpus.py ab BASE [NAME ...]   # plan time, this checkout against BASE
    .venv/bin/python benchmarks/corpus.py ab96 BASE NAME ...   # 96 layers on 1,024, against BASE
    .venv/bin/python benchmarks/corpus.py thorough BASE NAME ... # thorough plan on 8 devices, against BASE
    .venv/bin/python benchmarks/corpus.py helper NAME ...      # 96 layers on 1,024, pricing helper on and off
    .venv/bin/python benchmarks/corpus.py traces NAME ...      # one shallow trace's time against its layers
    .venv/bin/python benchmarks/corpus.py slices [NAME ...]   # plans on 2 x 4 and 4 x 2 slices against hybrids
    .venv/bin/python benchmarks/corpus.py slices8k            # 96 layers on 8,192 tpu-v5p chips in 16 slices
    .venv/bin/python benchmarks/corpus.py slices-experts      # DeepSeek MoE on 4 x 2: experts across slices or not

`tables`: for each model, the fast and thorough plans and each expert plan, compiled on 8 fake CPU
devices and priced from what XLA produced with the h100 profile (`partitioner.verify`), with the
predicted and compiled collective bytes and peak memory (Markdown, one table per model).
`depth`: `search(..., devices=1024, level="fast")` wall time, capture included, at 12 and 96
layers, median of 3 runs each, alternating, in this process; the guard is off (1,024 devices are
not here to compile on). Beside it, one 96-layer search with `shallow_trace=False` (the whole
step traced: the baseline), whether its plan equals the shallow one's, and the largest relative
difference between their predicted costs.
`plantime`: `plan(..., devices=8, level="fast")` wall time with the compiler guard, each run in a
fresh process (so nothing compiled before is reused), median of 3, with where the time went and
what the guard compiled.
`replan`: at 96 layers, `plan(..., devices=512)` made fresh against the same plan from a
`StepPlanner` that has just planned the step for 1,024 devices (a job's start, then the plan
it makes ahead for a smaller mesh), alternating, median of 3, in this process.
`digests`: each model's fast plan (no guard) on DEVICES devices at LAYERS layers: a digest of its
specs and mesh, its predicted time and the propagations it took; run in two checkouts and
compared, it shows a change that should not move plans does not.
`ab`: `plantime`'s plan on 8 devices in this checkout and in the one at BASE (`git worktree add`),
alternating in three rounds, each run in a fresh process.
`helper`: `depth`'s 96-layer search with the pricing helper (`partitioner/helper.py`) off and
on, alternating in this process, four rounds, the first of each left out; total and search seconds.
`traces`: the step cut to 4, 3, 2 and 1 layers of each stack and captured (`depth._Traced.trace`:
JAX's tracing and the graph built from it), in that order, a fresh build of the step each round,
three rounds; whether the folds at 3 and 4 layers, and at 2 and 3, are one graph op for op
(`depth._same_graph`, what a pair of depths needs); then `depth`'s 96-layer search once, with
where its time went; and a pure-Python loop timed beside them (the machine's speed, which moves
by half from one evening to the next).
`ab96`: `depth`'s 96-layer search (1,024 devices, no guard) in this checkout and at BASE, each a
fresh process doing a warm-up then three runs (median and runs reported), alternating in two
rounds.
`thorough`: `search(..., devices=8, level="thorough")` without the guard, in this checkout and at
BASE, each a fresh process planning twice (the second timed, each build fresh), alternating in two
rounds; with a digest of the plan's specs, mesh and tactic, and one of every candidate ranked
(tactic, mesh, predicted seconds), so equal digests say the two trees chose alike from the same
prices.
`slices`: the fast plan on 2 slices of 4 and 4 slices of 2 fake devices with the tpu-v5p and
h100 profiles against the hand-written hybrid plans (`common.hybrid_experts`: HSDP, data parallel
across slices with Megatron or Megatron+FSDP inside, FSDP and DP everywhere), all compiled and
priced from the HLO with each collective charged at the links its replica groups cross, and the
bytes per level predicted against compiled.
`slices8k`: `search(..., devices=8192, slices=16, hardware="tpu-v5p")` of the `large` decoder
(below) at 96 layers, wall time, capture included, median of 3 in this process, alternating with
the same search on 1,024 devices in one slice (the baseline); the guard is off.
`slices-experts`: the corpus DeepSeek-style MoE (sort dispatch) planned on 4 slices of 2 with and
without the meshes that put experts across slices (`meshes.sliced_meshes(..., experts=False)`
for the baseline), both compiled and priced from the HLO, same process.
`large`: a Llama-70B-shaped decoder (d 8192, 64 heads, 8 K/V heads, SwiGLU 28672) of 96 layers
under `jax.checkpoint`, a global batch of 1,024 x 2,048 tokens, planned for 1,024 H100s: devices
used, peak against the limit, plan time.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tables(names) -> None:
    from tests.corpus import CORPUS, common, load

    for name in names or CORPUS:
        module, options = load(name)
        t = time.perf_counter()
        rows = common.compare(module, **options)
        print(f"\n#### {name} ({time.perf_counter() - t:.0f} s)\n\n{common.table(rows)}", flush=True)


def depth(names) -> None:
    from partitioner.search import search
    from tests.corpus import LOOPED, SCANNED, load

    print(
        "| model | 12 layers (s) | 96 layers (s) | 96 / 12 | 96, whole trace (s) | same plan, cost drift | 96 layers: where the time went |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in names or (LOOPED + SCANNED):
        module, options = load(name)
        times = {12: [], 96: []}
        plans = {}
        for _ in range(3):
            for layers in times:
                fn, args = module.build(layers=layers, **options)
                t = time.perf_counter()
                plans[layers], _ = search(fn, *args, devices=1024, hardware="h100", compile_check=False)
                times[layers].append(time.perf_counter() - t)
        fn, args = module.build(layers=96, **options)
        t = time.perf_counter()
        whole, _ = search(fn, *args, devices=1024, hardware="h100", compile_check=False, shallow_trace=False)
        whole_seconds = time.perf_counter() - t
        same = _specs(whole) == _specs(plans[96]) and whole.mesh == plans[96].mesh
        drift = _cost_drift(whole.cost, plans[96].cost)
        m12, m96 = statistics.median(times[12]), statistics.median(times[96])
        print(
            f"| {name} | {m12:.2f} | {m96:.2f} | {m96 / m12:.2f} | {whole_seconds:.2f} | {'yes' if same else 'NO'}, {drift:.0e} "
            f"| {plans[96].notes[-1]} |",
            flush=True,
        )


def replan(names) -> None:
    """A plan for 512 devices made fresh against the same plan made by a `StepPlanner` that has
    planned the step for 1,024 (a job's start, then its plan ahead), at 96 layers."""
    from partitioner import StepPlanner, plan
    from tests.corpus import LOOPED, load

    print("| model | fresh plan (s) | after a plan for 1,024 (s) | after / fresh | same plan |")
    print("|---|---|---|---|---|")
    for name in names or LOOPED:
        module, options = load(name)
        times, plans = {"fresh": [], "after": []}, {}
        for r in range(3):
            for way in ("fresh", "after") if r % 2 == 0 else ("after", "fresh"):
                fn, args = module.build(layers=96, **options)
                options_ = dict(hardware="h100", compile_check=False)
                if way == "after":
                    steps = StepPlanner(fn, *args)
                    steps.plan(1024, **options_)
                t = time.perf_counter()
                plans[way] = steps.plan(512, **options_) if way == "after" else plan(fn, *args, devices=512, **options_)
                times[way].append(time.perf_counter() - t)
        fresh, after = statistics.median(times["fresh"]), statistics.median(times["after"])
        same = _specs(plans["fresh"]) == _specs(plans["after"]) and plans["fresh"].mesh == plans["after"].mesh
        print(f"| {name} | {fresh:.2f} | {after:.2f} | {after / fresh:.2f} | {'yes' if same else 'NO'} |", flush=True)


def _cost_drift(a, b) -> float:
    """The largest relative difference between two costs' seconds and peak bytes (summing the
    same terms in another order moves the last digits; ops on scalars are approximated)."""
    pairs = [(a.compute_seconds, b.compute_seconds), (a.communication_seconds, b.communication_seconds)]
    pairs.append((a.peak_bytes_per_device, b.peak_bytes_per_device))
    return max(abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in pairs)


def _specs(plan) -> list:
    """A plan's specs leaf by leaf (two builds of a step can hold different static parts, such
    as a TrainState's apply_fn, so their trees never compare equal)."""
    import jax

    spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    return [jax.tree.leaves(plan.in_specs, is_leaf=spec), jax.tree.leaves(plan.out_specs, is_leaf=spec)]


def _planned(root: str, name: str) -> tuple[float, list[str]]:
    """`plan(...)` on 8 devices with the guard, in a fresh process, as the checkout at `root` has it."""
    code = (
        "import sys, time, json; sys.path.insert(0, {root!r})\n"
        "from tests.corpus import load\nfrom partitioner import plan\n"
        "m, o = load({name!r}); fn, args = m.build(layers=2, **o)\n"
        "t = time.perf_counter(); p = plan(fn, *args, devices=8, hardware='h100', level='fast')\n"
        "print(json.dumps([time.perf_counter() - t, list(p.notes)]))"
    )
    return _fresh_process(code, root, name)


def _fresh_process(code: str, root: str, name: str) -> tuple:
    """What `code` (formatted with `root` and `name`) prints last as JSON, run in a fresh process."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", code.format(root=root, name=name)], capture_output=True, text=True, check=True
    )
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def plantime(names) -> None:
    from tests.corpus import CORPUS

    print("| model | fast plan, 8 devices (s), median of 3 | the guard | where the time went |")
    print("|---|---|---|---|")
    for name in names or CORPUS:
        seconds, notes = sorted(_planned(ROOT, name) for _ in range(3))[1]
        guard = next((n.split(":")[0] for n in notes if n.startswith(("compiled the top", "compile check"))), "not run")
        print(f"| {name} | {seconds:.2f} | {guard} | {notes[-1].removeprefix('time: ')} |", flush=True)


def ab(base: str, names) -> None:
    from tests.corpus import CORPUS

    print("| model | round | base (s) | this (s) | this / base | this: where the time went |")
    print("|---|---|---|---|---|---|")
    for name in names or CORPUS:
        for r in range(3):
            runs = {}
            for _, root in _in_turn(base, r):
                runs[root] = _planned(root, name)
            (b, _), (t, notes) = runs[base], runs[ROOT]
            print(
                f"| {name} | {r + 1} | {b:.2f} | {t:.2f} | {t / b:.2f} | {notes[-1].removeprefix('time: ')} |",
                flush=True,
            )


def _in_turn(base: str, r: int) -> tuple[tuple[str, str], ...]:
    """(label, root) of the tree at BASE and this checkout, in round `r`'s order (`_harness.in_turn`)."""
    from _harness import in_turn

    return tuple(in_turn((("base", base), ("this", ROOT)), r))


def thorough(base: str, names) -> None:
    print("| model | round | tree | seconds | plan digest | ranked digest | candidates |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        for r in range(2):
            for label, root in _in_turn(base, r):
                seconds, plan_digest, ranked_digest, count = _thorough_planned(root, name)
                print(
                    f"| {name} | {r + 1} | {label} | {seconds:.2f} | {plan_digest} | {ranked_digest} | {count} |",
                    flush=True,
                )


def _thorough_planned(root: str, name: str) -> tuple:
    code = (
        "import sys, time, json, hashlib; sys.path.insert(0, {root!r})\n"
        "import jax\nfrom tests.corpus import load\nfrom partitioner.search import search\n"
        "m, o = load({name!r})\n"
        "for _ in range(2):\n"
        "    fn, args = m.build(**o); t = time.perf_counter()\n"
        "    p, ranked = search(fn, *args, devices=8, hardware='h100', level='thorough', compile_check=False)\n"
        "    seconds = time.perf_counter() - t\n"
        "spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)\n"
        "specs = [jax.tree.leaves(p.in_specs, is_leaf=spec), jax.tree.leaves(p.out_specs, is_leaf=spec)]\n"
        "top = [(str(c.tactic), sorted(c.mesh.items()), round(c.cost.total_seconds, 15)) for c in ranked]\n"
        "digest = lambda x: hashlib.sha1(repr(x).encode()).hexdigest()[:12]\n"
        "print(json.dumps([seconds, digest((p.mesh, specs, p.tactic)), digest(top), len(ranked)]))"
    )
    return _fresh_process(code, root, name)


def ab96(base: str, names) -> None:
    """`depth`'s 96-layer search in this checkout and the one at BASE, each a fresh process (a
    warm-up, then three runs), alternating in two rounds."""
    print("| model | round | tree | median (s) | runs (s) | where the time went (last run) |")
    print("|---|---|---|---|---|---|")
    for name in names:
        for r in range(2):
            for label, root in _in_turn(base, r):
                seconds, note = _deep_planned(root, name)
                runs = " ".join(f"{t:.2f}" for t in seconds)
                print(
                    f"| {name} | {r + 1} | {label} | {statistics.median(seconds):.2f} | {runs} | {note} |", flush=True
                )


def _deep_planned(root: str, name: str) -> tuple[list[float], str]:
    code = (
        "import sys, time, json; sys.path.insert(0, {root!r})\n"
        "from tests.corpus import load\nfrom partitioner.search import search\n"
        "m, o = load({name!r}); ts = []\n"
        "for i in range(4):\n"
        "    fn, args = m.build(layers=96, **o); t = time.perf_counter()\n"
        "    p, _ = search(fn, *args, devices=1024, hardware='h100', compile_check=False)\n"
        "    ts.append(time.perf_counter() - t)\n"
        "print(json.dumps([ts[1:], p.notes[-1].removeprefix('time: ')]))"
    )
    return _fresh_process(code, root, name)


def helper(names) -> None:
    from partitioner import helper as pricing_helper
    from partitioner.search import search
    from tests.corpus import load

    print("| model | helper | total (s), rounds 2 to 4 | search (s), rounds 2 to 4 |")
    print("|---|---|---|---|")
    for name in names:
        module, options = load(name)
        runs = {"off": [], "on": []}
        for _ in range(4):
            for way in runs:
                if way == "on":
                    pricing_helper.start_helper()
                    pricing_helper._helper().wait_ready(30.0)
                fn, args = module.build(layers=96, **options)
                t = time.perf_counter()
                p, _ = search(fn, *args, devices=1024, hardware="h100", compile_check=False, pricing_helper=way == "on")
                searched = float(p.notes[-1].split("search ")[1].split(" s")[0])
                runs[way].append((time.perf_counter() - t, searched))
        for way, rows in runs.items():
            total = " ".join(f"{t:.2f}" for t, _ in rows[1:])
            searched = " ".join(f"{s:.2f}" for _, s in rows[1:])
            print(f"| {name} | {way} | {total} | {searched} |", flush=True)


def traces(names) -> None:
    import jax

    from partitioner.arguments import abstract_leaf
    from partitioner.depth import _same_graph, _Traced
    from partitioner.search import search
    from partitioner.stacks import named_leaves, stacks
    from tests.corpus import load

    print(
        "| model | round | 4 layers (s) | 3 (s) | 2 (s) | 1 (s) | folded alike: 3 and 4, 2 and 3 | "
        "96 layers on 1,024 (s) | where its time went | Python loop (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        module, options = load(name)
        for r in range(3):
            fn, args = module.build(layers=96, **options)
            abstract = tuple(jax.tree.map(abstract_leaf, a) for a in args)
            traced = _Traced(fn, abstract, stacks(abstract, named=named_leaves(abstract)), 96)
            seconds = []
            for k in (4, 3, 2, 1):
                t = time.perf_counter()
                traced.trace(k)
                seconds.append(f"{time.perf_counter() - t:.2f}")
            folds = [traced.fold(k, 1) for k in (2, 3, 4)]
            alike = [
                a is not None and b is not None and _same_graph(a.graph, b.graph) is not None
                for a, b in ((folds[1], folds[2]), (folds[0], folds[1]))
            ]
            seconds.append(", ".join("yes" if x else "no" for x in alike))
            fn, args = module.build(layers=96, **options)
            t = time.perf_counter()
            p, _ = search(fn, *args, devices=1024, hardware="h100", compile_check=False)
            whole = time.perf_counter() - t
            note = p.notes[-1].removeprefix("time: ")
            print(f"| {name} | {r + 1} | {' | '.join(seconds)} | {whole:.2f} | {note} | {_loop():.2f} |", flush=True)


def _loop() -> float:
    """A fixed pure-Python loop's seconds: how fast the machine runs Python just now."""
    t, s = time.perf_counter(), 0
    for i in range(5_000_000):
        s += i * i
    return time.perf_counter() - t


def digests(devices: int, layers: int, names) -> None:
    import hashlib

    from partitioner import helper as pricing_helper
    from partitioner.search import search
    from tests.corpus import CORPUS, load

    # Every candidate priced in this process (pricing_helper=False), so that each propagation is
    # counted here (the helper's prices are the same: tests/partitioner/unit/test_helper.py).
    count, propagate = [0], pricing_helper.propagate

    def counted(*args, **kwargs):
        count[0] += 1
        return propagate(*args, **kwargs)

    pricing_helper.propagate = counted
    print("| model | plan | digest | predicted (ms) | propagations |")
    print("|---|---|---|---|---|")
    for name in names or CORPUS:
        module, options = load(name)
        fn, args = module.build(layers=layers, **options)
        count[0] = 0
        plan, _ = search(fn, *args, devices=devices, hardware="h100", compile_check=False, pricing_helper=False)
        text = json.dumps([plan.to_dict()["in_specs"], plan.mesh], sort_keys=True)
        digest = hashlib.md5(text.encode()).hexdigest()[:8]
        ms = plan.cost.total_seconds * 1e3
        print(f"| {name} | {plan.tactic} {plan.describe()} | {digest} | {ms:.3f} | {count[0]} |", flush=True)


def sliced(names) -> None:
    from tests.corpus import CORPUS, common, load

    print(
        "| model | slices | profile | fast plan | compiled ms | x best hybrid | best hybrid | dcn MB pred / compiled | inside MB pred / compiled |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names or CORPUS:
        module, options = load(name)
        for slices in (2, 4):
            for hardware in ("tpu-v5p", "h100"):
                rows = common.compare_sliced(module, slices, hardware, **options)
                seconds = {label: v.compute_seconds + v.communication_seconds for label, _, v in rows}
                best = min((label for label in seconds if label != "fast"), key=seconds.get)
                _, plan, v = rows[0]
                pred, got = plan.cost.level_bytes or {}, v.level_bytes or {}
                inside = lambda d: sum(n for k, n in d.items() if k != "dcn") / 1e6  # noqa: E731
                print(
                    f"| {name} | {slices} x {8 // slices} | {hardware} | {plan.tactic} {plan.describe()} | "
                    f"{seconds['fast'] * 1e3:.3f} | {seconds['fast'] / seconds[best]:.3f} | {best} {seconds[best] * 1e3:.3f} | "
                    f"{pred.get('dcn', 0) / 1e6:.2f} / {got.get('dcn', 0) / 1e6:.2f} | {inside(pred):.2f} / {inside(got):.2f} |",
                    flush=True,
                )


def slices8k() -> None:
    from partitioner.search import search
    from tests.corpus import llama_gqa

    c = dict(llama_gqa.CFG, d=8192, heads=64, kv_heads=8, head_dim=128, ff=28672, seq=2048, batch=1024)
    fn, args = llama_gqa.build(layers=96, form="repeat", c=c)
    times: dict[tuple, list] = {(8192, 16): [], (1024, 1): []}
    for _ in range(3):
        for devices, slices in times:
            t = time.perf_counter()
            plan, _ = search(fn, *args, devices=devices, slices=slices, hardware="tpu-v5p", compile_check=False)
            times[(devices, slices)].append(time.perf_counter() - t)
            if devices == 8192:
                chosen = plan
    for (devices, slices), runs in times.items():
        print(
            f"{devices} devices in {slices} slice(s): {', '.join(f'{t:.2f}' for t in runs)} s, median {statistics.median(runs):.2f} s"
        )
    print(chosen.describe(), chosen.tactic)
    print("\n".join(chosen.notes[:3]))


def slices_experts() -> None:
    from partitioner import meshes, plan, verify_many
    from tests.corpus import deepseek

    fn, args = deepseek.build(layers=2, form="sort")
    sliced = meshes.sliced_meshes
    print("| profile | with: plan | compiled ms | dcn MB | without: plan | compiled ms | dcn MB |")
    print("|---|---|---|---|---|---|---|")
    for hardware in ("h100", "tpu-v5p"):
        plans = []
        for experts in (True, False):
            meshes.sliced_meshes = lambda *a, experts=experts, **k: sliced(*a[:6], experts=experts and a[6])
            plans.append(plan(fn, *args, devices=8, slices=4, hardware=hardware))
        meshes.sliced_meshes = sliced
        found = verify_many([(p, fn, args) for p in plans], hardware=hardware)
        cells = [
            f"{p.tactic} on {p.describe()} | {(v.compute_seconds + v.communication_seconds) * 1e3:.3f} | "
            f"{v.level_bytes.get('dcn', 0) / 1e6:.1f}"
            for p, v in zip(plans, found)
        ]
        print(f"| {hardware} | {' | '.join(cells)} |", flush=True)


def large() -> None:
    from partitioner import plan, profile
    from tests.corpus import llama_gqa

    c = dict(llama_gqa.CFG, d=8192, heads=64, kv_heads=8, head_dim=128, ff=28672, seq=2048, batch=1024)
    fn, args = llama_gqa.build(layers=96, form="repeat", c=c)
    t = time.perf_counter()
    p = plan(fn, *args, devices=1024, hardware="h100")
    seconds = time.perf_counter() - t
    limit = profile("h100").memory_bytes
    print(
        f"{p.describe()}: {p.devices_used / 1024:.0%} of the devices, peak {p.cost.peak_bytes_per_device / 2**30:.1f} "
        f"of {limit / 2**30:.1f} GiB, predicted {p.cost.total_seconds:.2f} s/step, planned in {seconds:.1f} s"
    )
    print("\n".join(p.notes))


if __name__ == "__main__":
    from _harness import fake_devices

    fake_devices(8, unless_set=True)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    what, names = sys.argv[1], sys.argv[2:]
    jobs = {"tables": lambda: tables(names), "depth": lambda: depth(names), "plantime": lambda: plantime(names),
            "replan": lambda: replan(names),
            "slices": lambda: sliced(names), "slices8k": slices8k, "slices-experts": slices_experts}  # fmt: skip
    jobs["ab"] = lambda: ab(names[0], names[1:])
    jobs["ab96"] = lambda: ab96(names[0], names[1:])
    jobs["thorough"] = lambda: thorough(names[0], names[1:])
    jobs["helper"] = lambda: helper(names)
    jobs["traces"] = lambda: traces(names)
    jobs["digests"] = lambda: digests(int(names[0]), int(names[1]), names[2:])
    {**jobs, "large": large}[what]()
