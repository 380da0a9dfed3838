"""The layer scan of a step: the `jax.lax.scan` that applies its layers over stacked weights, as
MaxText (`scan_layers=True`), Flax `nn.scan`/`nnx.scan` and Equinox users write it. It is what a
pipeline splits into stages and what a plan's program constrains (`program`).

A scan is the layer scan when its carry is the batch's activations (every carry leaf leads with
the batch size), what it scans over holds weights of the step's state (state leaves shaped
`[layers, ...]`), and its per-layer outputs, if any, do not depend on the carry (Flax NNX hands
the scanned module's state back that way). It is pipelined only where its body keeps examples
apart: sharding the carry's batch dimension must need no communication inside the body (a batch
norm, or an MoE layer whose capacity is counted over the batch, needs some).

`jax.lax.scan` is found, and later replaced, by swapping the function `jax.lax.scan` names for the
length of one trace (`scans_replaced`): the layer libraries call it by that name, and autodiff of
the replacement gives its backward pass, so the pipeline's backward is GPipe's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.custom_batching import custom_vmap
from jax.extend import core as jcore

_ORIGINAL = jax.lax.scan
_INSTALL = threading.Lock()
_LOCAL = threading.local()  # this thread's handlers, innermost last


@contextlib.contextmanager
def scans_replaced(handler: Callable):
    """`jax.lax.scan`, called from this thread while inside, calls `handler(inner, f, init, xs,
    length, **kwargs)`, `inner` being the scan beneath it (an enclosing handler's, or JAX's).

    `jax.lax.scan` becomes, the first time, a dispatcher that calls JAX's own scan in a thread
    with no handler: two threads tracing at once (a step compiled ahead beside training) each see
    their own, and neither waits on the other while JAX's caches may wait on both."""
    _install()
    stack = _LOCAL.__dict__.setdefault("handlers", [])
    depth = len(stack)
    stack.append(handler)
    try:
        yield
    finally:
        del stack[depth:]


def _install() -> None:
    with _INSTALL:
        if jax.lax.scan is not _dispatch:
            jax.lax.scan = _dispatch


def _dispatch(f, init, xs=None, length=None, **kwargs):
    return _at(len(getattr(_LOCAL, "handlers", ())) - 1, f, init, xs, length, kwargs)


def _at(level: int, f, init, xs, length, kwargs):
    if level < 0:
        return _ORIGINAL(f, init, xs, length, **kwargs)

    def inner(f, init, xs=None, length=None, **kwargs):
        return _at(level - 1, f, init, xs, length, kwargs)

    return _LOCAL.handlers[level](inner, f, init, xs, length, **kwargs)


@dataclasses.dataclass(frozen=True)
class LayerScan:
    """The layer scan found: its `length` (layers), the `batch` its carry leads with, the state
    leaves stacked `[layers, ...]` that it scans over (argnum, slash key), the carry's bytes per
    example, whether its body keeps examples apart, and whether its per-layer outputs are free
    of the carry."""

    length: int
    batch: int
    stacked: tuple[tuple[int, str], ...]
    carry_bytes_per_example: int
    per_example: bool
    why_not: str = ""  # "" where it can be pipelined
    vmapped: bool = False  # the scan runs per example under jax.vmap (an Equinox model's way)
    layer_flops: float = 0.0  # one layer's forward FLOPs on the whole batch (what remat computes again)

    @property
    def pipelinable(self) -> bool:
        return not self.why_not


def batch_size(args: Sequence, batch_argnums: Sequence[int]) -> int | None:
    """The batch's leading dimension: the first leaf's of the batch arguments."""
    for a in batch_argnums:
        for leaf in jax.tree.leaves(args[a]):
            if getattr(leaf, "ndim", 0):
                return int(leaf.shape[0])
    return None


def find_layer_scan(fn, args: Sequence, batch_argnums: Sequence[int]) -> tuple[LayerScan | None, str]:
    """The step's layer scan, or None and why there is none (a Python loop of layers, no scan
    over the state's stacked weights)."""
    batch = batch_size(args, batch_argnums)
    if batch is None:
        return None, "no pipeline: the step has no batch argument to split into microbatches"
    state_shapes = _state_shapes(args, batch_argnums)
    found: list[LayerScan] = []
    over_stacked = []

    def record(inner, f, init, xs, length, **kwargs):
        # Read while tracing: the body may close over this trace's values.
        direct = _as_layer_scan((f, init, xs, length, kwargs), batch, state_shapes)
        found.extend([direct] if direct else [])
        stacked = [x for x in jax.tree.leaves(xs) if _stacked_shape(x) in state_shapes]
        over_stacked.extend(stacked)
        if direct or not stacked or kwargs.get("reverse"):
            return inner(f, init, xs, length, **kwargs)

        def batched(fb, init_b):  # the same scan seen from outside a jax.vmap over the batch
            seen = _as_layer_scan((fb, init_b, xs, length, kwargs), batch, state_shapes)
            found.extend([dataclasses.replace(seen, vmapped=True)] if seen else [])

        return under_vmap(inner, f, init, xs, length, kwargs, batched)

    with scans_replaced(record):
        jax.eval_shape(lambda *a: fn(*a), *args)  # (a new function: JAX keeps traces of one it has seen)
    if not found:
        if over_stacked:
            return None, "no pipeline: the scan over the stacked weights does not carry the batch's activations"
        return None, (
            "no pipeline: the step applies no layer scan (layers in a Python loop, or no scan over stacked "
            "weights); write the layers as jax.lax.scan over weights stacked [layers, ...] to pipeline them"
        )
    return max(found, key=lambda s: (s.length, len(s.stacked))), ""


def under_vmap(scan, f, init, xs, length, kwargs, batched: Callable):
    """`scan(f, init, xs)`, which, where a jax.vmap maps its carry and not its weights, calls
    `batched(fb, init)` (`fb`: the body over a batch of carries, `init` the batch, leading) and
    returns what that returns (`custom_vmap`). A scan applied per example under jax.vmap (an
    Equinox model's) shows its batch only there."""

    @custom_vmap
    def whole(init, xs):
        return scan(f, init, xs, length, **kwargs)

    @whole.def_vmap
    def rule(axis_size, in_batched, init_b, xs_b):
        carry_in, xs_in = in_batched
        fb = batched_body(f)
        if all(jax.tree.leaves(carry_in)) and not any(jax.tree.leaves(xs_in)):
            out = batched(fb, init_b)
            if out is not None:
                return out, jax.tree.map(lambda _: True, out)
        out = jax.vmap(lambda c, x: scan(f, c, x, length, **kwargs), in_axes=(_axes(carry_in), _axes(xs_in)))(
            init_b, xs_b
        )
        return out, jax.tree.map(lambda _: True, out)

    return whole(init, xs)


def batched_body(f):
    """A per-example scan body over a batch of carries (the layer's weights shared)."""
    return lambda c, x: jax.vmap(lambda ci: f(ci, x))(c)


def _axes(flags):
    return jax.tree.map(lambda b: 0 if b else None, flags)


def _state_shapes(args, batch_argnums) -> dict[tuple, list[tuple[int, str]]]:
    out: dict[tuple, list[tuple[int, str]]] = {}
    for a, arg in enumerate(args):
        if a in batch_argnums:
            continue
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            shape = tuple(getattr(leaf, "shape", ()))
            if len(shape) >= 1 and shape[0] >= 2:
                out.setdefault(shape, []).append((a, jax.tree_util.keystr(tuple(path), simple=True, separator="/")))
    return out


def _stacked_shape(x) -> tuple:
    return tuple(getattr(x, "shape", ()))


def _as_layer_scan(call, batch: int, state_shapes) -> LayerScan | None:
    f, init, xs, length, kwargs = call
    xs_leaves = [x for x in jax.tree.leaves(xs) if getattr(x, "ndim", 0)]
    layers = int(length if length is not None else xs_leaves[0].shape[0]) if xs_leaves else 0
    stacked = [k for x in xs_leaves if x.shape[0] == layers for k in state_shapes.get(_stacked_shape(x), ())]
    if not stacked or kwargs.get("reverse"):
        return None
    carry = jax.tree.leaves(init)
    if not carry or any(getattr(c, "ndim", 0) == 0 or c.shape[0] != batch for c in carry):
        return None
    per_example = sum(int(np.prod(c.shape[1:])) * np.dtype(c.dtype).itemsize for c in carry)
    mixes, free, flops = _body_reads(f, init, xs, batch)
    why = ""
    if mixes:
        why = f"no pipeline: the layer body mixes examples ({mixes}); a stage must see one microbatch at a time"
    elif not free:
        why = "no pipeline: the layer scan's per-layer outputs depend on the activations; return them from the carry"
    return LayerScan(layers, batch, tuple(dict.fromkeys(stacked)), per_example, not mixes, why, layer_flops=flops)


def _body_reads(f, init, xs, batch: int) -> tuple[str, bool, float]:
    """(what in the body mixes examples, "" if nothing; whether its per-layer outputs are free of
    the carry; the body's FLOPs). Mixing is read as GSPMD would: the carry's batch split over a mesh axis of 2, and
    any communication the body then needs."""
    from .capture import capture  # noqa: PLC0415 (capture imports rules, a heavy import for a find)
    from .propagate import propagate  # noqa: PLC0415

    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), xs)
    carry = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), init)
    jaxpr = jax.make_jaxpr(f)(carry, x)
    free = _outputs_free(jaxpr.jaxpr, len(jax.tree.leaves(carry)))
    g = capture(f, carry, x)
    if batch % 2:
        return "", free, g.flops()
    rank = {v: len(g.values[v].shape) for v in g.inputs}
    n_carry, n_x = len(jax.tree.leaves(carry)), len(jax.tree.leaves(x))
    carried = g.inputs[len(g.inputs) - n_carry - n_x :][:n_carry]  # (closed-over values come first)
    split = {v: (("b",),) + ((),) * (rank[v] - 1) for v in carried}
    sent = [c for c in propagate(g, split, {"b": 2}, first=carried).communication if "b" in c.axes]
    if sent:
        op = next(o for o in g.ops if o.id == sent[0].op)
        return f"{op.primitive} {sent[0].kind} over the batch", free, g.flops()
    return "", free, g.flops()


def _outputs_free(jaxpr, n_carry: int) -> bool:
    """Whether the outputs after the first `n_carry` (the per-layer ones) read none of the first
    `n_carry` inputs (the carry)."""
    tainted = set(jaxpr.invars[:n_carry])
    for eqn in jaxpr.eqns:
        if any(type(v) is not jcore.Literal and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    return not any(type(v) is not jcore.Literal and v in tainted for v in jaxpr.outvars[n_carry:])
