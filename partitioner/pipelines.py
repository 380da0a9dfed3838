"""Pipelines as candidates (Rhino chooses them; no JAX system does): for a step with a layer scan
(`layerscan`), each stage count whose stages sit across the slowest links the devices have
(slices, else hosts) gets the plans for one stage's devices (a search of its own: its best, and
the best of each other tactic, as a stage that must hold its layers' weights gathered may need
Megatron's split of them more than the fastest plan), each composed with the stage axis and priced
for each microbatch count, circular repeats, each stage's weights gathered once per step or per
microbatch, and a stage rematerialised or not:

    the layers        their compute and their activations' collectives on one stage, over
                      R*M+S-1 ticks of one microbatch each (the bubble is (S-1)/(R*M+S-1));
                      the weights' collectives once per step (each stage gathered once), or at
                      each tick for the layers the stage applies (gathered per microbatch)
    the rest          embedding, head and loss with the stage axis as data parallelism: their
                      work split S ways more, the non-stacked weights' gradients all-reduced
                      over the stage axis
    the sends         a microbatch's activations between neighbouring stages, forward and
                      backward, on the link level the stage axis crosses; with repeats, the
                      stacked weights moved into their circular order and their gradients back
    memory            the stacked state and the layers' activations split S ways, a stage's
                      weights gathered over the batch's axes and their gradients' sums beside
                      them (gathered per microbatch: a layer's at a time, which the model leaves out)

The pipelined plan is chosen where it is predicted cheaper than the best without one
(`pipeline="auto"`), or asked for (`pipeline=N`); its notes say the bubble's share, what crosses
each link level and the best plan without a pipeline.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P

from .analysis import Inputs
from .candidates import Candidate
from .cost import Cost
from .errors import PlanInputError, PlanMemoryError
from .explain import to_plan
from .guard import CLOSE, compiled_seconds
from .hardware import Hardware, latency_steps
from .layerscan import LayerScan, find_layer_scan
from .pipeline import STAGE, Pipeline
from .plan import FlatSpecs, Plan, _flatten_specs, mesh_text
from .program import ScanLayout

_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Inputs -> (LayerScan | None, why)


def layer_scan(fn, args, inputs: Inputs) -> tuple[LayerScan | None, str]:
    """The step's layer scan, found once per reading of the step (a step with no scan op is not
    traced again)."""
    found = _FOUND.get(inputs)
    if found is None:
        if not any(op.trips > 1 for op in inputs.graph.ops):
            found = (None, "no pipeline: the step applies no layer scan (layers in a Python loop); write them as "
                     "jax.lax.scan over weights stacked [layers, ...] to pipeline them")  # fmt: skip
        else:
            found = find_layer_scan(fn, args, inputs.batch_argnums)
        _FOUND[inputs] = found
    return found


def scan_layout(plan: Plan, scan: LayerScan, batch_argnums) -> ScanLayout:
    """Where `plan` puts the layer scan's carry: as the batch's first leaf, the stage axis left out."""
    first = jax.tree.leaves(plan.in_specs[batch_argnums[0]], is_leaf=lambda s: isinstance(s, P))
    entries = tuple(first[0]) if first else ()
    carry = tuple(_drop(e, STAGE) for e in entries)
    return ScanLayout(scan.length, scan.batch, carry, tuple(batch_argnums), scan.vmapped)


def _drop(entry, axis: str):
    if entry is None or entry == axis:
        return None
    if isinstance(entry, tuple):
        kept = tuple(a for a in entry if a != axis)
        return kept if len(kept) > 1 else (kept[0] if kept else None)
    return entry


def stage_counts(asked, devices: int, slices: int, layers: int, hw: Hardware) -> tuple[list[int], str]:
    """The stage counts to price, and a note where the count asked for was moved to fit: `asked`
    "auto" prices stages across slices (or hosts, on one slice); N, the nearest count that
    divides the layers and the devices (none: no pipeline, said in the note)."""
    fits = [s for s in range(2, devices + 1) if devices % s == 0 and layers % s == 0]
    if asked == "auto":
        unit = slices if slices > 1 else max(devices // hw.devices_per_host, 1)
        return [s for s in fits if unit % s == 0][-2:], ""  # (stages of one or two slices: the slow links)
    if not fits:
        return [], (
            f"no pipeline: pipeline={asked} asked for, but no count of 2 or more stages divides both the {layers} "
            f"layers and the {devices} devices"
        )
    near = min(fits, key=lambda s: (abs(s - asked), -s))
    moved = "" if near == asked else (
        f"pipeline={asked} does not fit {layers} layers on {devices} devices"
        + (f" in {slices} slices" if slices > 1 else "") + f": {near} stages, the nearest that does"
    )  # fmt: skip
    return [near], moved


@dataclasses.dataclass(frozen=True)
class Priced:
    pipeline: Pipeline
    cost: Cost
    inner: Candidate  # one stage's plan
    sends: int  # bytes each device sends to the next stage per step
    level: str  # the link level the stage axis crosses


# Remat (each stage's forward on a microbatch computed again in its backward pass) keeps a stage's
# input per tick instead of every layer's, for one more forward pass of the layers: priced with
# the weights gathered once (gathered per microbatch, it would gather them once more, unpriced).
# Gathering per microbatch is a form only where the stage's weights are split over the batch's
# axes (FSDP): otherwise there is nothing to gather, and the two forms run the same collectives.
_FORMS = ((True, False), (False, False), (True, True))  # (gather_once, remat)


def priced(scan: LayerScan, inner: Sequence[Candidate], inputs: Inputs, stages: int, devices: int,
           hw: Hardware, limit: int) -> Priced | None:  # fmt: skip
    """The cheapest pipeline of `stages` over one of `inner` (plans for one stage's devices)
    that fits in `limit`, or None."""
    level = hw.level(devices)
    link = hw.link(devices)  # (the stage axis is outermost: its neighbours are a stage's devices apart)
    out = []
    for candidate in inner:
        parts = _Parts.of(scan, candidate, inputs)
        for repeats in [r for r in (1, 2, 4) if scan.length % (stages * r) == 0]:
            for m in _microbatch_counts(scan.batch, parts.batch_split, stages, repeats):
                for once, remat in _FORMS:
                    if not once and parts.gathered_bytes <= parts.weight_bytes:
                        continue
                    p = Pipeline(stages, m, repeats, layers=scan.length, gather_once=once, remat=remat)
                    cost, sends = _cost(p, parts, link, hw)
                    if cost.peak_bytes_per_device <= limit:
                        out.append(Priced(p, cost, candidate, sends, level))
    return min(out, key=lambda x: x.cost.total_seconds, default=None)


def cost_of(p: Pipeline, scan: LayerScan, inner: Candidate, inputs: Inputs, devices: int, hw: Hardware) -> Cost:
    """Pipeline `p` over `inner` (one stage's plan) on `devices`, as the planner prices it: for a
    plan written by hand, to set beside the planner's own."""
    return _cost(p, _Parts.of(scan, inner, inputs), hw.link(devices), hw)[0]


def stage_plans(inner: Plan, ranked: Sequence[Candidate]) -> list[Candidate]:
    """The plans one stage's devices are priced with: the stage's best (`inner`) and the best of
    each other tactic on all of them (those on fewer devices left out)."""
    devices = math.prod(inner.mesh.values())
    whole = [c for c in ranked if math.prod(c.mesh.values()) == devices]
    best = next((c for c in whole if str(c.tactic) == inner.tactic and _same_mesh(c.mesh, inner.mesh)), None)
    out = {str(best.tactic): best} if best is not None else {}
    for c in whole:
        out.setdefault(str(c.tactic), c)
    return list(out.values()) or list(ranked[:1])


def _microbatch_counts(batch: int, split: int, stages: int, repeats: int) -> list[int]:
    """Microbatch counts whose microbatch the stage's batch axes still divide, at least one per
    stage (fewer leave a stage idle more than half the time: GPipe's own rule)."""
    return [m for m in range(stages, batch + 1) if batch % m == 0 and (batch // m) % split == 0]


@dataclasses.dataclass(frozen=True)
class _Parts:
    """One stage's plan's prediction split into the layer scan's part and the rest."""

    layer_flops: float  # share of the FLOPs inside the layer scan
    forward_flops: float  # share the layers' forward pass adds, computed again (remat)
    compute: float
    flop_compute: float  # the FLOPs alone (`Cost.flop_seconds`)
    layer_activation_comm: float  # seconds: collectives of the layers' activations
    weight_comm: float  # seconds: the stacked weights' collectives
    rest_comm: float
    grad_bytes: int  # per device: the non-stacked weights' gradients (all-reduced over stages)
    state_bytes: int  # per device: the state as the inner plan lays it out
    stacked_bytes: int  # per device: the stacked part of it
    weight_bytes: int  # per device: the stacked weights as the plan lays them out
    gathered_bytes: int  # per device: the stacked weights gathered over the batch's axes (a stage holds its share)
    carry_bytes: int  # per example, per device of the batch's split (a split sequence divides it)
    batch: int
    batch_split: int  # devices the batch dimension is split over inside a stage
    peak: int

    def microbatch_bytes(self, microbatches: int) -> int:
        """A microbatch's activations on one device."""
        return self.carry_bytes * max(self.batch // microbatches // self.batch_split, 1)

    @classmethod
    def of(cls, scan: LayerScan, inner: Candidate, inputs: Inputs) -> _Parts:
        g, prop = inputs.graph, inner.propagation
        layer = sum(op.flops * op.trips for op in g.ops if op.body is None and op.trips == scan.length)
        comm = _communication_shares(scan, inputs, prop)
        seconds = {k: inner.cost.communication_seconds * v for k, v in comm.items()}
        per_device = lambda v: (
            g.values[v].nbytes
            // math.prod(  # noqa: E731 (a value's bytes on one device)
                prop.mesh[a] for axes in prop.of(v, len(g.values[v].shape)) for a in axes
            )
        )
        state = {v: per_device(v) for v in inputs.state_values}
        stacked = sum(b for v, b in state.items() if g.values[v].shape[:1] == (scan.length,))
        first = inputs.batch_values[0]  # (the layer scan's carry is laid out as the batch's first leaf)
        carry = prop.of(first, len(g.values[first].shape))
        split = lambda dims: math.prod(prop.mesh[a] for d in dims for a in carry[d])  # noqa: E731
        others = split(range(1, len(carry)))  # (a split sequence)
        over_batch = lambda v: math.prod(  # noqa: E731 (how many ways the batch's axes split a weight)
            prop.mesh[a] for axes in prop.of(v, len(g.values[v].shape)) for a in axes if a in carry[0]
        )
        return cls(
            layer_flops=min(layer / max(g.flops(), 1.0), 1.0),
            forward_flops=min(scan.length * scan.layer_flops / max(g.flops(), 1.0), 1.0),
            compute=inner.cost.compute_seconds,
            flop_compute=inner.cost.flop_seconds if inner.cost.flop_seconds is not None else inner.cost.compute_seconds,
            layer_activation_comm=seconds["layers"],
            weight_comm=seconds["weights"],
            rest_comm=seconds["rest"],
            grad_bytes=sum(per_device(w.value) for w in inputs.weights if not w.stacked),
            state_bytes=sum(state.values()),
            stacked_bytes=stacked,
            weight_bytes=sum(per_device(w.value) for w in inputs.weights if w.stacked),
            gathered_bytes=sum(per_device(w.value) * over_batch(w.value) for w in inputs.weights if w.stacked),
            carry_bytes=scan.carry_bytes_per_example // max(others, 1),
            batch=scan.batch,
            batch_split=split([0]),
            peak=inner.cost.peak_bytes_per_device,
        )


def _communication_shares(scan: LayerScan, inputs: Inputs, prop) -> dict[str, float]:
    """The shares of a plan's collective bytes that move the stacked weights (gathered once per
    step in a pipeline), the layers' activations (once per microbatch, stretched by the bubble)
    and the rest."""
    g = inputs.graph
    stacked = {g.values[v].shape[1:] for v in inputs.state_values if g.values[v].shape[:1] == (scan.length,)}
    trips = {op.id: op.trips for op in g.ops}
    out = {"layers": 0.0, "weights": 0.0, "rest": 0.0}
    for c in prop.communication:
        n = trips.get(c.op, 1)
        kind = "weights" if g.values[c.value].shape in stacked else ("layers" if n == scan.length else "rest")
        out[kind] += c.bytes * n
    whole = max(sum(out.values()), 1.0)
    return {k: v / whole for k, v in out.items()}


def _cost(p: Pipeline, parts: _Parts, link, hw: Hardware) -> tuple[Cost, int]:
    """`p`'s predicted cost from the inner plan's parts, and the bytes each device sends to the
    next stage per step."""
    S, M, R = p.stages, p.microbatches, p.repeats
    stretch = p.ticks / (R * M)  # the layers' time with the bubble
    layers = parts.layer_flops + (parts.forward_flops if p.remat else 0.0)
    spread = lambda t: t * layers / S * stretch + t * (1 - parts.layer_flops) / S  # noqa: E731
    # Gathered once, a stage's layers' weights move once per step; per microbatch, the layers a
    # stage applies at each tick gather theirs again, bubble ticks included.
    weights = parts.weight_comm / S * (1 if p.gather_once else p.ticks / R)
    grads = 2 * (S - 1) / S * parts.grad_bytes / link.bandwidth + latency_steps("all-reduce", S) * link.latency
    microbatch = parts.microbatch_bytes(M)
    sends = 2 * p.ticks * microbatch  # forward and backward, one microbatch a tick
    comm = parts.layer_activation_comm / S * stretch + weights + parts.rest_comm + grads
    comm += 2 * p.ticks * link.latency + sends / link.bandwidth
    if R > 1:
        # A stage holds a contiguous block of layers (the checkpoint's `[layers, ...]` split by
        # stage), and its repeats are every S-th block of L / (S * R): the program moves the
        # weights into that order each step, and their gradients back, over the stage axis.
        moved = parts.weight_bytes / S * (S - 1) / S
        comm += 2 * (moved / link.bandwidth + latency_steps("all-to-all", S) * link.latency)
    # Memory: the state, its stacked part split by stage; a stage's weights gathered and the sum
    # of their gradients beside them; what each tick keeps for the backward pass (each of the
    # stage's layers' input, for one microbatch; with remat the stage's input alone, and one
    # stage's layers computed again at a time); the rest of the inner plan's activations split
    # as the batch is, S ways more; the microbatches held and circulating.
    state = parts.state_bytes - parts.stacked_bytes + parts.stacked_bytes / S
    gathered = 2 * parts.gathered_bytes / S if p.gather_once else 0
    per_stage = p.layers // (S * R)
    kept = (p.ticks + per_stage) * microbatch if p.remat else p.ticks * per_stage * microbatch
    activations = max(parts.peak - parts.state_bytes, 0) / S
    peak = int(state + gathered + kept + activations + (S + M) * microbatch)
    compute, flops = spread(parts.compute), spread(parts.flop_compute)
    return Cost(compute, comm, {"collective-permute": sends}, peak, None, flops), sends


def composed(inner: Plan, chosen: Priced, scan: LayerScan, args, batch_argnums, devices: int, slices: int,
             notes: tuple[str, ...]) -> Plan:  # fmt: skip
    """The pipelined plan: `inner`'s specs with the stage axis on the stacked leaves' layer
    dimension and on the batch's, on the mesh `stage` x `inner`'s."""
    stacked = {f"{a}/{k}" for a, k in scan.stacked}
    in_specs = tuple(
        _staged(_flatten_specs(inner.in_specs[a]), {k.split("/", 1)[1] for k in stacked if k.startswith(f"{a}/")},
                a in batch_argnums)
        for a in range(len(args))
    )  # fmt: skip
    outs = _flatten_specs(inner.out_specs)
    out_specs = _staged(outs, {k for k in outs if k.split("/", 1)[-1] in _keys_of(stacked, k.split("/", 1)[0])}, False)
    p = chosen.pipeline
    mesh = {STAGE: p.stages, **inner.mesh}
    layout = scan_layout(inner, scan, batch_argnums)
    return Plan(mesh, in_specs, out_specs, chosen.cost, 0.0, devices, notes, f"pipeline+{inner.tactic}", slices,
                layout, p)  # fmt: skip


def _keys_of(stacked: set[str], argnum: str) -> set[str]:
    return {k.split("/", 1)[1] for k in stacked if k.split("/", 1)[0] == argnum}


def _staged(flat: dict, stacked_keys: set[str], batch: bool) -> FlatSpecs:
    """Specs with the stage axis on dimension 0 of the stacked leaves (its other axes moved off
    it) and, for the batch, first on dimension 0."""
    out = FlatSpecs()
    for k, spec in flat.items():
        entries = list(spec)
        if k in stacked_keys:
            entries = [STAGE] + entries[1:] if entries else [STAGE]
        elif batch and entries:
            first = entries[0]
            axes = () if first is None else (first if isinstance(first, tuple) else (first,))
            entries[0] = (STAGE, *axes) if axes else STAGE
        elif batch:
            entries = [STAGE]
        out[k] = P(*entries)
    return out


def notes_for(chosen: Priced, flat: Plan, hw: Hardware) -> tuple[str, ...]:
    """What the pipelined plan's notes say: its shape and bubble, what crosses each link level,
    the best plan without a pipeline."""
    p, c = chosen.pipeline, chosen.cost
    inner = chosen.inner
    return (
        f"chosen: {p.describe()} (the share of the pipelined layers' time stages sit idle), stage axis across the "
        f"{chosen.level} link; inside each stage {inner.tactic} on {mesh_text(inner.mesh)}; predicted "
        f"{c.total_seconds * 1e3:.4g} ms, peak {c.peak_bytes_per_device / 2**30:.2f} GiB",
        f"across the {chosen.level} link: {chosen.sends / 1e6:.4g} MB of activations per device per step "
        f"(stage to stage, forward and backward), and the non-stacked weights' gradients all-reduced over stages",
        f"without a pipeline: {flat.tactic} on {mesh_text(flat.mesh)}, predicted "
        f"{flat.cost.total_seconds * 1e3:.4g} ms ({flat.cost.total_seconds / c.total_seconds:.2f}x the pipeline)",
    )


def considered(
    fn, args, inputs: Inputs, asked, flat: Plan, devices: int, slices: int, hw: Hardware, limit: int,
    inner_search: Callable[[int, int], tuple[Plan, list[Candidate]]], check: bool | str = "auto",
) -> Plan:  # fmt: skip
    """`flat` (the best plan without a pipeline) with its layer scan recorded, or the best
    pipelined plan where `asked` ("auto", or a stage count) calls for one; where the two are
    predicted within the guard's CLOSE of each other and `check` allows, compiled and chosen by
    what XLA makes of them (as the guard chooses among other candidates)."""
    scan, why = layer_scan(fn, args, inputs)
    if scan is None or not scan.pipelinable:
        if asked not in ("auto", "off"):
            raise PlanInputError(f"pipeline={asked} asked for, but {why or scan.why_not}")
        flat = _noted(flat, why or scan.why_not) if asked == "auto" else flat
        return dataclasses.replace(flat, layer_scan=scan_layout(flat, scan, inputs.batch_argnums) if scan else None)
    flat = dataclasses.replace(flat, layer_scan=scan_layout(flat, scan, inputs.batch_argnums))
    if asked == "off":
        return flat
    counts, moved = stage_counts(asked, devices, slices, scan.length, hw)
    if not counts:
        return _noted(flat, moved) if moved else flat
    options, searched = [], {}
    for s in counts:
        stage = (devices // s, slices // s if slices % s == 0 else 1)
        try:
            inner, ranked = inner_search(*stage)
        except (PlanInputError, PlanMemoryError):  # one stage's devices hold no plan: not this count
            continue
        searched[s] = (inner, ranked, stage)
        got = priced(scan, stage_plans(inner, ranked), inputs, s, devices, hw, limit)
        if got is not None:
            options.append(got)
    chosen = min(options, key=lambda x: x.cost.total_seconds, default=None)
    if chosen is None:
        if asked != "auto":
            raise PlanInputError(
                f"pipeline={asked}: no pipeline of {counts[0]} stages fits {limit / 2**30:.2f} GiB per device"
            )
        tried = " or ".join(str(s) for s in counts)
        return _noted(flat, f"no pipeline: none of {tried} stages fits {limit / 2**30:.2f} GiB per device, each "
                            "stage's weights gathered once or per microbatch, its stages rematerialised or not")  # fmt: skip
    timing = tuple(n for n in flat.notes if n.startswith("time:"))
    notes = notes_for(chosen, flat, hw) + ((moved,) if moved else ()) + timing
    inner = _stage_plan(
        chosen.inner, *searched[chosen.pipeline.stages], inputs, args, hw, limit * chosen.pipeline.stages
    )
    inner = dataclasses.replace(inner, layer_scan=scan_layout(inner, scan, inputs.batch_argnums))
    piped = composed(inner, chosen, scan, args, inputs.batch_argnums, devices, slices, notes)
    if asked != "auto":
        return piped
    ratio = chosen.cost.total_seconds / flat.cost.total_seconds
    if check is not False and 1 / CLOSE <= ratio <= CLOSE and len(jax.devices()) >= devices:
        # Not told apart by the model: each compiled as it runs, and XLA's figures decide.
        (mine, theirs), _ = compiled_seconds(fn, args, inputs, [piped, flat], hw)
        said = f"compiled both: the pipeline {mine * 1e3:.4g} ms, without {theirs * 1e3:.4g} ms"
        return _noted(piped, said) if mine < theirs else _noted(flat, f"no pipeline: {said}")
    if ratio >= 1:
        return _noted(flat, (
            f"no pipeline: the best ({chosen.pipeline.describe()}) is predicted {chosen.cost.total_seconds * 1e3:.4g} ms, "
            f"{ratio:.2f}x this plan"))  # fmt: skip
    return piped


def _stage_plan(candidate: Candidate, best: Plan, ranked, stage: tuple[int, int], inputs: Inputs, args,
                hw: Hardware, limit: int) -> Plan:  # fmt: skip
    """The plan of one stage's devices the pipeline was priced with: the stage's best as its
    search made it, or another of its candidates made a plan."""
    if str(candidate.tactic) == best.tactic and _same_mesh(candidate.mesh, best.mesh):
        return best
    return to_plan(inputs, candidate, args, stage[0], 0.0, ranked, limit, hw.sliced(*stage))


def _noted(plan: Plan, note: str) -> Plan:
    """`plan` with `note` before its timing (the last note, where there is one)."""
    notes = plan.notes
    at = len(notes) - 1 if notes and notes[-1].startswith("time:") else len(notes)
    return dataclasses.replace(plan, notes=notes[:at] + (note,) + notes[at:])


def _same_mesh(a, b) -> bool:
    return {k: v for k, v in a.items() if v > 1} == {k: v for k, v in b.items() if v > 1}
