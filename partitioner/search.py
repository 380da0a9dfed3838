"""Tactics and an exact solver over the folded factor graph: each plan annotates a few inputs
(the batch, some weights), propagation shards everything else, and the cost model prices the
result; the cheapest plan that fits in memory wins, and the runners-up are kept with their costs,
to say why.

Meshes are every factoring of the devices (and of the most devices the batch divides, 6 of 7 for
a batch of 24) into (data, seq, model); `data` must divide the batch and `seq` the sequence
dimension of every batch leaf that has one.

Tactics, on each mesh:
    dp        batch over data (and its sequence dimension over seq), state replicated
    fsdp      dp, and every state leaf sharded over data on its largest dimension that divides
    megatron  each matmul weight, in program order, split over model on its output dimension
              (column-parallel) unless the activation it multiplies already arrives split along
              the contracted dimension, then on that one (row-parallel): Megatron's alternation,
              read from the graph rather than from layer names
    megatron+fsdp  both, the weights' other dimension over data
    expert    weights whose leading dimension is a batch factor of their matmul (stacked experts)
              split over model on it, the rest replicated (expert x data parallelism)
    expert+megatron  experts so, the other weights as Megatron splits them (and +fsdp)
On a mesh with seq > 1 every tactic is also sequence (context) parallel: activations are split
along the sequence, and attention gathers keys and values, as propagation finds.

Levels (Rhino's two):
    fast      meshes without seq, model within one host (the hardware's fast links)
    thorough  every mesh; then, on the meshes whose best tactic is within reach of the best
              overall, the exact solver (`exact.k_best`, an ILP in HiGHS) chooses a split for
              every weight of the folded graph from unary and pairwise costs measured by
              propagation, and its best answers are priced exactly.
Optimizer state follows its parameter (same shape, same path below its container).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from . import exact
from .cost import GraphCost, estimate
from .fold import Fold, fold
from .hardware import Hardware, profile
from .ir import FactorKind, Graph, Op, capture
from .plan import Cost, Plan
from .propagate import Propagation, Sharding, propagate
from .search import PlanInputError, PlanMemoryError, _batch_argnums


@dataclasses.dataclass(frozen=True)
class Candidate:
    tactic: str
    mesh: Mapping[str, int]
    annotations: Mapping[int, Sharding]
    cost: GraphCost
    propagation: Propagation = dataclasses.field(repr=False, compare=False)

    def line(self) -> str:
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
        c = self.cost
        return (
            f"{self.tactic:<14} {mesh:<18} {c.total_seconds * 1e3:9.3f} ms  (compute {c.compute_seconds * 1e3:.3f}, "
            f"comm {c.communication_seconds * 1e3:.3f})  peak {c.peak_bytes_per_device / 2**30:.2f} GiB/device"
        )


@dataclasses.dataclass(frozen=True)
class _Inputs:
    fold: Fold
    ids: list[int]  # representative value id per argument leaf
    keys: list[tuple[str, ...]]  # each leaf's key path inside its argument
    argnum: list[int]
    batch_argnums: tuple[int, ...]
    seconds: tuple[float, float] = (0.0, 0.0)  # capture, fold

    @property
    def graph(self) -> Graph:  # folded: one copy of each repeated layer
        return self.fold.graph

    @functools.cached_property
    def mirror_keys(self) -> tuple[list, list]:
        """Per leaf, what `_mirror_optimizer_state` looks up (built once: a deep model has ~10^4
        leaves and every candidate mirrors): (value, its key below its container), and for the
        leaves outside the batch, (value, each tail of its path, longest first)."""
        shape = lambda v: self.graph.values[v].shape
        below = [(v, (shape(v), keys[1:])) for v, keys in zip(self.ids, self.keys)]
        tails = [
            (v, [(shape(v), keys[-n:]) for n in range(len(keys), 0, -1)])
            for v, keys, a in zip(self.ids, self.keys, self.argnum)
            if a not in self.batch_argnums
        ]
        return below, tails


LEVELS = ("fast", "thorough")
TACTICS = (
    "dp",
    "fsdp",
    "megatron",
    "megatron+fsdp",
    "expert",
    "expert+megatron",
    "expert+megatron+fsdp",
    "refined",
    "exact",
)


def plan(
    fn,
    *args,
    devices,
    hardware: str | Hardware = "h100",
    memory_limit: int | None = None,
    level: str = "fast",
    batch_argnums: Sequence[int] | None = None,
    compile_check: bool | str = "auto",
) -> Plan:
    """The best plan found for `fn(*args)` on `devices` (a count or a list of devices).
    `compile_check`: "auto" compiles the top candidates where predictions are close or a
    primitive has no rule (and this process has the devices); True always, False never.

    Example:
        >>> p = plan(train_step, state, batch, devices=8, hardware="h100")
        >>> p.mesh, p.notes[0]
    """
    n = devices if isinstance(devices, int) else len(devices)
    if n < 1:
        raise PlanInputError(f"devices must be at least 1, got {n}")
    return search(
        fn,
        *args,
        devices=n,
        hardware=hardware,
        memory_limit=memory_limit,
        level=level,
        batch_argnums=batch_argnums,
        compile_check=compile_check,
    )[0]


def search(fn, *args, **kwargs) -> tuple[Plan, list[Candidate]]:
    """The cheapest plan that fits, and every candidate priced (best first); see `_search`.

    The cyclic garbage collector is paused meanwhile: the search allocates many small objects
    while an unrolled graph of ~10^5 ops is alive, and each full collection would walk all of it.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _search(fn, *args, **kwargs)
    finally:
        if enabled:
            gc.enable()


def _search(
    fn,
    *args,
    devices: int,
    hardware: str | Hardware = "h100",
    memory_limit: int | None = None,
    batch_argnums: Sequence[int] | None = None,
    level: str = "fast",
    tactics: Collection[str] | None = None,
    compile_check: bool | str = "auto",
) -> tuple[Plan, list[Candidate]]:
    """The cheapest plan that fits, and every candidate priced (best first). `tactics` limits
    the search to the named ones (`TACTICS`; "exact" is the thorough level's solver).

    Example:
        >>> plan, ranked = search(step, state, batch, devices=8, hardware="h100", level="thorough")
        >>> print("\\n".join(c.line() for c in ranked[:3]))
    """
    t0 = time.perf_counter()
    if level not in LEVELS:
        raise PlanInputError(f"level must be one of {LEVELS}, got {level!r}")
    hw = profile(hardware)
    limit = int(memory_limit or hw.memory_bytes)
    inputs = _inputs(fn, args, batch_argnums)
    t1 = time.perf_counter()
    meshes = _meshes(devices, inputs, hw, level)
    unknown = set(tactics or ()) - set(TACTICS)
    if unknown:
        raise PlanInputError(f"unknown tactics {sorted(unknown)}: expected some of {TACTICS}")
    candidates = [
        c
        for mesh in meshes
        for c in _tactics(inputs, mesh, hw)
        if tactics is None or c.tactic.split("+sequence")[0] in tactics
    ]
    if tactics is None or "refined" in tactics:
        candidates += _refined(inputs, candidates, hw, limit)
    if level == "thorough" and (tactics is None or "exact" in tactics):
        candidates += _solved(inputs, candidates, hw, limit)
    if not candidates:
        raise PlanInputError(f"no mesh of {devices} devices suits the tactics {sorted(tactics or TACTICS)}")
    ranked = sorted(candidates, key=lambda c: c.cost.total_seconds)
    fitting = [c for c in ranked if c.cost.peak_bytes_per_device <= limit]
    if not fitting:
        least = min(candidates, key=lambda c: c.cost.peak_bytes_per_device)
        raise PlanMemoryError(
            f"no plan fits {limit / 2**30:.2f} GiB per device: the smallest needs {least.cost.peak_bytes_per_device / 2**30:.2f} GiB "
            f"({least.tactic} on {dict(least.mesh)}), {(least.cost.peak_bytes_per_device - limit) / 2**30:.2f} GiB over. "
            "Use more devices, a smaller batch, or a larger memory_limit"
        )
    best, guard = _guarded(fn, args, inputs, fitting, devices, hw, limit, compile_check)
    t2 = time.perf_counter()
    timing = (
        f"time: capture {inputs.seconds[0]:.2f} s ({inputs.fold.original_ops} ops), fold {inputs.seconds[1]:.2f} s "
        f"({len(inputs.graph.ops)} ops), search {t2 - t1:.2f} s ({len(candidates)} candidates, level {level})"
    )
    plan = _to_plan(inputs, best, args, devices, t2 - t0, ranked, limit, hw, timing, guard)
    return plan, ranked


CLOSE = 1.25  # candidates predicted within this factor of the best are worth compiling to tell apart
GUARD_TOP = 3  # candidates compiled by the guard


def _guarded(fn, args, inputs: _Inputs, fitting: list[Candidate], devices: int, hw: Hardware, limit: int, check):
    """The compiler as a guard (`compile_check`): where the best candidates are predicted within
    CLOSE of each other, or some primitive was planned without a rule, the best GUARD_TOP (one
    per tactic and mesh) are compiled on this process's devices and the one XLA makes cheapest,
    priced by `verify` with the same hardware profile, is chosen. Skipped, and said why, where
    there are fewer devices here than the plans use."""
    best = fitting[0]
    unknown = sorted(inputs.fold.graph.unknown.items())
    ruleless = f"planned without a rule: {', '.join(f'{k} x{n}' for k, n in unknown)}" if unknown else ""
    # Fast's own pool among them (the same at thorough), so thorough compiles what fast compiles.
    pools = [fitting, [c for c in fitting if _fast_mesh(c.mesh, hw) and not c.tactic.startswith("exact")]]
    close = any(
        len([c for c in pool if c.cost.total_seconds <= CLOSE * pool[0].cost.total_seconds]) >= 2
        for pool in pools
        if pool
    )
    top = [c for pool in pools for c in _distinct(pool)[:GUARD_TOP]]
    top = sorted({id(c): c for c in top}.values(), key=lambda c: c.cost.total_seconds)
    differ = bool(pools[1]) and pools[1][0] is not best
    if check is False or (check == "auto" and not (close or unknown or differ)) or len(top) < 2:
        return best, tuple(n for n in (ruleless,) if n)
    here = len(jax.devices())
    need = max(math.prod(c.mesh.values()) for c in top)
    if here < need:
        why = f"compile check skipped: {here} device(s) in this process, the candidates use {need}"
        return best, tuple(n for n in (ruleless, why) if n)
    from .verify import verify  # (compiles: only when the guard runs)

    priced = []
    for c in top:
        v = verify(_to_plan(inputs, c, args, devices, 0.0, [c], limit, hw), fn, *args, hardware=hw)
        priced.append((v.compute_seconds + v.communication_seconds, c))
    chosen = min(priced, key=lambda t: t[0])[1]
    said = ", ".join(f"{c.tactic} on {_mesh_text(c.mesh)} {sec * 1e3:.3f} ms" for sec, c in priced)
    why = "close predictions" if close else "primitives without a rule" if unknown else "the fast level's best differs"
    note = f"compiled the top {len(priced)} ({why}): {said}; chose {chosen.tactic} on {_mesh_text(chosen.mesh)}"
    return chosen, tuple(n for n in (ruleless, note) if n)


def _distinct(ranked: list[Candidate]) -> list[Candidate]:
    """The best candidate of each tactic and mesh, in order."""
    out: dict[tuple, Candidate] = {}
    for c in ranked:
        out.setdefault((c.tactic, tuple(c.mesh.items())), c)
    return list(out.values())


def _mesh_text(mesh: Mapping[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.items() if v > 1) or "data=1"


def _inputs(fn, args, batch_argnums) -> _Inputs:
    t0 = time.perf_counter()
    abstract = tuple(jax.tree.map(_abstract, a) for a in args)
    graph = capture(fn, *abstract, compact=True)  # the only trace of fn: its output shapes come with the graph
    if batch_argnums is None:
        batch_argnums = _batch_argnums(abstract, graph.out_shape)
    argnum, keys = [], []
    for i, a in enumerate(abstract):
        for p, _ in jax.tree_util.tree_flatten_with_path(a)[0]:
            argnum.append(i)
            keys.append(tuple(_key_name(k) for k in p))
    consts = len(graph.inputs) - len(keys)
    leaves = graph.inputs[consts:]
    t1 = time.perf_counter()
    folded = fold(graph, keys, leaves)
    seconds = (t1 - t0, time.perf_counter() - t1)
    return _Inputs(folded, [folded.of(v) for v in leaves], keys, argnum, tuple(batch_argnums), seconds)


def _abstract(x) -> jax.ShapeDtypeStruct:
    if type(x) is jax.ShapeDtypeStruct and x.sharding is None and not x.weak_type:
        return x  # (already bare: a deep model has ~10^4 leaves)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _meshes(devices: int, inputs: _Inputs, hw: Hardware, level: str) -> list[dict[str, int]]:
    """(data, seq, model) factorizations of all the devices, and of the most devices whose count
    the batch divides (6 of 7 for a batch of 24). `data` must divide the batch and `seq` every
    batch leaf's sequence. The fast level keeps to meshes without seq and with model within a
    host (`_fast_mesh`), except where none of those uses every device (a batch of 64 on 1,024):
    then it also prices all-device meshes with the two largest data axes the batch allows, the
    rest of the devices over seq and model, so a plan uses the cluster wherever that is cheaper."""
    leaves = [
        inputs.graph.values[v].shape
        for v, a in zip(inputs.ids, inputs.argnum)
        if a in inputs.batch_argnums and inputs.graph.values[v].shape
    ]
    if not leaves:
        raise PlanInputError("no batch argument found: pass batch_argnums=... naming the arguments that hold the batch")
    divides = lambda d: all(s[0] % d == 0 for s in leaves)
    seq_divides = lambda q: any(len(s) >= 2 for s in leaves) and all(s[1] % q == 0 for s in leaves if len(s) >= 2)
    counts = [devices] + [next((m for m in range(devices - 1, 0, -1) if divides(m)), 1)]
    valid = {
        m: [
            {"data": m // t // q, "seq": q, "model": t}
            for t in _divisors(m)
            for q in _divisors(m // t)
            if divides(m // t // q) and (q == 1 or seq_divides(q))
        ]
        for m in dict.fromkeys(counts)
    }
    if level != "fast":
        return [mesh for meshes in valid.values() for mesh in meshes]
    out = [mesh for meshes in valid.values() for mesh in meshes if _fast_mesh(mesh, hw)]
    if not any(math.prod(mesh.values()) == devices for mesh in out):
        largest = sorted({mesh["data"] for mesh in valid[devices]}, reverse=True)[:2]
        out += [mesh for mesh in valid[devices] if mesh["data"] in largest]
    return out


def _fast_mesh(mesh: Mapping[str, int], hw: Hardware) -> bool:
    """A mesh the fast level searches: no seq axis, model within one host's fast links."""
    fast_model = hw.devices_per_host if hw.inter.bandwidth < hw.intra.bandwidth else 16
    return mesh["seq"] == 1 and mesh["model"] <= fast_model


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _batch(inputs: _Inputs, mesh: Mapping[str, int]) -> dict[int, Sharding]:
    g, out = inputs.graph, {}
    for v, a in zip(inputs.ids, inputs.argnum):
        shape = g.values[v].shape
        if a in inputs.batch_argnums and shape:
            split = [("data",) if mesh["data"] > 1 else ()] + [()] * (len(shape) - 1)
            if mesh["seq"] > 1 and len(shape) >= 2:
                split[1] = ("seq",)
            if any(split):
                out[v] = tuple(split)
    return out


def _state(inputs: _Inputs) -> list[int]:
    return list(dict.fromkeys(v for v, a in zip(inputs.ids, inputs.argnum) if a not in inputs.batch_argnums))


def _tactics(inputs: _Inputs, mesh: dict[str, int], hw: Hardware) -> list[Candidate]:
    g = inputs.graph
    batch = _batch(inputs, mesh)
    state = _state(inputs)
    plans = {}
    if mesh["model"] == 1:  # a model axis no weight uses would only repeat the same work
        plans["dp"] = dict(batch)
        if mesh["data"] > 1:
            plans["fsdp"] = {**batch, **{v: s for v in state if (s := _fsdp(g.values[v].shape, mesh["data"]))}}
    else:
        tp = _megatron(inputs, mesh, batch)
        plans["megatron"] = {**batch, **tp}
        if mesh["data"] > 1:
            plans["megatron+fsdp"] = {**batch, **_add_fsdp(g, tp, state, mesh["data"])}
        ep = _experts(inputs, mesh)
        if ep:
            plans["expert"] = {**batch, **ep}
            em = _megatron(inputs, mesh, batch, preset=ep)
            plans["expert+megatron"] = {**batch, **em}
            if mesh["data"] > 1:
                plans["expert+megatron+fsdp"] = {**batch, **_add_fsdp(g, em, state, mesh["data"])}
    out = []
    for name, chosen_specs in plans.items():
        if mesh["model"] > 1 and not any("model" in axes for sh in chosen_specs.values() for axes in sh):
            continue  # the tactic found nothing to split: the model axis would only repeat work
        out.append(_priced(inputs, name + ("+sequence" if mesh["seq"] > 1 else ""), mesh, chosen_specs, hw, batch))
    return out


def _priced(
    inputs: _Inputs,
    name: str,
    mesh: Mapping[str, int],
    annotations: Mapping[int, Sharding],
    hw: Hardware,
    batch: Mapping[int, Sharding],
) -> Candidate:
    """`annotations` (the batch's among them) with optimizer state mirrored, propagated with the
    batch first, and priced."""
    annotations = _mirror_optimizer_state(inputs, annotations)
    prop = propagate(inputs.graph, annotations, mesh, first=batch)
    return Candidate(name, dict(mesh), annotations, estimate(inputs.graph, prop, mesh, hw, inputs.fold), prop)


def _refined(inputs: _Inputs, candidates: list[Candidate], hw: Hardware, limit: int) -> list[Candidate]:
    """The best tensor-parallel candidates that fit, improved one weight at a time: each matmul
    weight in program order tries every split over model (and none), priced, and keeps the
    cheapest that fits. The tactics read Megatron's alternation from the graph; where a program
    breaks it (a fused QKV projection cut by `jnp.split`, a router beside the experts), this is
    what finds the split an engineer would choose. On each of the REFINED_TP best meshes, from
    its best candidate without FSDP and its best with (FSDP kept on every trial)."""
    tp = sorted(
        (c for c in candidates if c.mesh["model"] > 1 and c.cost.peak_bytes_per_device <= limit),
        key=lambda c: c.cost.total_seconds,
    )
    starts: dict[tuple, Candidate] = {}
    for pool in (tp, [c for c in tp if _fast_mesh(c.mesh, hw)]):  # (thorough: what fast refines too)
        meshes = list(dict.fromkeys(tuple(c.mesh.items()) for c in pool))[:REFINED_TP]
        for c in pool:
            if tuple(c.mesh.items()) in meshes:
                starts.setdefault((tuple(c.mesh.items()), "fsdp" in c.tactic), c)
    return [_refine(inputs, c, hw, limit, fsdp) for (_, fsdp), c in starts.items()]


REFINED_TP = 2  # meshes whose best tensor-parallel candidates are refined


def _refine(inputs: _Inputs, start: Candidate, hw: Hardware, limit: int, fsdp: bool) -> Candidate:
    mesh, g = dict(start.mesh), inputs.graph
    batch, state = _batch(inputs, mesh), _state(inputs)
    name = "refined" + ("+fsdp" if fsdp else "") + ("+sequence" if mesh["seq"] > 1 else "")
    model_only = lambda sh: tuple(tuple(a for a in axes if a == "model") for axes in sh)
    weights = _weights_in_order(inputs)
    chosen = {w.value: model_only(start.annotations[w.value]) for w in weights if w.value in start.annotations}
    chosen = {v: sh for v, sh in chosen.items() if any(sh)}

    def price(tp):
        ann = _add_fsdp(g, tp, state, mesh["data"]) if fsdp and mesh["data"] > 1 else tp
        return _priced(inputs, name, mesh, {**batch, **ann}, hw, batch)

    best = price(chosen)
    for w in weights:
        shape = w.shape(g)
        for d in [None] + [d for d, n in enumerate(shape) if n % mesh["model"] == 0 and n >= mesh["model"]]:
            trial = {k: v for k, v in chosen.items() if k != w.value}
            if d is not None:
                trial[w.value] = w.sharding(_split(shape, d, "model"))
            if trial == chosen:
                continue
            c = price(trial)
            if c.cost.peak_bytes_per_device <= limit and c.cost.total_seconds < best.cost.total_seconds:
                best, chosen = c, trial
    return best


REFINED_MESHES = 4  # thorough: meshes the exact solver refines, best tactic first
K_BEST = 3  # the solver's best answers priced exactly, per mesh
ROUNDS = 2  # re-linearisations around an improved answer, per mesh


def _solved(inputs: _Inputs, candidates: list[Candidate], hw: Hardware, limit: int) -> list[Candidate]:
    """The exact level on the meshes whose best tactic is cheapest (Rhino: the coarse level
    narrows where the fine one searches), starting from that tactic's plan."""
    by_mesh: dict[tuple, list[Candidate]] = {}
    for c in candidates:
        by_mesh.setdefault(tuple(c.mesh.items()), []).append(c)

    def best(cs):
        fitting = [c for c in cs if c.cost.peak_bytes_per_device <= limit]
        return (
            min(fitting, key=lambda c: c.cost.total_seconds)
            if fitting
            else min(cs, key=lambda c: c.cost.peak_bytes_per_device)
        )

    def rank(cs):
        b = best(cs)
        return (b.cost.peak_bytes_per_device > limit, b.cost.total_seconds)

    meshes = sorted((k for k in by_mesh if dict(k)["model"] > 1), key=lambda k: rank(by_mesh[k]))[:REFINED_MESHES]
    return [c for k in meshes for c in _solve_mesh(inputs, dict(k), hw, limit, best(by_mesh[k]))]


def _solve_mesh(inputs: _Inputs, mesh: dict[str, int], hw: Hardware, limit: int, start: Candidate) -> list[Candidate]:
    """Every weight of the folded graph gets an option: replicated, or one dimension over model.
    Around a reference plan (first the best tactic's), a plan's cost is modelled as the
    reference's, plus each weight's own change, plus a correction for each pair of weights next
    to each other in program order (and the last with the first: the next layer's), all measured
    by propagation; the ILP's best answers are priced exactly, and the best of them becomes the
    next reference while it improves (at most ROUNDS times). Each answer is also priced with FSDP."""
    g, t = inputs.graph, mesh["model"]
    batch = _batch(inputs, mesh)
    found = _weights_in_order(inputs)
    options = [[None] + [d for d, n in enumerate(w.shape(g)) if n % t == 0 and n >= t] for w in found]
    name = "exact" + ("+sequence" if mesh["seq"] > 1 else "")
    cache: dict[tuple, Candidate] = {}

    def price(choice: Sequence[int]) -> Candidate:
        key = tuple(choice)
        if key not in cache:
            ann = {
                w.value: w.sharding(_split(w.shape(g), opts[o], "model"))
                for w, opts, o in zip(found, options, key)
                if o
            }
            cache[key] = _priced(inputs, name, mesh, {**batch, **ann}, hw, batch)
        return cache[key]

    def option_of(w: _Weight, opts: list) -> int:
        given = w.operand_sharding(start.annotations.get(w.value, ()))
        dims = [d for d, axes in enumerate(given) if "model" in axes]
        return opts.index(dims[0]) if dims and dims[0] in opts else 0

    ref = tuple(option_of(w, opts) for w, opts in zip(found, options))
    out = []
    for _ in range(ROUNDS):
        answers = [price(choice) for choice in exact.k_best(_linearised(price, ref, options, limit), K_BEST)]
        out += answers
        fitting = [a for a in answers if a.cost.peak_bytes_per_device <= limit]
        better = min(fitting, key=lambda a: a.cost.total_seconds, default=None)
        if better is None or better.cost.total_seconds >= price(ref).cost.total_seconds:
            break
        ref = next(k for k, c in cache.items() if c is better)
    if mesh["data"] > 1:
        state = _state(inputs)
        for c in list(out):
            tp = {w.value: c.annotations[w.value] for w in found if w.value in c.annotations}
            out.append(
                _priced(inputs, name + "+fsdp", mesh, {**batch, **_add_fsdp(g, tp, state, mesh["data"])}, hw, batch)
            )
    return out


def _linearised(price, ref: tuple[int, ...], options: list[list], limit: int) -> exact.PairwiseProblem:
    base = price(ref)
    sec = lambda c: c.cost.total_seconds / base.cost.total_seconds - 1.0
    mem = lambda c: (c.cost.peak_bytes_per_device - base.cost.peak_bytes_per_device) / limit
    moved = lambda changes: price(tuple(changes.get(i, o) for i, o in enumerate(ref)))
    n = len(ref)
    unary = [[0.0 if o == ref[i] else sec(moved({i: o})) for o in range(len(options[i]))] for i in range(n)]
    unary_mem = [[0.0 if o == ref[i] else mem(moved({i: o})) for o in range(len(options[i]))] for i in range(n)]
    pair, pair_mem = {}, {}
    for i, j in [(i, i + 1) for i in range(n - 1)] + ([(n - 1, 0)] if n > 2 else []):
        both = lambda o, p: o != ref[i] and p != ref[j]  # noqa: B023 (called within the iteration)
        pair[(i, j)] = [
            [
                sec(moved({i: o, j: p})) - unary[i][o] - unary[j][p] if both(o, p) else 0.0
                for p in range(len(options[j]))
            ]
            for o in range(len(options[i]))
        ]
        pair_mem[(i, j)] = [
            [
                mem(moved({i: o, j: p})) - unary_mem[i][o] - unary_mem[j][p] if both(o, p) else 0.0
                for p in range(len(options[j]))
            ]
            for o in range(len(options[i]))
        ]
    return exact.PairwiseProblem(
        unary, pair, unary_mem, pair_mem, budget=(limit - base.cost.peak_bytes_per_device) / limit
    )


def _split(shape, dim: int, axis: str) -> Sharding:
    return tuple((axis,) if i == dim else () for i in range(len(shape)))


def _fsdp(shape, d: int) -> Sharding | None:
    dims = [i for i, s in enumerate(shape) if s % d == 0 and s >= d]
    if not dims:
        return None
    i = max(dims, key=lambda k: shape[k])
    return tuple(("data",) if k == i else () for k in range(len(shape)))


def _add_fsdp(g: Graph, tp: Mapping[int, Sharding], state: list[int], d: int) -> dict[int, Sharding]:
    out = dict(tp)
    for v in state:
        shape = g.values[v].shape
        current = list(tp.get(v, ((),) * len(shape)))
        free = [i for i in range(len(shape)) if not current[i] and shape[i] % d == 0 and shape[i] >= d]
        if free:
            i = max(free, key=lambda k: shape[k])
            current[i] = ("data",)
            out[v] = tuple(current)
    return out


@dataclasses.dataclass(frozen=True)
class _Weight:
    op: Any  # the matmul that first reads it
    k: int  # which operand
    value: int  # the state input
    dims: tuple[int, ...]  # per dimension of the matmul's operand, the input's dimension it is (-1: none)
    rank: int  # the input's

    @property
    def stacked(self) -> bool:
        """Read one layer at a time through a scan (the input's leading dimension is the layer)."""
        return 0 not in self.dims and self.rank > len(self.dims)

    def sharding(self, per_operand: Sharding) -> Sharding:
        """The input's sharding for a split of what the matmul reads."""
        out = [()] * self.rank
        for d, axes in zip(self.dims, per_operand):
            if d >= 0:
                out[d] = tuple(axes)
        return tuple(out)

    def operand_sharding(self, given: Sharding) -> Sharding:
        """What the matmul reads, for a sharding of the input."""
        return tuple(tuple(given[d]) if d >= 0 and d < len(given) else () for d in self.dims)

    def shape(self, g: Graph) -> tuple[int, ...]:
        return g.values[self.op.operands[self.k]].shape


# Ops a weight passes through on its way to a matmul without changing what it holds: a cast (float32
# master weights computed in bfloat16), a copy, a transpose, one layer's slice of a scanned stack.
_CARRIES_WEIGHT = {"convert_element_type", "copy", "copy_p", "reduce_precision", "transpose", "scan_slice"}


def _source(g: Graph, producer: Mapping[int, Op], state: Collection[int], v: int) -> tuple[int, tuple[int, ...]] | None:
    """The state input `v` is read from, through ops that carry a weight unchanged, and per
    dimension of `v` the input's dimension it is (by the factors each op ties them with)."""
    rank = len(g.values[v].shape)
    dims = tuple(range(rank))
    while v not in state:
        op = producer.get(v)
        if op is None or op.primitive not in _CARRIES_WEIGHT or op.body is not None:
            return None
        (src, src_dims) = next(((o, d) for o, d in zip(op.operands, op.operand_dims) if o >= 0), (None, None))
        if src is None:
            return None
        where = {fs[0]: i for i, fs in enumerate(src_dims) if fs}
        res = op.result_dims[op.results.index(v)]
        dims = tuple(where.get(res[d][0], -1) if d >= 0 and res[d] else -1 for d in dims)
        v = src
    return v, dims


def _weights_in_order(inputs: _Inputs) -> list[_Weight]:
    """Matmul weights in program order, first use only, read directly or through a cast, a
    transpose or a layer at a time from a scanned stack. A table read by a gather is one only
    where a matmul reads it too (a tied embedding: its vocabulary split is the logits')."""
    g = inputs.graph
    state = set(_state(inputs))
    producer = {r: op for op in g.ops for r in op.results}
    seen, out = set(), []
    for op in g.ops:
        if op.primitive != "dot_general":
            continue
        for k, v in enumerate(op.operands):
            if v < 0 or len(g.values[v].shape) < 2:
                continue
            found = _source(g, producer, state, v)
            if found is None or found[0] in seen:
                continue
            src, dims = found
            seen.add(src)
            out.append(_Weight(op, k, src, dims, len(g.values[src].shape)))
    return out


def _megatron(
    inputs: _Inputs, mesh: dict[str, int], batch: Mapping[int, Sharding], preset: Mapping[int, Sharding] | None = None
) -> dict[int, Sharding]:
    """Decide weights in program order, propagating after each decision; weights in `preset`
    (stacked experts) take the sharding given there. The graph is folded, so a repeated layer's
    weights are decided once for every copy (TAP)."""
    g, t = inputs.graph, mesh["model"]
    chosen: dict[int, Sharding] = {}
    prop = propagate(g, {**batch}, mesh)
    for weight in _weights_in_order(inputs):
        op, k, w = weight.op, weight.k, weight.value
        if preset and w in preset:
            chosen[w] = preset[w]
            prop = propagate(g, {**batch, **chosen}, mesh, first=batch)
            continue
        other = op.operands[1 - k]
        w_dims, x_dims = op.operand_dims[k], op.operand_dims[1 - k]
        x_sharding = prop.of(other, len(g.values[other].shape)) if other >= 0 else ()
        kind = lambda dims: op.factors[dims[0]].kind if dims else None  # noqa: B023 (called within the iteration)
        arrives_split = any(
            "model" in axes and kind(dims) is FactorKind.REDUCE for axes, dims in zip(x_sharding, x_dims)
        )
        shared = {dims[0] for dims in x_dims if dims}
        if arrives_split:  # row-parallel: split the contracted dimension the activation is split on
            split = {ds[0] for axes, ds in zip(x_sharding, x_dims) if "model" in axes and ds}
            dims = [d for d, ds in enumerate(w_dims) if ds and ds[0] in split]
        else:  # column-parallel: split an output dimension, the major one (heads, not head_dim)
            dims = [d for d, ds in enumerate(w_dims) if kind(ds) is FactorKind.PASS and ds[0] not in shared]
        shape = weight.shape(g)
        dims = [d for d in dims if shape[d] % t == 0]
        if not dims:
            continue
        chosen[w] = weight.sharding(_split(shape, dims[0], "model"))
        prop = propagate(g, {**batch, **chosen}, mesh, first=batch)
    return chosen


def _experts(inputs: _Inputs, mesh: dict[str, int]) -> dict[int, Sharding]:
    """Weights whose dimension is a batch factor (PASS, shared with the activation) of their matmul:
    stacked experts. Split them over model along it."""
    g, t = inputs.graph, mesh["model"]
    out = {}
    for weight in _weights_in_order(inputs):
        op, k = weight.op, weight.k
        w_dims, x_dims = op.operand_dims[k], op.operand_dims[1 - k]
        shared = {f for dims in x_dims for f in dims[:1]}
        shape = weight.shape(g)
        for d, dims in enumerate(w_dims):
            if dims and dims[0] in shared and op.factors[dims[0]].kind is FactorKind.PASS and shape[d] % t == 0:
                out[weight.value] = weight.sharding(_split(shape, d, "model"))
                break
    return out


def _mirror_optimizer_state(inputs: _Inputs, annotations: Mapping[int, Sharding]) -> dict[int, Sharding]:
    """A state leaf with the same shape as an annotated one and the same path below its container
    (`opt/0/mu/layer0/w1` mirrors `params/layer0/w1`) gets the same sharding."""
    out = dict(annotations)
    leaves, tails = inputs.mirror_keys
    below: dict[tuple, Sharding] = {k: annotations[v] for v, k in leaves if v in annotations}
    for v, keys in tails:
        if v in out:
            continue
        hit = next((below[k] for k in keys if k in below), None)
        if hit is not None:
            out[v] = hit
    return out


def _to_plan(
    inputs: _Inputs,
    best: Candidate,
    args,
    devices: int,
    seconds: float,
    ranked: list[Candidate],
    limit: int,
    hw: Hardware,
    timing: str = "",
    guard: tuple[str, ...] = (),
) -> Plan:
    g = inputs.graph
    specs = [_spec(best.propagation.of(v, len(g.values[v].shape))) for v in inputs.ids]
    it = iter(specs)
    in_specs = tuple(jax.tree.map(lambda _: next(it), a) for a in args)
    outs = iter(_spec(best.propagation.of(v, len(g.values[v].shape)) if v >= 0 else ()) for v in g.outputs)
    out_specs = jax.tree.map(lambda _: next(outs), g.out_shape)
    c = best.cost
    cpu_peak = (
        c.peak_bytes_per_device
        if hw.copies_transposed_lhs
        else estimate(
            g, best.propagation, best.mesh, dataclasses.replace(hw, copies_transposed_lhs=True), inputs.fold
        ).peak_bytes_per_device
    )
    cost = Cost(c.compute_seconds, c.communication_seconds, dict(c.collective_bytes), c.peak_bytes_per_device, cpu_peak)
    # Why: the best candidate of every other tactic, and the next best of the chosen one.
    seen, runners = {best.tactic}, [r for r in ranked if r is not best and r.tactic == best.tactic][:1]
    for r in ranked:
        if r.tactic not in seen:
            seen.add(r.tactic)
            runners.append(r)
    used = math.prod(best.mesh.values())
    lost = (_unused(inputs, devices, best, ranked, limit),) if used < devices else ()
    notes = (
        (f"chosen: {best.line()}",)
        + lost
        + tuple(
            f"runner-up: {r.line()}" + ("" if r.cost.peak_bytes_per_device <= limit else "  (over the memory limit)")
            for r in sorted(runners, key=lambda r: r.cost.total_seconds)
        )
        + guard
        + ((timing,) if timing else ())
    )
    mesh = {k: v for k, v in best.mesh.items() if v > 1} or {"data": 1}
    return Plan(
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        cost=cost,
        search_seconds=seconds,
        devices=devices,
        notes=notes,
    )


def _unused(inputs: _Inputs, devices: int, best: Candidate, ranked: list[Candidate], limit: int) -> str:
    """One line: why the plan leaves devices idle."""
    used = math.prod(best.mesh.values())
    head = f"using {used} of {devices} devices: "
    whole = [r for r in ranked if math.prod(r.mesh.values()) == devices]
    fitting = [r for r in whole if r.cost.peak_bytes_per_device <= limit]
    if fitting:
        return head + (
            f"the best plan on all {devices} ({fitting[0].tactic} on {_mesh_text(fitting[0].mesh)}) is predicted "
            f"slower, {fitting[0].cost.total_seconds * 1e3:.3f} ms against {best.cost.total_seconds * 1e3:.3f} ms"
        )
    if whole:
        least = min(whole, key=lambda r: r.cost.peak_bytes_per_device)
        return (
            head
            + f"every plan on all {devices} needs more memory ({least.cost.peak_bytes_per_device / 2**30:.2f} GiB/device)"
        )
    g = inputs.graph
    batch = [
        g.values[v].shape for v, a in zip(inputs.ids, inputs.argnum) if a in inputs.batch_argnums and g.values[v].shape
    ]
    b = math.gcd(*(s[0] for s in batch))
    data = math.gcd(b, devices)
    return head + (
        f"on all {devices}, data can be at most {data} (the batch is {b}) and no weight or sequence splits "
        f"the remaining {devices // data} evenly"
    )


def _spec(sharding: Sharding) -> P:
    entries = [None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in sharding]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)
