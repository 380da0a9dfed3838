"""What every corpus model shares: the plans an experienced engineer writes for 8 devices, built
from one tensor-parallel rule per model (path -> spec of a weight), and the comparison of the
searched plans with them, all priced from what XLA compiled (`partitioner.verify`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

Rule = Callable[[str, tuple], "tuple | None"]  # (slash path, shape) -> one entry per dim, or None


@dataclasses.dataclass(frozen=True)
class Expert:
    name: str
    mesh: dict
    rule: Rule  # on the mesh above; dims the rule leaves free may be FSDP-split over data by `fsdp`
    fsdp: bool = False


def standard_experts(tensor_parallel: Rule, experts: Rule | None = None) -> tuple[Expert, ...]:
    """DP and FSDP on 8, Megatron TP x DP and TP x FSDP on data=2 x model=4, and (for MoE models)
    experts over model with the tensor-parallel rule elsewhere, with and without FSDP."""
    none = lambda path, shape: None
    out = [
        Expert("dp", {"data": 8}, none),
        Expert("fsdp", {"data": 8}, none, fsdp=True),
        Expert("megatron", {"data": 2, "model": 4}, tensor_parallel),
        Expert("megatron+fsdp", {"data": 2, "model": 4}, tensor_parallel, fsdp=True),
    ]
    if experts is not None:
        both = lambda path, shape: experts(path, shape) or tensor_parallel(path, shape)
        out += [
            Expert("expert+megatron", {"data": 2, "model": 4}, both),
            Expert("expert+megatron+fsdp", {"data": 2, "model": 4}, both, fsdp=True),
        ]
    return tuple(out)


def _leaf_spec(expert: Expert, path: str, shape: tuple) -> P:
    entries = list(expert.rule(path, shape) or ())
    if len(entries) != len(shape):  # (adafactor's factored moments share their weight's path)
        entries = [None] * len(shape)
    for d, axis in enumerate(entries):  # an engineer never asks for a split that does not divide
        if axis is not None and shape[d] % expert.mesh[axis]:
            entries[d] = None
    data = expert.mesh.get("data", 1)
    if expert.fsdp and data > 1:
        free = [d for d, n in enumerate(shape) if entries[d] is None and n % data == 0 and n >= data]
        if free:
            entries[max(free, key=lambda d: shape[d])] = "data"
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def expert_plan(expert: Expert, fn, args, slices: int = 1):
    """The expert's plan as a `partitioner.Plan`: state by the rule, the batch over data (and
    replica, where the mesh has one: data parallel across slices), the new state as the old and
    metrics replicated."""
    from partitioner import Cost, Plan
    from partitioner.plan import leaf_key

    state, batch = args
    state_specs = jax.tree_util.tree_map_with_path(lambda p, x: _leaf_spec(expert, leaf_key(p), x.shape), state)
    over = tuple(a for a in ("replica", "data") if expert.mesh.get(a, 1) > 1)
    batch_specs = jax.tree.map(lambda x: P(over) if x.shape and over else P(), batch)
    metrics = jax.eval_shape(fn, *args)[1]
    return Plan(
        mesh=expert.mesh,
        in_specs=(state_specs, batch_specs),
        out_specs=(state_specs, jax.tree.map(lambda _: P(), metrics)),
        cost=Cost(0.0, 0.0, {}, 0),
        search_seconds=0.0,
        devices=8,
        slices=slices,
    )


def hybrid_experts(experts: tuple[Expert, ...], slices: int, devices: int = 8) -> tuple[Expert, ...]:
    """The hand-written plans for `slices` slices of `devices`: data parallel across slices with
    FSDP (HSDP), Megatron, or Megatron with FSDP inside each slice (the model's own tensor-parallel
    rule, on as many devices of a slice as it has, at most 4); and FSDP and DP over every device."""
    per = devices // slices
    none = lambda path, shape: None  # noqa: E731
    out = [
        Expert("hsdp", {"replica": slices, "data": per}, none, fsdp=True),
        Expert("fsdp everywhere", {"data": devices}, none, fsdp=True),
        Expert("dp everywhere", {"data": devices}, none),
    ]
    rule = next((e.rule for e in experts if e.name == "megatron"), None)  # a ResNet's experts have none
    if rule is not None:
        t = min(4, per)
        inside = {k: v for k, v in {"replica": slices, "data": per // t, "model": t}.items() if v > 1}
        out += [Expert("dp x megatron", inside, rule), Expert("dp x megatron+fsdp", inside, rule, fsdp=True)]
    return tuple(out)


def compare_sliced(module, slices: int, hardware: str, layers: int = 2, **kwargs) -> list:
    """The fast plan on `slices` slices of 8 devices against the hand-written hybrid plans, each
    compiled on 8 devices and priced from what XLA produced, every collective charged level by
    level at the links its replica groups cross (`partitioner.verify`)."""
    from partitioner import plan, verify_many

    fn, args = module.build(layers=layers, **kwargs)
    mine = plan(fn, *args, devices=8, hardware=hardware, slices=slices)
    hand = [(e.name, expert_plan(e, fn, args, slices)) for e in hybrid_experts(module.EXPERTS, slices)]
    found = verify_many([(p, fn, args) for _, p in [("fast", mine)] + hand], hardware=hardware)
    return [("fast", mine, found[0])] + [(name, p, v) for (name, p), v in zip(hand, found[1:])]


@dataclasses.dataclass(frozen=True)
class Row:
    label: str
    mesh: dict
    compiled_seconds: float
    compiled_collective_bytes: int
    compiled_peak: int
    predicted_seconds: float | None = None
    predicted_collective_bytes: int | None = None
    predicted_peak: int | None = None


def _row(label, plan, v, searched: bool) -> Row:
    return Row(
        label,
        dict(plan.mesh),
        v.compute_seconds + v.communication_seconds,
        sum(v.collective_bytes.values()),
        v.peak_bytes,
        plan.cost.total_seconds if searched else None,
        sum(plan.cost.collective_bytes.values()) if searched else None,
        plan.cost.cpu_peak_bytes_per_device if searched else None,
    )


def compare(module, layers: int = 2, levels=("fast", "thorough"), **kwargs) -> list[Row]:
    """Searched plans (each level) and the module's experts, compiled on 8 devices, h100 profile."""
    from partitioner import plan, verify_many

    fn, args = module.build(layers=layers, **kwargs)
    searched = [(level, plan(fn, *args, devices=8, hardware="h100", level=level)) for level in levels]
    experts = [(expert.name, expert_plan(expert, fn, args)) for expert in module.EXPERTS]
    found = verify_many([(p, fn, args) for _, p in searched + experts], hardware="h100")
    labelled = [(label, p, True) for label, p in searched] + [(label, p, False) for label, p in experts]
    return [_row(label, p, v, mine) for (label, p, mine), v in zip(labelled, found)]


def table(rows: list[Row]) -> str:
    best = min(r.compiled_seconds for r in rows if r.label not in ("fast", "thorough"))
    lines = ["| plan | mesh | compiled ms | x best expert | coll. MB pred / compiled | peak MiB pred / compiled |"]
    lines.append("|---|---|---|---|---|---|")
    for r in rows:
        mesh = " x ".join(f"{k}={v}" for k, v in r.mesh.items())
        pred_coll = "-" if r.predicted_collective_bytes is None else f"{r.predicted_collective_bytes / 1e6:.1f}"
        pred_peak = "-" if r.predicted_peak is None else f"{r.predicted_peak / 2**20:.0f}"
        lines.append(
            f"| {r.label} | {mesh} | {r.compiled_seconds * 1e3:.3f} | {r.compiled_seconds / best:.3f} | "
            f"{pred_coll} / {r.compiled_collective_bytes / 1e6:.1f} | {pred_peak} / {r.compiled_peak / 2**20:.0f} |"
        )
    return "\n".join(lines)
