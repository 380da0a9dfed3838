"""The step as a plan runs it (`Plan.program`): the plan's layout constrained where XLA's own
propagation would choose another, and, with a pipeline, the layer scan run pipelined.

A plan's input shardings alone leave every value inside the step to XLA, and in a scanned model
it moves the activations rather than the weights (FSDP on a Llama-7B-shaped step: 32 s a step from
its input shardings, 2.3 s with the activations constrained). So the layer scan's carry, at its
entry and on every trip, is held to the layout the cost model priced: split as the batch is.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from .layerscan import scans_replaced, under_vmap
from .pipeline import Layout, abstract_mesh, pipelined


@dataclasses.dataclass(frozen=True)
class ScanLayout:
    """The layer scan a plan knows of (`layerscan.LayerScan`): its layers, the batch its carry
    leads with, the mesh axes of the carry's leading dimensions as the batch's leaves have them
    (the stage axis not among them), and the arguments that hold the batch."""

    layers: int
    batch: int
    carry: tuple = ()
    batch_argnums: tuple[int, ...] = (1,)
    vmapped: bool = False  # applied per example under jax.vmap: its batch shows outside the vmap

    def to_dict(self) -> dict:
        return {
            "layers": self.layers,
            "batch": self.batch,
            "carry": [list(e) if isinstance(e, tuple) else e for e in self.carry],
            "batch_argnums": list(self.batch_argnums),
            "vmapped": self.vmapped,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> ScanLayout:
        carry = tuple(tuple(e) if isinstance(e, list) else e for e in d["carry"])
        return cls(d["layers"], d["batch"], carry, tuple(d["batch_argnums"]), d.get("vmapped", False))

    def matches(self, init, xs, length, kwargs) -> bool:
        """Whether a `jax.lax.scan(f, init, xs, length)` call is this layer scan (one under
        jax.vmap shows its batch only to `under_vmap`'s rule: `leads`)."""
        xs_leaves = [x for x in jax.tree.leaves(xs) if getattr(x, "ndim", 0)]
        n = length if length is not None else (xs_leaves[0].shape[0] if xs_leaves else None)
        carry = jax.tree.leaves(init)
        return n == self.layers and not kwargs.get("reverse") and bool(carry) and (self.vmapped or self.leads(init))

    def axes(self, dim: int) -> tuple[str, ...]:
        """The mesh axes the carry's dimension `dim` is split over (0: the batch's)."""
        entry = self.carry[dim] if dim < len(self.carry) else None
        return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))

    def leads(self, init) -> bool:
        """Whether every leaf of `init` leads with the batch."""
        return all(getattr(c, "ndim", 0) and c.shape[0] == self.batch for c in jax.tree.leaves(init))


def program(plan, fn, required: bool = True):
    """`fn` as `plan` runs it (see the module docstring); `fn` itself where the plan knows of no
    layer scan. `required`: an error where tracing `fn` never meets the layer scan."""
    scan_layout, pipe = plan.layer_scan, plan.pipeline
    if scan_layout is None:
        return fn
    if pipe is not None:
        pipe = pipe.checked(scan_layout.layers, scan_layout.batch)  # (a plan read from JSON, edited)
    mesh = abstract_mesh(plan.mesh)

    @functools.wraps(fn)
    def run(*args):
        layout = Layout(mesh, scan_layout.carry, _weight_specs(plan, args, scan_layout), scan_layout.axes(0))
        taken: list[bool] = []

        def planned(inner, f, init, xs, length, kwargs):
            taken.append(True)
            if pipe is not None:
                return pipelined(inner, f, init, xs, pipe, layout)
            return _constrained(inner, f, init, xs, length, layout, **kwargs)

        def handler(inner, f, init, xs, length, **kwargs):
            if taken or not scan_layout.matches(init, xs, length, kwargs):
                return inner(f, init, xs, length, **kwargs)
            if not scan_layout.vmapped:
                return planned(inner, f, init, xs, length, kwargs)

            def batched(fb, init_b):  # the batch, seen from outside the jax.vmap
                if taken or not scan_layout.leads(init_b):
                    return None
                carry, ys = planned(inner, fb, init_b, xs, length, kwargs)
                return carry, jax.tree.map(lambda a: _per_example(a, scan_layout.batch, pipe is not None), ys)

            return under_vmap(inner, f, init, xs, length, kwargs, batched)

        with scans_replaced(handler):
            out = fn(*args)
        if required and not taken:
            raise RuntimeError(
                f"the plan's layer scan ({scan_layout.layers} layers over a batch of {scan_layout.batch}) was not "
                "met while tracing the step: the step changed since it was planned, or it applies its layers "
                "inside a function JAX had traced before (a jax.jit inside the step); re-plan this step"
            )
        return out

    return run


def _constrained(scan, f, init, xs, length, layout: Layout, **kwargs):
    """The layer scan with its carry held to the batch's layout on entry and on every trip."""

    def body(c, x):
        c, y = f(layout.put(c, ()), x)
        return layout.put(c, ()), y

    return scan(body, layout.put(init, ()), xs, length, **kwargs)


def _per_example(ys, batch: int, pipelined: bool):
    """A vmapped scan's per-layer outputs, `[layers, examples, ...]`, as the vmap hands them out
    (`[batch, layers, ...]`). A pipeline made them from one microbatch: they are free of the
    carry (`layerscan`), the same for every example."""
    if pipelined:
        one = ys[:, 0]
        return jnp.broadcast_to(one[None], (batch, *one.shape))
    return jnp.moveaxis(ys, 1, 0)


def _weight_specs(plan, args: Sequence, scan_layout: ScanLayout) -> dict[tuple, tuple]:
    """Per shape of a stacked state leaf without its layer dimension, the plan's spec of those
    dimensions (the first leaf of a shape decides: parameters come before their moments)."""
    out: dict[tuple, tuple] = {}
    for a, arg in enumerate(args):
        if a in scan_layout.batch_argnums:
            continue
        specs = jax.tree.leaves(
            plan.specs_like(arg, argnum=a), is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)
        )
        for leaf, spec in zip(jax.tree.leaves(arg), specs):
            shape = tuple(getattr(leaf, "shape", ()))
            if shape and shape[0] == scan_layout.layers:
                entries = tuple(spec) + (None,) * (len(shape) - len(spec))
                out.setdefault(shape[1:], entries[1:])
    return out
