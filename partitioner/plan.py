"""A plan is pure data: mesh axis names and sizes, a PartitionSpec per argument and output leaf, and
its predicted cost. Devices are bound last (`Plan.bind`), so one plan serves every restart on a mesh
of the same shape, and plans travel as JSON between the controller and the hosts.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .cost import Cost
from .pipeline import Pipeline
from .program import ScanLayout

FORMAT = "remesh.plan/2"  # /2: leaves keyed by slash path (`opt/0/mu/wte`), as checkpoints name them
LEGACY_FORMATS = ("remesh.plan/1",)  # /1: keyed by jax.tree_util.keystr (`['opt'][0]['mu']['wte']`)


def leaf_key(keypath) -> str:
    """A pytree key path as the slash path plans and checkpoints name leaves by: `params/layers/0/w`."""
    return jax.tree_util.keystr(tuple(keypath), simple=True, separator="/")


def mesh_text(mesh: Mapping[str, int], every: bool = False) -> str:
    """`data=4 x model=2`: a mesh's axes and their sizes, those of size 1 only where `every`."""
    return " x ".join(f"{k}={v}" for k, v in mesh.items() if every or v > 1) or "data=1"


class PlanMismatchError(ValueError):
    """A plan was asked for specs of a tree it was not computed for."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """See the module docstring. `in_specs`/`out_specs` are pytrees of PartitionSpec.

    Example:
        >>> plan = partitioner.plan(step, state, batch, devices=8)
        >>> mesh = plan.bind(jax.devices())
        >>> state_shardings = plan.shardings(mesh, state, argnum=0)
    """

    mesh: Mapping[str, int]
    in_specs: tuple[Any, ...]
    out_specs: Any
    cost: Cost
    search_seconds: float
    devices: int  # devices offered; `devices_used` may be fewer when no mesh divides evenly
    notes: tuple[str, ...] = ()
    tactic: str = ""  # the chosen tactic (dp, fsdp, megatron, ...; refined, exact); "" in plans made before it was kept
    slices: int = 1  # equal slices the devices form, slice-major (`bind` keeps each slice's devices together)
    # The step's layer scan where it has one (`program` constrains its carry), and the pipeline
    # it runs as, with a "stage" mesh axis, where the plan pipelines it.
    layer_scan: ScanLayout | None = None
    pipeline: Pipeline | None = None

    @property
    def devices_used(self) -> int:
        return int(np.prod(list(self.mesh.values()), dtype=np.int64))

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.mesh)

    def describe(self) -> str:
        axes = mesh_text(self.mesh, every=True)
        used = (
            f"{self.devices_used} of {self.devices} devices"
            if self.devices_used != self.devices
            else f"{self.devices} devices"
        )
        where = f"mesh {axes} ({used}" + (f" in {self.slices} slices)" if self.slices > 1 else ")")
        return where + (f", {self.pipeline.describe()}" if self.pipeline else "")

    def program(self, fn, required: bool = True):
        """`fn` as this plan runs it: the layer scan's carry held to the plan's layout, the scan
        pipelined where the plan has a pipeline (`program`). Compile this, not `fn`. `required`:
        an error where tracing `fn` never meets the plan's layer scan (False for a step planned
        beside it, such as an evaluation step).

        Example:
            >>> step = plan.jit(plan.program(train_step), (state, batch), jax.devices(), carry={0: 0})
        """
        from .program import program  # noqa: PLC0415

        return program(self, fn, required)

    # -- binding ---------------------------------------------------------------------------
    def bind(self, devices: Sequence[jax.Device]) -> Mesh:
        """A concrete mesh on the first `devices_used` of `devices` (in the order given). On
        slices, the order given is taken as slice-major unless the devices say their slice
        (`slice_index`, as TPUs do): then each slice's devices are put together, slices in order,
        as `mesh_utils.create_hybrid_device_mesh` orders them."""
        devices = _slice_major(list(devices), self.slices)
        if len(devices) < self.devices_used:
            raise ValueError(
                f"plan needs {self.devices_used} devices for mesh {dict(self.mesh)}, but got "
                f"{len(devices)}; re-plan for the devices you have"
            )
        grid = np.array(devices[: self.devices_used], dtype=object).reshape(tuple(self.mesh.values()))
        return Mesh(grid, self.axis_names)

    def specs_like(self, tree: Any, *, argnum: int | None = None) -> Any:
        """PartitionSpecs for `tree`, matched leaf by leaf by key path (works after from_json)."""
        flat = _flatten_specs(self.in_specs[argnum] if argnum is not None else self.out_specs)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
        specs = []
        for path, _ in leaves:
            key = leaf_key(path)
            if key not in flat:
                where = f"argument {argnum}" if argnum is not None else "outputs"
                raise PlanMismatchError(
                    f"plan has no spec for {where} leaf {key}; the plan covers {len(flat)} leaves "
                    f"(e.g. {next(iter(flat), '-')}). Re-plan for this program."
                )
            specs.append(flat[key])
        return jax.tree_util.tree_unflatten(treedef, specs)

    def shardings(self, mesh: Mesh, tree: Any, *, argnum: int | None = None) -> Any:
        specs = self.specs_like(tree, argnum=argnum)
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)

    def jit(
        self,
        fn,
        args: Sequence[Any],
        devices: Sequence[jax.Device],
        *,
        carry: Mapping[int, int] | None = None,
        donate_argnums: Sequence[int] = (),
        replicated_outputs: bool = False,
        **jit_kwargs,
    ):
        """`fn` jitted with this plan's shardings on `devices`: the one way a plan is compiled.

        `carry`: {output index: argument index} for a function returning a tuple whose element is
        an argument's next value (a training step's new state, `carry={0: 0}`): it keeps that
        argument's shardings, so its donated buffers are reused in place and the next call needs
        no reshard. Other outputs take the plan's `out_specs`; those it keeps replicated (metrics)
        are given as one replicated prefix, so `fn` need not be traced to learn their tree.
        `replicated_outputs`: every output replicated, for another function of the planned
        arguments whose small outputs the plan does not name (an evaluation step's metrics).

        Example:
            >>> step = plan.jit(train_step, (state, batch), jax.devices(), carry={0: 0}, donate_argnums=(0,))
        """
        mesh = self.bind(devices)
        ins = tuple(self.shardings(mesh, a, argnum=i) for i, a in enumerate(args))
        if replicated_outputs:
            outs = NamedSharding(mesh, PartitionSpec())
        else:
            outs = self._carried_outputs(mesh, ins, carry) if carry else None
        if outs is None:  # by key path, so JSON plans work too
            outs = self.shardings(mesh, jax.eval_shape(fn, *args))
        return jax.jit(fn, in_shardings=ins, out_shardings=outs, donate_argnums=tuple(donate_argnums), **jit_kwargs)

    def _carried_outputs(self, mesh: Mesh, ins: tuple, carry: Mapping[int, int]) -> tuple | None:
        """Output shardings for a tuple output without tracing, or None where the plan splits an
        output that is not carried (its tree is then needed)."""
        flat = _flatten_specs(self.out_specs)
        if not flat:
            return None
        count = 1 + max([*carry, *(int(k.split("/")[0]) for k in flat if k.split("/")[0].isdigit())])
        outs = []
        for i in range(count):
            if i in carry:
                outs.append(ins[carry[i]])
                continue
            mine = [s for k, s in flat.items() if k == str(i) or k.startswith(f"{i}/")]
            if any(tuple(s) for s in mine):
                return None
            outs.append(NamedSharding(mesh, PartitionSpec()))
        return tuple(outs)

    # -- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "mesh": [[k, int(v)] for k, v in self.mesh.items()],
            "in_specs": [_specs_to_json(t) for t in self.in_specs],
            "out_specs": _specs_to_json(self.out_specs),
            "cost": dataclasses.asdict(self.cost),
            "search_seconds": self.search_seconds,
            "devices": self.devices,
            "notes": list(self.notes),
            "tactic": self.tactic,
            "slices": self.slices,
            "layer_scan": self.layer_scan.to_dict() if self.layer_scan else None,
            "pipeline": self.pipeline.to_dict() if self.pipeline else None,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping) -> Plan:
        if d.get("format") in LEGACY_FORMATS:
            d = {**d, "in_specs": [_slash_keys(t) for t in d["in_specs"]], "out_specs": _slash_keys(d["out_specs"])}
        elif d.get("format") != FORMAT:
            raise ValueError(f"expected a plan with format {FORMAT!r}, got {d.get('format')!r}")
        return cls(
            mesh={k: v for k, v in d["mesh"]},
            in_specs=tuple(_specs_from_json(t) for t in d["in_specs"]),
            out_specs=_specs_from_json(d["out_specs"]),
            cost=Cost(**d["cost"]),
            search_seconds=d["search_seconds"],
            devices=d["devices"],
            notes=tuple(d["notes"]),
            tactic=d.get("tactic", ""),  # plans written before the tactic was recorded
            slices=d.get("slices", 1),  # plans written before slices were
            layer_scan=ScanLayout.from_dict(d["layer_scan"]) if d.get("layer_scan") else None,
            pipeline=Pipeline.from_dict(d["pipeline"]) if d.get("pipeline") else None,
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


def _slice_major(devices: list, slices: int) -> list:
    """`devices` with each slice's together, where they say their slices (TPUs in several slices
    do; CPU and GPU devices say one, or none: their order, process by process, is the slices')."""
    if slices == 1 or any(getattr(d, "slice_index", None) is None for d in devices):
        return devices
    counts = collections.Counter(d.slice_index for d in devices)
    if len(counts) == 1:
        return devices
    order = sorted(range(len(devices)), key=lambda i: (devices[i].slice_index, i))
    if len(counts) != slices or len(set(counts.values())) != 1:
        raise ValueError(
            f"plan is for {slices} equal slices, but the devices given are in {len(counts)} slices of "
            f"{sorted(counts.values())} devices; re-plan with slices={len(counts)} or pass the devices of {slices} equal slices"
        )
    return [devices[i] for i in order]


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


class FlatSpecs(dict):
    """Specs keyed by pytree key path, as a plan read from JSON holds them (no treedef in JSON)."""


def _flatten_specs(tree) -> dict[str, PartitionSpec]:
    if isinstance(tree, FlatSpecs):
        return tree
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_spec)
    return {leaf_key(p): s for p, s in leaves}


def _spec_to_json(spec: PartitionSpec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _spec_from_json(entries: list) -> PartitionSpec:
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in entries])


def _specs_to_json(tree) -> dict[str, list]:
    return {k: _spec_to_json(s) for k, s in _flatten_specs(tree).items()}


def _specs_from_json(d: Mapping[str, list]) -> FlatSpecs:
    return FlatSpecs({k: _spec_from_json(v) for k, v in d.items()})


def _slash_keys(specs: Mapping[str, list]) -> dict[str, list]:
    """Specs keyed by keystr (`['opt'][0].value`) re-keyed by slash path (`opt/0/value`)."""
    part = re.compile(r"\['((?:[^'\\]|\\.)*)'\]|\[(-?\d+)\]|\.(\w+)")
    return {
        "/".join(next(g for g in m.groups() if g is not None) for m in part.finditer(k)): v for k, v in specs.items()
    }
