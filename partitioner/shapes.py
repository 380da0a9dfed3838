"""The first planner: data parallelism, or FSDP when the replicated state would not fit.

Candidates are the meshes of d replicas of f FSDP shards, d*f = m, for m = n, n-1, ..., 1 devices:
(data=d) for plain data parallelism, (replica=d, data=f) with FSDP, the axis names the search's
plans use (`fsdp`). A mesh is usable when the leading (batch) dimension of every batch leaf divides
by m, because JAX refuses uneven shardings. FSDP shards each state leaf by the one rule
(`fsdp.fsdp_dim`); a leaf with no such dimension stays replicated. The plan uses as many devices as any usable mesh allows,
then plain data parallelism if the replicated state fits the memory limit, else the smallest FSDP
degree that fits; the notes say what was given up and why. The cost is predicted, not searched.

This is deliberately simple: it reads shapes, not the computation. `partitioner.plan` is the full
search (`search.py`); this one stays as `plan_by_shapes`, a baseline and a job file's
`planner = "shapes"`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from .arguments import abstract_leaf, device_count
from .arguments import batch_argnums as batch_argnums_of
from .cost import Cost
from .errors import PlanInputError, PlanMemoryError
from .fsdp import AXIS as FSDP_AXIS
from .fsdp import fsdp_dim
from .hardware import Hardware, latency_steps, profile
from .plan import Plan
from .verify import analysed_flops


@dataclasses.dataclass(frozen=True)
class _Candidate:
    data: int
    fsdp: int
    state_specs: tuple[Any, ...]
    cost: Cost

    @property
    def mesh(self) -> dict[str, int]:
        if self.fsdp == 1:
            return {"data": self.data}
        axes = {"replica": self.data, FSDP_AXIS: self.fsdp}  # state replicated over replica, sharded over data
        return {k: v for k, v in axes.items() if v > 1}


def plan_by_shapes(fn, *args, devices, hardware="h100", memory_limit=None, batch_argnums=None) -> Plan:
    """Plan `fn(*args)` for `devices` (a count or a list of devices) from shapes alone.

    Example:
        >>> p = plan_by_shapes(train_step, state, batch, devices=6, hardware="h100")
        >>> p.mesh, p.notes
        ({'data': 6}, ())
    """
    start = time.perf_counter()
    n = device_count(devices)
    hw = profile(hardware)
    limit = int(memory_limit or hw.memory_bytes)
    abstract = tuple(jax.tree.map(abstract_leaf, a) for a in args)
    out = jax.eval_shape(fn, *abstract)
    batch_argnums = batch_argnums_of(abstract, out) if batch_argnums is None else tuple(batch_argnums)
    batch_dim = _batch_size(abstract, batch_argnums)
    flops = _flops(fn, abstract)

    notes: list[str] = []
    chosen = None
    for m in range(n, 0, -1):
        if batch_dim % m:
            continue
        fitting = [
            c for c in _candidates(m, abstract, batch_argnums, flops, hw) if c.cost.peak_bytes_per_device <= limit
        ]
        if fitting:
            chosen = min(fitting, key=lambda c: c.fsdp)  # data parallel when it fits, else least FSDP
            break
        notes.append(f"no {m}-device mesh fits {limit / 2**30:.2f} GiB per device")
    if chosen is None:
        smallest = min(
            c.cost.peak_bytes_per_device
            for c in _candidates(_largest_divisor(batch_dim, n), abstract, batch_argnums, flops, hw)
        )
        raise PlanMemoryError(
            f"no plan fits the memory limit of {limit:,} bytes per device on {n} devices: the best "
            f"needs {smallest:,} bytes, {smallest - limit:,} over. Add devices, raise memory_limit, "
            "or shrink the model or batch"
        )
    used = chosen.data * chosen.fsdp
    if used < n:
        notes.insert(
            0,
            f"using {used} of {n} devices: the batch dimension {batch_dim} does not divide by any count from "
            f"{used + 1} to {n}",
        )
    if chosen.fsdp > 1:
        notes.append(f"FSDP over {chosen.fsdp} devices: replicated state would exceed the memory limit")
    batch_spec = P(tuple(chosen.mesh)) if used > 1 else P()
    in_specs = tuple(
        jax.tree.map(lambda x: batch_spec if x.ndim else P(), a) if i in batch_argnums else chosen.state_specs[i]
        for i, a in enumerate(abstract)
    )
    out_specs = _out_specs(out, abstract, in_specs, batch_argnums)
    return Plan(
        mesh=chosen.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        cost=chosen.cost,
        search_seconds=time.perf_counter() - start,
        devices=n,
        notes=tuple(notes),
        tactic="fsdp" if chosen.fsdp > 1 else "dp",
    )


def _batch_size(abstract, batch_argnums) -> int:
    sizes = {l.shape[0] for i in batch_argnums for l in jax.tree.leaves(abstract[i]) if l.ndim}
    if len(sizes) != 1:
        raise PlanInputError(
            f"every batch leaf must share one leading (batch) dimension, got leading sizes {sorted(sizes)} "
            f"in arguments {batch_argnums}"
        )
    return sizes.pop()


def _flops(fn, abstract) -> float:
    return analysed_flops(jax.jit(fn).lower(*abstract).cost_analysis()) or 0.0


def _largest_divisor(k: int, n: int) -> int:
    return max(m for m in range(1, n + 1) if k % m == 0)


def _candidates(m: int, abstract, batch_argnums, flops: float, hw: Hardware):
    for f in (d for d in range(1, m + 1) if m % d == 0):
        specs = tuple(
            None if i in batch_argnums else jax.tree.map(lambda x: _fsdp_spec(x, f), a)  # noqa: B023
            for i, a in enumerate(abstract)
        )
        yield _Candidate(m // f, f, specs, _cost(m // f, f, abstract, batch_argnums, specs, flops, hw))


def _fsdp_spec(x, f: int) -> P:
    d = fsdp_dim(x.shape, f) if f > 1 else None
    if d is None:
        return P()
    spec = [None] * x.ndim
    spec[d] = FSDP_AXIS
    return P(*spec)


def _nbytes(x) -> int:
    return int(math.prod(x.shape)) * x.dtype.itemsize  # a typed PRNG key dtype has no numpy equivalent


def _cost(d, f, abstract, batch_argnums, specs, flops, hw: Hardware) -> Cost:
    state_leaves = [
        (l, s)
        for i, a in enumerate(abstract)
        if i not in batch_argnums
        for l, s in zip(jax.tree.leaves(a), jax.tree.leaves(specs[i], is_leaf=lambda z: isinstance(z, P)))
    ]
    # Upper bound: every floating-point state leaf is treated as a gradient to reduce.
    grads = sum(_nbytes(l) for l, _ in state_leaves if jax.numpy.issubdtype(l.dtype, jax.numpy.floating))
    sharded = sum(_nbytes(l) // (f if any(s) else 1) for l, s in state_leaves)
    batch = sum(_nbytes(l) for i in batch_argnums for l in jax.tree.leaves(abstract[i]))
    m = d * f
    moved = {}
    seconds = 0.0
    if f > 1:
        gather = (f - 1) / f * grads
        moved["all-gather"] = int(gather)
        moved["reduce-scatter"] = int(gather)
        seconds += 2 * _ring(gather, f, hw)
    if d > 1:
        reduce = 2 * (d - 1) / d * grads / f
        moved["all-reduce"] = int(reduce)
        seconds += _ring(reduce, m, hw)
    # Parameters, gradients and one gathered FSDP copy live at once; the batch is split m ways.
    peak = sharded + grads // f + (grads // f if f > 1 else 0) + batch // m
    compute = flops / (m * hw.peak_flops)  # no memory-bound term here: the FLOPs alone
    return Cost(compute, seconds, moved, int(peak), flop_seconds=compute)


def _ring(nbytes: float, group: int, hw: Hardware) -> float:
    link = hw.link(group)
    return nbytes / link.bandwidth + latency_steps("all-reduce", group) * link.latency


def _out_specs(out, abstract, in_specs, batch_argnums):
    """Outputs that mirror a state argument keep its specs (the step returns the new state);
    everything else (metrics) is replicated."""

    def specs_for(o):
        for i, a in enumerate(abstract):
            if i not in batch_argnums and jax.tree.structure(a) == jax.tree.structure(o):
                return in_specs[i]
        return jax.tree.map(lambda _: P(), o)

    if isinstance(out, tuple):
        return tuple(specs_for(o) for o in out)
    return specs_for(out)
