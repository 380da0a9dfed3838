"""Tactics over the folded factor graph: on each mesh, each tactic annotates a few inputs (the
batch, some weights), propagation shards everything else, and the cost model prices the result
(`Candidate`); `refined` improves the best of them one weight at a time.

Meshes are every factoring of the devices (and of the most devices the batch divides, 6 of 7 for
a batch of 24) into (data, seq, model); `data` must divide the batch and `seq` the sequence
dimension of every batch leaf that has one.

Tactics, on each mesh:
    dp        batch over data (and its sequence dimension over seq), state replicated
    fsdp      dp, and every state leaf sharded over data on its largest dimension that divides
    megatron  each matmul weight, in program order, split over model on its major output dimension
              (column-parallel) unless the activation it multiplies already arrives split along
              the contracted dimension, then on that one (row-parallel): Megatron's alternation,
              read from the graph rather than from layer names; a table read by lookup (a gather,
              a one-hot matmul) larger than what it makes split by rows, vocabulary-parallel
    megatron+fsdp  both, the weights' other dimension over data
    expert    weights whose leading dimension is a batch factor of their matmul (stacked experts)
              split over model on it, the rest replicated (expert x data parallelism)
    expert+megatron  experts so, the other weights as Megatron splits them (and +fsdp)
    expert (across slices)  on slices, a mesh whose `expert` axis spans whole slices: stacked
              experts split over it, the batch over data and expert (the other weights
              replicated, their gradients reduced over every device), tokens sent to their
              experts across slices in place of the experts' gradients: where expert weights
              outweigh the tokens routed to them
    refined   the best tensor-parallel candidates, each weight's split chosen by price in turn
              (a table's by rows or by columns among them)
On a mesh with seq > 1 every tactic is also sequence (context) parallel: activations are split
along the sequence, and attention gathers keys and values, as propagation finds.
Optimizer state follows its parameter (same shape, same path below its container).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from . import depth
from .arguments import abstract_leaf
from .arguments import batch_argnums as batch_argnums_of
from .capture import capture
from .cost import Cost
from .errors import PlanInputError
from .fold import Fold, fold
from .hardware import Hardware
from .ir import FactorKind, Graph, Op
from .plan import mesh_text
from .pricing import Job, Pricer
from .propagate import Propagation, Sharding, Spreading, propagate
from .stacks import named_leaves


@dataclasses.dataclass(frozen=True)
class Candidate:
    tactic: str
    mesh: Mapping[str, int]
    annotations: Mapping[int, Sharding]
    cost: Cost
    # Its propagation, or how to find it again where the pricing helper priced it (`pricing`).
    spread: Propagation | Callable[[], Propagation] = dataclasses.field(repr=False, compare=False)

    @functools.cached_property
    def propagation(self) -> Propagation:
        return self.spread() if callable(self.spread) else self.spread

    def line(self) -> str:
        mesh = mesh_text(self.mesh, every=True)
        c = self.cost
        return (
            f"{self.tactic:<14} {mesh:<18} {c.total_seconds * 1e3:9.3f} ms  (compute {c.compute_seconds * 1e3:.3f}, "
            f"comm {c.communication_seconds * 1e3:.3f})  peak {c.peak_bytes_per_device / 2**30:.2f} GiB/device"
        )


@dataclasses.dataclass(frozen=True)
class Inputs:
    fold: Fold
    ids: list[int]  # representative value id per argument leaf
    keys: list[tuple[str, ...]]  # each leaf's key path inside its argument
    argnum: list[int]
    batch_argnums: tuple[int, ...]
    seconds: tuple[float, float] = (0.0, 0.0)  # capture, fold
    shallow_steps: tuple = ()  # (fn, args) at the two depths traced, where the step was (`depth.Shallow`)

    @property
    def graph(self) -> Graph:  # folded: one copy of each repeated layer
        return self.fold.graph

    @functools.cached_property
    def mirror_sources(self) -> list[tuple[int, tuple[int, ...]]]:
        """Per state leaf, the leaves whose sharding `_mirror_optimizer_state` would give it, in the
        order it looks (built once: a deep model has ~10^4 leaves and every candidate mirrors):
        for each tail of its path, longest first, the leaves with that shape and that path below
        their container, the last first."""
        values = self.graph.values
        below: dict[tuple, list[int]] = {}
        for v, keys in zip(self.ids, self.keys):
            below.setdefault((values[v].shape, keys[1:]), []).append(v)
        out: dict[int, dict[int, None]] = {}  # a folded value stands for a leaf of every layer
        for v, keys, a in zip(self.ids, self.keys, self.argnum):
            if a in self.batch_argnums:
                continue
            shape, found = values[v].shape, out.setdefault(v, {})
            for n in range(len(keys), 0, -1):
                hit = below.get((shape, keys[-n:]))
                if hit:
                    found.update(dict.fromkeys(reversed(hit)))
        return [(v, tuple(found)) for v, found in out.items() if found]

    @functools.cached_property
    def batch_values(self) -> list[int]:
        """The batch's leaves' values, each once, in leaf order (found once: every candidate asks)."""
        return list(dict.fromkeys(v for v, a in zip(self.ids, self.argnum) if a in self.batch_argnums))

    @functools.cached_property
    def state_values(self) -> list[int]:
        """The other leaves' values (parameters, optimizer state), each once, in leaf order."""
        return list(dict.fromkeys(v for v, a in zip(self.ids, self.argnum) if a not in self.batch_argnums))

    @functools.cached_property
    def weights(self) -> list:
        """`weights_in_order`, found once: every tactic on every mesh, the refinement and the exact
        level ask for them."""
        return _find_weights(self)

    @functools.cached_property
    def producer(self) -> dict[int, Op]:
        """Value -> the op of the folded graph that makes it."""
        return {r: op for op in self.graph.ops for r in op.results}

    @functools.cached_property
    def readers(self) -> dict[int, list[Op]]:
        """Value -> the ops of the folded graph that read it, each once."""
        out: dict[int, list[Op]] = {}
        for op in self.graph.ops:
            for v in dict.fromkeys(op.operands):
                if v >= 0:
                    out.setdefault(v, []).append(op)
        return out

    @functools.cached_property
    def weight_operands(self) -> set[tuple[int, int]]:
        """(matmul, operand) pairs that read a state input, directly or through ops that carry a
        weight unchanged (`_source`), backward passes included: a scanned step's backward reads
        each layer's cast weight as a residual its forward stacked."""
        g, state = self.graph, set(state_values(self))
        carries = _CARRIES_WEIGHT | {"scan_stack"}
        return {
            (op.id, k)
            for op in g.ops
            if op.primitive in _MATMULS
            for k, v in enumerate(op.operands)
            if v >= 0 and _source(g, self.producer, state, v, carries) is not None
        }

    @functools.cached_property
    def feeders(self) -> dict[int, set[int]]:
        """`_feeders` of the weights, found once."""
        return _feeders(self.graph, self.weights)

    @functools.cached_property
    def column_splits(self) -> dict[tuple[int, int], bool]:
        """`_lasts` per (matmul, result dimension), found when first asked."""
        return {}

    @functools.cached_property
    def megatron(self) -> dict:
        """`_megatron`'s decisions, by model size and preset."""
        return {}


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


def read_inputs(fn, args, batch_argnums, shallow_trace: bool = True) -> Inputs:
    """The step captured and folded: from two shallow traces where its arguments hold a deep stack
    of layers it loops over (`depth.shallow`, unless `shallow_trace` is False), else from one
    trace of the whole step."""
    t0 = time.perf_counter()
    abstract = tuple(jax.tree.map(abstract_leaf, a) for a in args)
    named = named_leaves(abstract)  # each path starts with the argument's index
    argnum = [path[0].idx for path, _, _ in named]
    keys = [names[1:] for _, names, _ in named]
    found = depth.shallow(fn, abstract, named) if shallow_trace else None
    steps = found.steps if found is not None else ()
    if found is not None:
        folded, traced, out_shape = found.fold, found.abstract, found.out_shape
        leaves = [found.leaves[i] for i in found.sources]
        t1 = time.perf_counter() - found.fold_seconds
    else:
        traced = abstract
        graph = capture(fn, *abstract, compact=True)  # the only trace of fn: its output shapes come with the graph
        traced, out_shape = abstract, graph.out_shape
        leaves = graph.inputs[len(graph.inputs) - len(keys) :]
        t1 = time.perf_counter()
        folded = fold(graph, keys, leaves)
    if batch_argnums is None:
        batch_argnums = batch_argnums_of(traced, out_shape)
    seconds = (t1 - t0, time.perf_counter() - t1)
    return Inputs(folded, [folded.of(v) for v in leaves], keys, argnum, tuple(batch_argnums), seconds, steps)


def mesh_shapes(devices: int, inputs: Inputs, hw: Hardware, level: str, cross: bool = False) -> list[dict[str, int]]:
    """(data, seq, model) factorizations of all the devices, and of the most devices whose count
    the batch divides (6 of 7 for a batch of 24). `data` must divide the batch and `seq` every
    batch leaf's sequence. The fast level keeps to meshes without seq and with model within a
    host (`fast_mesh`), except where none of those uses every device (a batch of 64 on 1,024):
    then it also prices all-device meshes with the largest data axis the batch allows, the rest
    of the devices over seq and model (model within a host where one allows it, as on the other
    fast meshes), so a plan uses the cluster wherever that is cheaper. A smaller data axis would
    only move devices into seq: the batch and the sequence are cut as many ways in all (the same
    activations per device), the weights' gradients are reduced over as many devices, and only
    the keys and values that seq gathers grow (on every corpus model the largest data axis gave
    the best all-device plan)."""
    leaves = [
        inputs.graph.values[v].shape
        for v, a in zip(inputs.ids, inputs.argnum)
        if a in inputs.batch_argnums and inputs.graph.values[v].shape
    ]
    if not leaves:
        raise PlanInputError("no batch argument found: pass batch_argnums=... naming the arguments that hold the batch")
    divides = lambda d: all(s[0] % d == 0 for s in leaves)
    seq_divides = lambda q: any(len(s) >= 2 for s in leaves) and all(s[1] % q == 0 for s in leaves if len(s) >= 2)
    if hw.slice_devices is not None:
        experts = bool(_experts(inputs, {"model": 1}))
        return sliced_meshes(devices, hw, level, divides, seq_divides, cross, experts)
    counts = [devices] + [next((m for m in range(devices - 1, 0, -1) if divides(m)), 1)]
    valid = {
        m: [
            {"data": m // t // q, "seq": q, "model": t}
            for t in divisors(m)
            for q in divisors(m // t)
            if divides(m // t // q) and (q == 1 or seq_divides(q))
        ]
        for m in dict.fromkeys(counts)
    }
    if level != "fast":
        return [mesh for meshes in valid.values() for mesh in meshes]
    out = [mesh for meshes in valid.values() for mesh in meshes if fast_mesh(mesh, hw)]
    if not any(math.prod(mesh.values()) == devices for mesh in out):
        largest = max(mesh["data"] for mesh in valid[devices])
        fill = [mesh for mesh in valid[devices] if mesh["data"] == largest]
        out += [mesh for mesh in fill if mesh["model"] <= _fast_model(hw)] or fill
    return out


def sliced_meshes(
    devices: int, hw: Hardware, level: str, divides, seq_divides, cross: bool, experts: bool = False
) -> list[dict[str, int]]:
    """Meshes on slices of `hw.slice_devices` devices, laid out slice-major: (replica, data, seq,
    model), `replica` outermost and only across slices (data parallel: state replicated over it,
    so FSDP over `data` inside a slice is hybrid sharding), `data` crossing slices where replica
    does not take them all (FSDP or data parallel everywhere). Tensor and sequence parallelism
    stay inside a slice unless `cross` (asked only when nothing else fits). On all the devices,
    or on the most whole slices that the batch divides. Where the step has stacked experts
    (`experts`), also (data, expert) meshes whose expert axis spans two or more whole slices."""
    per = hw.slice_devices
    slices = devices // per
    counts = [devices] + [next((k * per for k in range(slices - 1, 0, -1) if divides(k * per)), per)]
    out = []
    for m in dict.fromkeys(counts):
        s = m // per
        replicas = divisors(s) if level != "fast" else sorted({1, s})
        for r in replicas:
            for t in divisors(m // r):
                for q in divisors(m // r // t):
                    d = m // r // t // q
                    if not divides(r * d) or (q > 1 and not seq_divides(q)):
                        continue
                    if t * q > per and not cross:
                        continue  # tensor or sequence parallelism over the slow link
                    out.append(
                        {"replica": r, "data": d, "seq": q, "model": t} if r > 1 else {"data": d, "seq": q, "model": t}
                    )
        if experts and not cross:
            for k in divisors(s)[1:]:  # expert parallelism over k whole slices, data parallel over the rest
                if divides(m):
                    out.append({"data": m // (k * per), "expert": k * per, "seq": 1, "model": 1})
    if level != "fast" or cross:
        return out
    fast = [mesh for mesh in out if fast_mesh(mesh, hw) or "expert" in mesh]
    whole = [mesh for mesh in out if math.prod(mesh.values()) == devices]
    if whole and not any(math.prod(mesh.values()) == devices for mesh in fast):  # as `mesh_shapes` fills
        largest = max(mesh.get("replica", 1) * mesh["data"] for mesh in whole)
        fill = [mesh for mesh in whole if mesh.get("replica", 1) * mesh["data"] == largest]
        fast += [mesh for mesh in fill if mesh["model"] <= _fast_model(hw)] or fill
    return fast


def fast_mesh(mesh: Mapping[str, int], hw: Hardware) -> bool:
    """A mesh the fast level searches: no seq axis, model within one host's fast links."""
    return mesh["seq"] == 1 and mesh["model"] <= _fast_model(hw)


def _fast_model(hw: Hardware) -> int:
    return hw.devices_per_host if hw.inter.bandwidth < hw.intra.bandwidth else 16


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def batch_shardings(inputs: Inputs, mesh: Mapping[str, int]) -> dict[int, Sharding]:
    g, out = inputs.graph, {}
    for v in inputs.batch_values:
        shape = g.values[v].shape
        if shape:
            split = [tuple(a for a in ("replica", "data", "expert") if mesh.get(a, 1) > 1)] + [()] * (len(shape) - 1)
            if mesh["seq"] > 1 and len(shape) >= 2:
                split[1] = ("seq",)
            if any(split):
                out[v] = tuple(split)
    return out


def state_values(inputs: Inputs) -> list[int]:
    return list(inputs.state_values)


def tactic_candidates(inputs: Inputs, mesh: dict[str, int], hw: Hardware) -> list[Candidate]:
    return priced_each(inputs, tactic_plans(inputs, mesh), hw)


class TacticPlan(NamedTuple):
    """One tactic's annotations on one mesh, to price: `annotations` hold the batch's, which
    `batch` names again so that they spread first."""

    name: str
    mesh: Mapping[str, int]
    annotations: Mapping[int, Sharding]
    batch: Mapping[int, Sharding]


def tactic_plans(inputs: Inputs, mesh: dict[str, int]) -> list[TacticPlan]:
    """Each tactic's annotations on `mesh`, to price."""
    g = inputs.graph
    batch = batch_shardings(inputs, mesh)
    state = state_values(inputs)
    plans = {}
    if mesh.get("expert", 1) > 1:  # experts across slices, and nothing else on the expert axis
        ep = _experts(inputs, mesh, "expert")
        return [TacticPlan("expert", mesh, {**batch, **ep}, batch)] if ep else []
    if mesh["model"] == 1:  # a model axis no weight uses would only repeat the same work
        plans["dp"] = dict(batch)
        if mesh["data"] > 1:
            plans["fsdp"] = {**batch, **{v: s for v in state if (s := fsdp(g.values[v].shape, mesh["data"]))}}
    else:
        tp = _megatron(inputs, mesh)
        plans["megatron"] = {**batch, **tp}
        if mesh["data"] > 1:
            plans["megatron+fsdp"] = {**batch, **add_fsdp(g, tp, state, mesh["data"])}
        ep = _experts(inputs, mesh)
        if ep:
            plans["expert"] = {**batch, **ep}
            em = _megatron(inputs, mesh, preset=ep)
            plans["expert+megatron"] = {**batch, **em}
            if mesh["data"] > 1:
                plans["expert+megatron+fsdp"] = {**batch, **add_fsdp(g, em, state, mesh["data"])}
    if mesh.get("replica", 1) > 1:  # without FSDP, replica x data is the data axis of their product
        plans = {k: v for k, v in plans.items() if "fsdp" in k}
    return [
        TacticPlan(name + ("+sequence" if mesh["seq"] > 1 else ""), mesh, chosen, batch)
        for name, chosen in plans.items()
        # A tactic that found nothing to split: the model axis would only repeat work.
        if mesh["model"] == 1 or any("model" in axes for sh in chosen.values() for axes in sh)
    ]


def priced(
    inputs: Inputs,
    name: str,
    mesh: Mapping[str, int],
    annotations: Mapping[int, Sharding],
    hw: Hardware,
    batch: Mapping[int, Sharding],
    beyond: float = math.inf,
) -> Candidate | None:
    """`annotations` (the batch's among them) with optimizer state mirrored, propagated with the
    batch first, and priced; None where it takes `beyond` seconds or more (`estimate`)."""
    return next(_each(inputs, [TacticPlan(name, mesh, annotations, batch)], hw, beyond))


def priced_each(
    inputs: Inputs, plans: Sequence[TacticPlan], hw: Hardware, beyond: float = math.inf
) -> list[Candidate | None]:
    """`priced` for each of `plans`, two at a time (`pricing`)."""
    return list(_each(inputs, plans, hw, beyond, whole=True))


def _each(inputs: Inputs, plans: Sequence[TacticPlan], hw: Hardware, beyond: float = math.inf, whole: bool = False):
    """`priced` for each of `plans`, lazily and in order: unless `whole`, a reader may stop at any one."""
    jobs = _Jobs(inputs, plans, beyond)
    for i, (cost, prop) in enumerate(Pricer(inputs.fold, hw).each(jobs, whole)):
        plan, job = jobs.plans[i], jobs[i]
        spread = (
            prop
            if prop is not None
            else functools.partial(propagate, inputs.graph, job.annotations, job.mesh, first=plan.batch)
        )
        yield None if cost is None else Candidate(plan.name, job.mesh, job.annotations, cost, spread)


class _Jobs(Sequence):
    """`plans` as pricing jobs, each made (its optimizer state mirrored) when first asked for: a
    refinement that keeps a trial asks again for the trials after it, and prices only some."""

    def __init__(self, inputs: Inputs, plans: Sequence[TacticPlan], beyond: float):
        self.inputs, self.plans, self.beyond, self._made = inputs, list(plans), beyond, {}

    def __len__(self) -> int:
        return len(self.plans)

    def __getitem__(self, i: int) -> Job:
        if i not in self._made:
            plan = self.plans[i]
            self._made[i] = Job(
                dict(plan.mesh), _mirror_optimizer_state(self.inputs, plan.annotations), tuple(plan.batch), self.beyond
            )
        return self._made[i]


def refined(
    inputs: Inputs, candidates: list[Candidate], hw: Hardware, limit: int, level: str = "fast"
) -> list[Candidate]:
    """The best tensor-parallel candidates that fit, improved one weight at a time: each matmul
    weight in program order tries every split over model (and none), priced, and keeps the
    cheapest that fits. The tactics read Megatron's alternation from the graph; where a program
    breaks it (a fused QKV projection cut by `jnp.split`, a router beside the experts), this is
    what finds the split an engineer would choose. From the best candidate without FSDP and the
    best with (FSDP kept on every trial) on the best mesh at the fast level, each within
    REFINE_REACH of the best candidate that fits; at the thorough level on each of the REFINED_TP
    best meshes, and on those the fast level would refine."""
    fitting = [c.cost.total_seconds for c in candidates if c.cost.peak_bytes_per_device <= limit]
    reach = REFINE_REACH * min(fitting) if level == "fast" and fitting else math.inf
    tp = sorted(
        (
            c
            for c in candidates
            if c.mesh["model"] > 1 and c.cost.peak_bytes_per_device <= limit and c.cost.total_seconds <= reach
        ),
        key=lambda c: c.cost.total_seconds,
    )
    pools = [(tp, 1)] if level == "fast" else [(tp, REFINED_TP), ([c for c in tp if fast_mesh(c.mesh, hw)], 1)]
    starts: dict[tuple, Candidate] = {}
    for pool, count in pools:
        meshes = list(dict.fromkeys(tuple(c.mesh.items()) for c in pool))[:count]
        for c in pool:
            if tuple(c.mesh.items()) in meshes:
                starts.setdefault((tuple(c.mesh.items()), "fsdp" in c.tactic), c)
    if level == "fast":
        # Refinement keeps every trial's FSDP: a start slower than its mesh's start without
        # FSDP, which fits too, is not expected to overtake it, and refining it doubles the work.
        starts = {
            k: c
            for k, c in starts.items()
            if not k[1]
            or (k[0], False) not in starts
            or c.cost.total_seconds < starts[(k[0], False)].cost.total_seconds
        }
    return [_refine(inputs, c, hw, limit, fsdp) for (_, fsdp), c in starts.items()]


REFINED_TP = 2  # meshes whose best tensor-parallel candidates the thorough level refines
REFINE_REACH = 1.25  # the fast level refines a start at most this much slower than the best (as `search.CLOSE`)


def _refine(inputs: Inputs, start: Candidate, hw: Hardware, limit: int, fsdp: bool) -> Candidate:
    mesh, g = dict(start.mesh), inputs.graph
    batch, state = batch_shardings(inputs, mesh), state_values(inputs)
    name = "refined" + ("+fsdp" if fsdp else "") + ("+sequence" if mesh["seq"] > 1 else "")
    model_only = lambda sh: tuple(tuple(a for a in axes if a == "model") for axes in sh)
    weights = weights_in_order(inputs)
    chosen = {w.value: model_only(start.annotations[w.value]) for w in weights if w.value in start.annotations}
    chosen = {v: sh for v, sh in chosen.items() if any(sh)}

    def annotated(tp):
        return {**batch, **(add_fsdp(g, tp, state, mesh["data"]) if fsdp and mesh["data"] > 1 else tp)}

    # The start read back is most often the start itself, already priced.
    same = _mirror_optimizer_state(inputs, annotated(chosen)) == start.annotations
    best = dataclasses.replace(start, tactic=name) if same else priced(inputs, name, mesh, annotated(chosen), hw, batch)
    moves = [
        (w, d)
        for w in weights
        for d in [None] + [d for d, n in enumerate(w.shape(g)) if n % mesh["model"] == 0 and n >= mesh["model"]]
    ]
    at = 0
    while at < len(moves):
        # The trials from `at` on, each against `chosen`, priced ahead two at a time; once one
        # is kept, those after it are tried again against the new choice.
        trials = [(i, t) for i, (w, d) in enumerate(moves) if i >= at and (t := _moved(chosen, w, d, g)) != chosen]
        plans = [TacticPlan(name, mesh, annotated(t), batch) for _, t in trials]
        priced_ahead = _each(inputs, plans, hw, beyond=best.cost.total_seconds)
        try:
            at = len(moves)
            for (i, trial), c in zip(trials, priced_ahead):
                if (
                    c is not None
                    and c.cost.peak_bytes_per_device <= limit
                    and c.cost.total_seconds < best.cost.total_seconds
                ):
                    best, chosen, at = c, trial, i + 1
                    break
        finally:
            priced_ahead.close()
    return best


def _moved(chosen: Mapping[int, Sharding], w: Weight, d: int | None, g: Graph) -> dict[int, Sharding]:
    """`chosen` with weight `w` split over model along dimension `d` (None: not split)."""
    trial = {k: v for k, v in chosen.items() if k != w.value}
    if d is not None:
        trial[w.value] = w.sharding(split_over(w.shape(g), d, "model"))
    return trial


def split_over(shape, dim: int, axis: str) -> Sharding:
    return tuple((axis,) if i == dim else () for i in range(len(shape)))


def fsdp(shape, d: int) -> Sharding | None:
    dims = [i for i, s in enumerate(shape) if s % d == 0 and s >= d]
    if not dims:
        return None
    i = max(dims, key=lambda k: shape[k])
    return tuple(("data",) if k == i else () for k in range(len(shape)))


def add_fsdp(g: Graph, tp: Mapping[int, Sharding], state: list[int], d: int) -> dict[int, Sharding]:
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
class Weight:
    op: Any  # the matmul that first reads it
    k: int  # which operand
    value: int  # the state input
    dims: tuple[int, ...]  # per dimension of the matmul's operand, the input's dimension it is (-1: none)
    rank: int  # the input's

    @property
    def lookup(self) -> bool:
        """Read as a table by a gather (an embedding), not by a matmul."""
        return self.op.primitive == "gather"

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
# master weights computed in bfloat16), a copy, a transpose, a reshape that splits or merges heads
# ([embed, heads * head_dim] read as [embed, heads, head_dim]), one layer's slice of a scanned stack.
_CARRIES_WEIGHT = {
    "convert_element_type",
    "copy",
    "copy_p",
    "reduce_precision",
    "transpose",
    "reshape",
    "squeeze",
    "expand_dims",
    "scan_slice",
}


def _source(
    g: Graph, producer: Mapping[int, Op], state: Collection[int], v: int, carries: Collection[str] = _CARRIES_WEIGHT
) -> tuple[int, tuple[int, ...]] | None:
    """The state input `v` is read from, through ops that carry a weight unchanged (`carries`),
    and per dimension of `v` the input's dimension it is (by the factors each op ties them with)."""
    rank = len(g.values[v].shape)
    dims = tuple(range(rank))
    while v not in state:
        op = producer.get(v)
        if op is None or op.primitive not in carries or op.body is not None:
            return None
        (src, src_dims) = next(((o, d) for o, d in zip(op.operands, op.operand_dims) if o >= 0), (None, None))
        if src is None:
            return None
        where = {fs[0]: i for i, fs in enumerate(src_dims) if fs}
        res = op.result_dims[op.results.index(v)]
        dims = tuple(where.get(res[d][0], -1) if d >= 0 and res[d] else -1 for d in dims)
        v = src
    return v, dims


def weights_in_order(inputs: Inputs) -> list[Weight]:
    """Weights in program order, first use only, read directly or through a cast, a transpose, a
    reshape or a layer at a time from a scanned stack: by a matmul, or as a table by a gather (an
    embedding read by `table[ids]`, `jnp.take` or `take_along_axis`; `Weight.lookup`)."""
    return inputs.weights


# Primitives that read a weight, and how many of their leading operands may be one: a matmul
# either, a gather only its operand (the table; the indices are data).
_READS_WEIGHT = {"dot_general": 2, "ragged_dot_general": 2, "gather": 1}
_MATMULS = ("dot_general", "ragged_dot_general")  # (a ragged one: experts over tokens sorted by expert)


def _find_weights(inputs: Inputs) -> list[Weight]:
    g, producer = inputs.graph, inputs.producer
    state = set(state_values(inputs))
    seen, out = set(), []
    for op in g.ops:
        if op.primitive not in _READS_WEIGHT:
            continue
        for k, v in enumerate(op.operands[: _READS_WEIGHT[op.primitive]]):
            if v < 0 or len(g.values[v].shape) < 2:
                continue
            found = _source(g, producer, state, v)
            if found is None or found[0] in seen:
                continue
            src, dims = found
            seen.add(src)
            out.append(Weight(op, k, src, dims, len(g.values[src].shape)))
    return out


def _megatron(
    inputs: Inputs, mesh: dict[str, int], preset: Mapping[int, Sharding] | None = None
) -> dict[int, Sharding]:
    """Decide weights in program order, each decision spreading (`Spreading`) before the next
    weight's activation is read; weights in `preset` (stacked experts) take the sharding given
    there. A weight is row-parallel where its
    activation arrives split along the contracted dimension, or comes from a column-parallel
    projection through ops that lost the split (a fused QKV cut by `jnp.split`): Megatron's pairs,
    read from the dataflow. The graph is folded, so a repeated layer's weights are decided once
    for every copy (TAP). The decisions read only where the model axis goes, which the batch's
    axes never contest (they split other dimensions), so they are made on the model axis alone,
    once per model size and preset, for every mesh (the same decisions as with the batch beside
    them on all 150 cases of the corpus's first 15 models on five meshes)."""
    key = (mesh["model"], tuple(sorted((preset or {}).items())))
    if key not in inputs.megatron:
        alone = {axis: 1 for axis in mesh} | {"model": mesh["model"]}
        inputs.megatron[key] = _megatron_on(inputs, alone, preset)
    return dict(inputs.megatron[key])


def _megatron_on(inputs: Inputs, mesh: dict[str, int], preset: Mapping[int, Sharding] | None) -> dict[int, Sharding]:
    g, t = inputs.graph, mesh["model"]
    chosen: dict[int, Sharding] = {}
    column: set[int] = set()  # matmuls whose weight went column-parallel
    weights, feeders = weights_in_order(inputs), inputs.feeders
    spread = Spreading(g, mesh)
    for weight in weights:
        op, k, w = weight.op, weight.k, weight.value
        if preset and w in preset:
            chosen[w] = preset[w]
            spread.add({w: preset[w]})
            continue
        if weight.lookup or _one_hot(inputs, op.operands[1 - k]):
            _vocabulary(inputs, weight, t, chosen, spread)
            continue
        other = op.operands[1 - k]
        w_dims, x_dims = op.operand_dims[k], op.operand_dims[1 - k]
        x_sharding = spread.of(other, len(g.values[other].shape)) if other >= 0 else ()
        kind = lambda dims: op.factors[dims[0]].kind if dims else None  # noqa: B023 (called within the iteration)
        arrives_split = any(
            "model" in axes and kind(dims) is FactorKind.REDUCE for axes, dims in zip(x_sharding, x_dims)
        )
        shared = {dims[0] for dims in x_dims if dims}
        if arrives_split:  # row-parallel: split the contracted dimension the activation is split on
            split = {ds[0] for axes, ds in zip(x_sharding, x_dims) if "model" in axes and ds}
            dims = [d for d, ds in enumerate(w_dims) if ds and ds[0] in split]
        elif feeders[op.id] & column:  # row-parallel after a split the dataflow lost: the major contracted dim
            dims = [d for d, ds in enumerate(w_dims) if kind(ds) is FactorKind.REDUCE]
        else:  # column-parallel: split an output dimension whose split lasts, the major one (heads)
            dims = [
                d
                for d, ds in enumerate(w_dims)
                if kind(ds) is FactorKind.PASS and ds[0] not in shared and _lasts(inputs, op, ds[0])
            ]
        shape = weight.shape(g)
        dims = [d for d in dims if shape[d] % t == 0]
        if not dims:
            continue
        if kind(w_dims[dims[0]]) is FactorKind.PASS:
            column.add(op.id)
        chosen[w] = weight.sharding(split_over(shape, dims[0], "model"))
        spread.add({w: chosen[w]})
    return chosen


def _vocabulary(inputs: Inputs, weight: Weight, t: int, chosen: dict, spread: Spreading) -> None:
    """A table read by lookup (a gather, or a matmul against a one-hot) split by rows, over model:
    Megatron-LM's VocabParallelEmbedding (MaxText shards the vocabulary on its tensor axis too).
    Each device looks up the rows it holds and an all-reduce of the activations sums the parts,
    so it pays where the table outweighs the activations it makes (a token embedding, not a
    learned position table read once per position)."""
    g, op = inputs.graph, weight.op
    lookup_kind = FactorKind.GATHER if weight.lookup else FactorKind.REDUCE
    dims = op.operand_dims[weight.k]
    shape = weight.shape(g)
    rows = [d for d, fs in enumerate(dims) if fs and op.factors[fs[0]].kind is lookup_kind and shape[d] % t == 0]
    if not rows or g.values[weight.value].nbytes <= g.values[op.results[0]].nbytes:
        return
    chosen[weight.value] = weight.sharding(split_over(shape, rows[0], "model"))
    spread.add({weight.value: chosen[weight.value]})


def _one_hot(inputs: Inputs, v: int) -> bool:
    """Whether `v` is a one-hot encoding (`jax.nn.one_hot`: ids compared with an iota, then cast):
    a matmul against it is a lookup."""
    op = inputs.producer.get(v)
    while op is not None and op.primitive in ("convert_element_type", "broadcast_in_dim", "reshape"):
        op = inputs.producer.get(op.operands[0])
    return op is not None and op.primitive == "eq"


def _lasts(inputs: Inputs, op, factor: int) -> bool:
    """Whether a column-parallel split of matmul `op`'s output along `factor` lasts to the next
    matmuls on every path forward: not sliced away (a stacked K/V kernel's selector, read as
    kv[0] and kv[1]) nor contracted against another activation (head_dim in q . k); a reduction,
    a lookup along it (the labels' logits) or a matmul against a weight (Megatron's row-parallel
    pair) keeps it. Where no output dimension lasts (two K/V heads on a model axis of four), the
    weight stays whole, as Megatron-LM replicates K/V heads fewer than its tensor-parallel degree."""
    key = (op.id, factor)
    if key not in inputs.column_splits:
        dim = next((d for d, fs in enumerate(op.result_dims[0]) if fs and fs[0] == factor), None)
        inputs.column_splits[key] = dim is not None and not _cut(inputs, op.results[0], dim)
    return inputs.column_splits[key]


def _cut(inputs: Inputs, value: int, dim: int, budget: int = 512) -> bool:
    """Whether a split of `value`'s dimension `dim` is cut on some path forward (`_lasts`), each
    (value, dimension) followed once; after `budget` of them it is taken to last (a layer's
    forward is well within it, and a split kept too long costs a reshard, not a wrong result)."""
    g, weights, readers = inputs.graph, inputs.weight_operands, inputs.readers
    stack, seen = [(value, dim)], set()
    while stack and len(seen) < budget:
        v, d = stack.pop()
        if (v, d) in seen:
            continue
        seen.add((v, d))
        for op in readers.get(v, ()):
            if op.body is not None or not op.results:  # a loop body or a tie: nothing to follow
                continue
            for k in (k for k, o in enumerate(op.operands) if o == v):
                fs = op.operand_dims[k][d] if d < len(op.operand_dims[k]) else ()
                kind = op.factors[fs[0]].kind if fs else None
                if op.primitive in _MATMULS:
                    if kind is FactorKind.REDUCE and (op.id, 1 - k) not in weights:
                        return True
                    continue
                if kind in (FactorKind.REDUCE, FactorKind.GATHER):  # a reduction or a lookup along it
                    continue
                after = _goes_on(g, op, fs[0] if fs else None, len(g.values[v].shape), d)
                if after is None:
                    return True
                stack.extend(after)
    return False


def _goes_on(g: Graph, op, factor: int | None, rank: int, d: int) -> list[tuple[int, int]] | None:
    """Where dimension `d` (carrying `factor` into `op`) goes on in `op`'s results: the dims
    its factor leads; else, where `op` cuts it into pieces longer than one (RoPE's halves, a
    fused QKV cut in three by `jnp.split`), each piece's; [] where it goes on as a minor factor
    (not followed). None where it is indexed away (kv[0]: a piece of one)."""
    if factor is not None:
        led = [
            (r, i) for r, dims in zip(op.results, op.result_dims) for i, fs in enumerate(dims) if fs and fs[0] == factor
        ]
        if led or any(factor in fs for dims in op.result_dims for fs in dims):
            return led
    pieces = [r for r in op.results if len(g.values[r].shape) == rank and g.values[r].shape[d] > 1]
    return [(r, d) for r in pieces] or None


def _feeders(g: Graph, weights: list[Weight]) -> dict[int, set[int]]:
    """Per weight's matmul, the weights' matmuls whose results reach its activation through ops
    that multiply by no weight (attention, norms, a split, a residual add), and are at least as
    large as it (the stream it consumes, not a router's gates beside it)."""
    out = {}
    for w, reached in zip(weights, _reaching(g, weights)):
        size = g.values[w.op.operands[1 - w.k]].nbytes
        out[w.op.id] = {op.id for op, v in reached if g.values[v].nbytes >= size}
    return out


def _reaching(g: Graph, weights: list[Weight]) -> list[list[tuple[Op, int]]]:
    """Per weight, the nearest weights' matmuls its activation is computed from, each with the
    value it made on the way."""
    mine = {w.op.id for w in weights}
    producer = {r: op for op in g.ops for r in op.results}
    out = []
    for w in weights:
        found, seen, stack = [], set(), [w.op.operands[1 - w.k]]
        while stack:
            v = stack.pop()
            if v < 0 or v in seen or v not in producer:
                continue
            seen.add(v)
            op = producer[v]
            if op.id in mine:
                found.append((op, v))
                continue
            stack.extend(op.operands)
        out.append(found)
    return out


def _experts(inputs: Inputs, mesh: dict[str, int], axis: str = "model") -> dict[int, Sharding]:
    """Weights whose dimension is a batch factor (PASS, shared with the activation) of their matmul:
    stacked experts. Split them over `axis` along it."""
    g, t = inputs.graph, mesh[axis]
    out = {}
    for weight in weights_in_order(inputs):
        if weight.lookup:
            continue
        op, k = weight.op, weight.k
        w_dims, x_dims = op.operand_dims[k], op.operand_dims[1 - k]
        shared = {f for dims in x_dims for f in dims[:1]}
        shape = weight.shape(g)
        for d, dims in enumerate(w_dims):
            if dims and dims[0] in shared and op.factors[dims[0]].kind is FactorKind.PASS and shape[d] % t == 0:
                out[weight.value] = weight.sharding(split_over(shape, d, axis))
                break
    return out


def _mirror_optimizer_state(inputs: Inputs, annotations: Mapping[int, Sharding]) -> dict[int, Sharding]:
    """A state leaf with the same shape as an annotated one and the same path below its container
    (`opt/0/mu/layer0/w1` mirrors `params/layer0/w1`) gets the same sharding."""
    out = dict(annotations)
    for v, sources in inputs.mirror_sources:
        if v not in out:
            hit = next((annotations[s] for s in sources if s in annotations), None)
            if hit is not None:
                out[v] = hit
    return out
