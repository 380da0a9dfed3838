"""A chosen candidate made a `Plan`, with the notes that say why: the runners-up of every
tactic, devices left idle and why (`_unused`), what crosses the slow link between slices and the
best plan that puts something else there, and whether rematerialising the repeated layers would
make a plan that does not fit fit (`remat_hint`). Outputs that are an argument's next value (a
step's new state) keep that argument's specs (`_carried`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
from jax.sharding import PartitionSpec as P

from .analysis import Inputs
from .candidates import Candidate
from .cost import estimate
from .hardware import Hardware
from .plan import Plan, _is_spec, mesh_text
from .propagate import Sharding
from .stacks import key_names


def to_plan(
    inputs: Inputs,
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
    spec = _Specs(best.propagation)  # (a deep model's ~10^4 leaves stand for a few hundred values)
    it = iter([spec[v] for v in inputs.ids])
    in_specs = tuple(jax.tree.map(lambda _: next(it), a) for a in args)
    outs = iter([spec[v] for v in g.outputs])
    out_specs = _carried(jax.tree.map(lambda _: next(outs), g.out_shape), g.out_shape, in_specs, args)
    c = best.cost
    cpu_peak = (
        c.peak_bytes_per_device
        if hw.copies_transposed_lhs
        else estimate(
            best.propagation, dataclasses.replace(hw, copies_transposed_lhs=True), inputs.fold
        ).peak_bytes_per_device
    )
    cost = dataclasses.replace(c, collective_bytes=dict(c.collective_bytes), cpu_peak_bytes_per_device=cpu_peak)
    # Why: the best candidate of every other tactic, and the next best of the chosen one.
    seen, runners = {best.tactic}, [r for r in ranked if r is not best and r.tactic == best.tactic][:1]
    for r in ranked:
        if r.tactic not in seen:
            seen.add(r.tactic)
            runners.append(r)
    used = math.prod(best.mesh.values())
    lost = (_unused(inputs, devices, best, ranked, limit),) if used < devices else ()
    slices = devices // hw.slice_devices if hw.slice_devices else 1
    across = (_slow_link_note(best, ranked, hw, limit),) if slices > 1 else ()
    notes = (
        (f"chosen: {best.line()}",)
        + lost
        + across
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
        tactic=str(best.tactic),
        slices=slices,
    )


ROLES = {
    "replica": "data parallel",
    "seq": "sequence parallel",
    "model": "tensor parallel",
    "expert": "expert parallel",
}


def crossing(mesh: Mapping[str, int], hw: Hardware) -> tuple[str, ...]:
    """The mesh axes whose groups cross the slow link between slices (devices slice-major)."""
    names = [a for a in mesh if mesh[a] > 1]
    return tuple(a for i, a in enumerate(names) if hw.level(math.prod(mesh[n] for n in names[i:])) == "dcn")


def _slow_link_note(best: Candidate, ranked: list[Candidate], hw: Hardware, limit: int) -> str:
    """Which axis crosses the slow link, and why: the best plan that puts something else there."""
    mine = crossing(best.mesh, hw)
    slow, fast = hw.dcn or hw.inter, hw.link(hw.slice_devices)
    fsdp = best.tactic.shards_state
    role = lambda a: (  # noqa: E731
        "data parallel, FSDP over data inside each slice (HSDP)" if a == "replica" and fsdp
        else ROLES.get(a) or ("FSDP" if fsdp else "data parallel")
    )  # fmt: skip
    said = ", ".join(f"{a}={best.mesh[a]} ({role(a)})" for a in mine) or "nothing"
    head = (
        f"across slices ({slow.bandwidth / 1e9:.3g} GB/s per device, {fast.bandwidth / slow.bandwidth:.0f}x slower "
        f"than within one): {said}"
    )
    other = next((c for c in ranked if crossing(c.mesh, hw) != mine and c.cost.peak_bytes_per_device <= limit), None)
    if other is None:
        return head + "; no plan that fits puts anything else there"
    theirs = ", ".join(crossing(other.mesh, hw)) or "nothing"
    return head + (
        f"; the best with {theirs} across slices ({other.tactic} on {mesh_text(other.mesh)}) is predicted "
        f"{other.cost.total_seconds / best.cost.total_seconds:.2f}x slower"
    )


def _carried(out_specs, out_shape, in_specs: tuple, args) -> object:
    """Output leaves that are an argument's next value (a step's new state: output i's leaf at
    the path and shape of argument i's) take that argument's spec, as the step is run
    (`Plan.jit(carry=...)`): the state stays where it is from one step to the next."""
    if not isinstance(out_shape, (tuple, list)):
        return out_specs
    specs = list(out_specs)
    for i, (out, spec) in enumerate(zip(out_shape, specs)):
        if i >= len(args):
            break
        theirs = jax.tree.leaves(in_specs[i], is_leaf=_is_spec)
        mine = jax.tree.leaves(spec, is_leaf=_is_spec)
        if jax.tree.structure(out) == jax.tree.structure(args[i]):  # the same paths, leaf for leaf
            pairs = zip(jax.tree.leaves(args[i]), theirs, jax.tree.leaves(out), mine)
            kept = [t if x.shape == getattr(y, "shape", None) else s for x, t, y, s in pairs]
        else:
            kept = _carried_by_path(out, mine, args[i], theirs)
        specs[i] = jax.tree.unflatten(jax.tree.structure(spec, is_leaf=_is_spec), kept)
    if hasattr(out_specs, "_fields"):  # a NamedTuple of outputs keeps its type (and its key paths)
        return type(out_specs)(*specs)
    return type(out_specs)(specs)


def _carried_by_path(out, mine: list, arg, theirs: list) -> list:
    """Per leaf of `out`, the spec of the leaf of `arg` at its path and shape, else its own."""
    given = {key_names(p): (x.shape, t) for (p, x), t in zip(_leaves(arg), theirs)}
    found = [given.get(key_names(p)) for p, _ in _leaves(out)]
    shapes = [getattr(x, "shape", None) for _, x in _leaves(out)]
    return [g[1] if g is not None and g[0] == shape else s for g, shape, s in zip(found, shapes, mine)]


def _leaves(tree) -> list:
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _unused(inputs: Inputs, devices: int, best: Candidate, ranked: list[Candidate], limit: int) -> str:
    """One line: why the plan leaves devices idle."""
    used = math.prod(best.mesh.values())
    head = f"using {used} of {devices} devices: "
    whole = [r for r in ranked if math.prod(r.mesh.values()) == devices]
    fitting = [r for r in whole if r.cost.peak_bytes_per_device <= limit]
    if fitting:
        return head + (
            f"the best plan on all {devices} ({fitting[0].tactic} on {mesh_text(fitting[0].mesh)}) is predicted "
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


class _Specs(dict):
    """Value id -> its PartitionSpec under a propagation (a literal's: replicated), each found once."""

    def __init__(self, propagation):
        super().__init__()
        self.propagation = propagation

    def __missing__(self, v: int) -> P:
        graph = self.propagation.graph
        self[v] = spec = _spec(self.propagation.of(v, len(graph.values[v].shape))) if v >= 0 else P()
        return spec


def _spec(sharding: Sharding) -> P:
    entries = [None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in sharding]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def remat_hint(inputs: Inputs, least: Candidate, hw: Hardware, limit: int) -> str:
    """Whether rematerialising the repeated layers would make the smallest plan fit, and by how much."""
    size = least.propagation.device_bytes
    sizes = {v: int(size[v]) for v in inputs.fold.materialized}
    found = inputs.fold.remat_peak(sizes, hw.copies_transposed_lhs)
    if found is None:
        return ""
    peak, saved = found
    if saved <= 0.01 * least.cost.peak_bytes_per_device:
        return "Its layers keep little more than their inputs for the backward pass: remat would not help. "
    verdict = (
        f"it would fit, with {(limit - peak) / 2**30:.2f} GiB to spare"
        if peak <= limit
        else f"still {(peak - limit) / 2**30:.2f} GiB over"
    )
    return (
        f"Rematerialising each repeated layer (jax.checkpoint around it) would need about {peak / 2**30:.2f} GiB, "
        f"not keeping {saved / 2**30:.2f} GiB of activations for the backward pass: {verdict}. "
    )
