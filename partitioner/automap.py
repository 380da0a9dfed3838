"""Tactics over the factor graph: each tactic annotates a few inputs (the batch, some weights),
propagation shards everything else, and the cost model prices the result; the cheapest plan that
fits in memory wins, and the runners-up are kept with their costs, to say why.

Tactics, on every mesh (data=d, model=t) with d*t devices that divide the batch:
    dp        batch over data, state replicated
    fsdp      dp, and every state leaf sharded over data on its largest dimension that divides
    megatron  batch over data; each matmul weight, in program order, split over model on its
              output dimension (column-parallel) unless the activation it multiplies already
              arrives split along the contracted dimension, then on that one (row-parallel):
              Megatron's alternation, read from the graph rather than from layer names
    megatron+fsdp  both, the weights' other dimension over data
    expert    weights whose leading dimension is a batch factor of their matmul (stacked experts)
              split over model on it
Optimizer state follows its parameter (same shape, same path below its container).

This is the search's first level: a handful of propagations per mesh. It is not yet wired into
`partitioner.plan`, which the orchestrator uses; see `search(...)`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import PartitionSpec as P

from .cost import GraphCost, estimate
from .hardware import Hardware, profile
from .ir import FactorKind, Graph, Repeat, capture, find_repeats
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
        return (f"{self.tactic:<14} {mesh:<18} {c.total_seconds * 1e3:9.3f} ms  (compute {c.compute_seconds * 1e3:.3f}, "
                f"comm {c.communication_seconds * 1e3:.3f})  peak {c.peak_bytes_per_device / 2**30:.2f} GiB/device")


@dataclasses.dataclass(frozen=True)
class _Inputs:
    graph: Graph
    ids: list[int]  # value id per argument leaf
    keys: list[tuple[str, ...]]  # each leaf's key path inside its argument
    argnum: list[int]
    batch_argnums: tuple[int, ...]


def search(fn, *args, devices: int, hardware: str | Hardware = "h100", memory_limit: int | None = None,
           batch_argnums: Sequence[int] | None = None) -> tuple[Plan, list[Candidate]]:
    """The cheapest plan that fits, and every candidate priced (best first).

    Example:
        >>> plan, ranked = search(step, state, batch, devices=8, hardware="h100")
        >>> print("\\n".join(c.line() for c in ranked[:3]))
    """
    t0 = time.perf_counter()
    hw = profile(hardware)
    limit = int(memory_limit or hw.memory_bytes)
    inputs = _inputs(fn, args, batch_argnums)
    candidates = [c for mesh in _meshes(devices, inputs) for c in _tactics(inputs, mesh, hw)]
    ranked = sorted(candidates, key=lambda c: c.cost.total_seconds)
    fitting = [c for c in ranked if c.cost.peak_bytes_per_device <= limit]
    if not fitting:
        least = min(candidates, key=lambda c: c.cost.peak_bytes_per_device)
        raise PlanMemoryError(
            f"no plan fits {limit / 2**30:.2f} GiB per device: the smallest needs {least.cost.peak_bytes_per_device / 2**30:.2f} GiB "
            f"({least.tactic} on {dict(least.mesh)}), {(least.cost.peak_bytes_per_device - limit) / 2**30:.2f} GiB over. "
            "Use more devices, a smaller batch, or a larger memory_limit")
    best = fitting[0]
    plan = _to_plan(inputs, best, args, devices, time.perf_counter() - t0, ranked, limit)
    return plan, ranked


def _inputs(fn, args, batch_argnums) -> _Inputs:
    abstract = tuple(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), a) for a in args)
    graph = capture(fn, *abstract)  # the only trace of fn: its output shapes come with the graph
    if batch_argnums is None:
        batch_argnums = _batch_argnums(abstract, graph.out_shape)
    argnum, keys = [], []
    for i, a in enumerate(abstract):
        for p, _ in jax.tree_util.tree_flatten_with_path(a)[0]:
            argnum.append(i)
            keys.append(tuple(_key_name(k) for k in p))
    consts = len(graph.inputs) - len(keys)
    return _Inputs(graph, graph.inputs[consts:], keys, argnum, tuple(batch_argnums))


def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _meshes(devices: int, inputs: _Inputs) -> list[dict[str, int]]:
    """(data, model) factorizations of all the devices, and of the most devices whose count the
    batch divides (6 of 7 for a batch of 24): data must divide every batch leaf."""
    batch = [inputs.graph.values[v].shape[0] for v, a in zip(inputs.ids, inputs.argnum)
             if a in inputs.batch_argnums and inputs.graph.values[v].shape]
    if not batch:
        raise PlanInputError("no batch argument found: pass batch_argnums=... naming the arguments that hold the batch")
    divides = lambda d: all(b % d == 0 for b in batch)
    counts = [devices] + [next((m for m in range(devices - 1, 0, -1) if divides(m)), 1)]
    return [{"data": m // t, "model": t} for m in dict.fromkeys(counts) for t in _divisors(m) if divides(m // t)]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _tactics(inputs: _Inputs, mesh: dict[str, int], hw: Hardware) -> list[Candidate]:
    g = inputs.graph
    batch = {v: (("data",),) + ((),) * (len(g.values[v].shape) - 1)
             for v, a in zip(inputs.ids, inputs.argnum) if a in inputs.batch_argnums and g.values[v].shape and mesh["data"] > 1}
    state = [v for v, a in zip(inputs.ids, inputs.argnum) if a not in inputs.batch_argnums]
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
    out = []
    for name, annotations in plans.items():
        if mesh["model"] > 1 and not any("model" in axes for sh in annotations.values() for axes in sh):
            continue  # the tactic found nothing to split: the model axis would only repeat work
        annotations = _mirror_optimizer_state(inputs, annotations)
        prop = propagate(g, annotations, mesh)
        out.append(Candidate(name, dict(mesh), annotations, estimate(g, prop, mesh, hw), prop))
    return out


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


def _weights_in_order(inputs: _Inputs) -> list[tuple[Any, int, int]]:
    """(matmul op, weight operand index, weight value) in program order, first use only; tables
    read by a gather (embeddings) are left to the other tactics."""
    g = inputs.graph
    state = {v for v, a in zip(inputs.ids, inputs.argnum) if a not in inputs.batch_argnums}
    gathered = {op.operands[0] for op in g.ops if op.primitive == "gather"}
    seen, out = set(), []
    for op in g.ops:
        if op.primitive != "dot_general":
            continue
        for k, v in enumerate(op.operands):
            if v in state and v not in seen and v not in gathered and len(g.values[v].shape) >= 2:
                seen.add(v)
                out.append((op, k, v))
    return out


def _megatron(inputs: _Inputs, mesh: dict[str, int], batch: Mapping[int, Sharding]) -> dict[int, Sharding]:
    """Decide weights in program order; a weight first used in a repeated layer (TAP: identical
    blocks of ops, `find_repeats`) copies the decision made for the same position in the first
    copy of that layer instead of propagating again, so the number of propagations does not grow
    with depth."""
    g, t = inputs.graph, mesh["model"]
    chosen: dict[int, Sharding] = {}
    decided: dict[tuple[int, int], Sharding | None] = {}  # (op id, operand) in a first copy -> decision
    repeats = [r for r in find_repeats(g) if r.period >= 8]
    prop = propagate(g, {**batch}, mesh)
    for op, k, w in _weights_in_order(inputs):
        first = _first_copy(op.id, repeats)
        if first is not None and (first, k) in decided:
            if decided[(first, k)] is not None and g.values[w].shape == g.values[g.ops[first].operands[k]].shape:
                chosen[w] = decided[(first, k)]
            continue
        other = op.operands[1 - k]
        w_dims, x_dims = op.operand_dims[k], op.operand_dims[1 - k]
        x_sharding = prop.of(other, len(g.values[other].shape)) if other >= 0 else ()
        kind = lambda dims: op.factors[dims[0]].kind if dims else None
        arrives_split = any("model" in axes and kind(dims) is FactorKind.REDUCE for axes, dims in zip(x_sharding, x_dims))
        shared = {dims[0] for dims in x_dims if dims}
        if arrives_split:  # row-parallel: split the contracted dimension, as the activation is
            dims = [d for d, ds in enumerate(w_dims) if kind(ds) is FactorKind.REDUCE]
        else:  # column-parallel: split an output dimension
            dims = [d for d, ds in enumerate(w_dims) if kind(ds) is FactorKind.PASS and ds[0] not in shared]
        shape = g.values[w].shape
        dims = [d for d in dims if shape[d] % t == 0]
        decided[(op.id, k)] = tuple(("model",) if i == dims[-1] else () for i in range(len(shape))) if dims else None
        if not dims:
            continue
        chosen[w] = decided[(op.id, k)]
        prop = propagate(g, {**batch, **chosen}, mesh)
    return chosen


def _first_copy(op_id: int, repeats: list[Repeat]) -> int | None:
    """The op at the same position in the first copy of the repeated block `op_id` lies in."""
    for r in repeats:
        if r.start + r.period <= op_id < r.stop:
            return r.start + (op_id - r.start) % r.period
    return None


def _experts(inputs: _Inputs, mesh: dict[str, int]) -> dict[int, Sharding]:
    """Weights whose dimension is a batch factor (PASS, shared with the activation) of their matmul:
    stacked experts. Split them over model along it."""
    g, t = inputs.graph, mesh["model"]
    out = {}
    for op, k, w in _weights_in_order(inputs):
        w_dims, x_dims = op.operand_dims[k], op.operand_dims[1 - k]
        shared = {f for dims in x_dims for f in dims[:1]}
        for d, dims in enumerate(w_dims):
            if dims and dims[0] in shared and op.factors[dims[0]].kind is FactorKind.PASS and g.values[w].shape[d] % t == 0:
                out[w] = tuple(("model",) if i == d else () for i in range(len(g.values[w].shape)))
                break
    return out


def _mirror_optimizer_state(inputs: _Inputs, annotations: Mapping[int, Sharding]) -> dict[int, Sharding]:
    """A state leaf with the same shape as an annotated one and the same path below its container
    (`opt/0/mu/layer0/w1` mirrors `params/layer0/w1`) gets the same sharding."""
    g = inputs.graph
    out = dict(annotations)
    below: dict[tuple, Sharding] = {(g.values[v].shape, keys[1:]): annotations[v]
                                    for v, keys in zip(inputs.ids, inputs.keys) if v in annotations}
    for v, keys, a in zip(inputs.ids, inputs.keys, inputs.argnum):
        if v in out or a in inputs.batch_argnums:
            continue
        hit = next((below[k] for n in range(len(keys), 0, -1) if (k := (g.values[v].shape, keys[-n:])) in below), None)
        if hit is not None:
            out[v] = hit
    return out


def _to_plan(inputs: _Inputs, best: Candidate, args, devices: int, seconds: float, ranked: list[Candidate], limit: int) -> Plan:
    g = inputs.graph
    specs = [_spec(best.propagation.of(v, len(g.values[v].shape))) for v in inputs.ids]
    it = iter(specs)
    in_specs = tuple(jax.tree.map(lambda _: next(it), a) for a in args)
    outs = iter(_spec(best.propagation.of(v, len(g.values[v].shape)) if v >= 0 else ()) for v in g.outputs)
    out_specs = jax.tree.map(lambda _: next(outs), g.out_shape)
    c = best.cost
    cost = Cost(c.compute_seconds, c.communication_seconds, dict(c.collective_bytes), c.peak_bytes_per_device)
    # Why: the best candidate of every other tactic, and the next best of the chosen one.
    seen, runners = {best.tactic}, [r for r in ranked if r is not best and r.tactic == best.tactic][:1]
    for r in ranked:
        if r.tactic not in seen:
            seen.add(r.tactic)
            runners.append(r)
    notes = (f"chosen: {best.line()}",) + tuple(
        f"runner-up: {r.line()}" + ("" if r.cost.peak_bytes_per_device <= limit else "  (over the memory limit)")
        for r in sorted(runners, key=lambda r: r.cost.total_seconds))
    mesh = {k: v for k, v in best.mesh.items() if v > 1} or {"data": 1}
    return Plan(mesh=mesh, in_specs=in_specs, out_specs=out_specs, cost=cost, search_seconds=seconds,
                devices=devices, notes=notes)


def _spec(sharding: Sharding) -> P:
    entries = [None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in sharding]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)
