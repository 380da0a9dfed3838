"""Copies of the state that should be equal, compared: silent data corruption found on the devices.

A plan keeps several copies of most of the state: a leaf replicated over a data-parallel axis has
one copy per replica, each on its own devices. A copy that a bad memory cell, a flipped bit on a
link or a faulty core changed computes on as if nothing happened. Each device sums its own blocks
of every leaf as the state digest does (job/digest.py: the bits mixed with their index, summed
modulo 2**32, twice), in one program over the whole mesh; the table of every device's sums (a few
words a leaf) is gathered to every process, and the devices holding the same block of a leaf are
compared. A copy that differs from the majority of its block's copies is named with its device
and that device's process; where there is no majority (two copies), both are.

    fn = compile_replica_sums(abstract_state_with_shardings)
    found = disagreements(np.asarray(fn(*jax.tree.leaves(state)).addressable_data(0)), abstract_state)
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

from .digest import _leaf_sums


@dataclasses.dataclass(frozen=True)
class Disagreement:
    """Copies of one block of one leaf that differ from the others."""

    leaf: str  # its path in the state
    block: tuple[tuple[int, int], ...]  # the block: (start, stop) per dimension
    copies: int  # devices holding the block
    devices: tuple[int, ...]  # the devices whose copy differs (ids)
    processes: tuple[int, ...]  # and their processes (hosts)
    majority: bool  # whether the others agree (else every copy is suspect)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _mesh(abstract_state):
    import jax

    for leaf in jax.tree.leaves(abstract_state):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None:
            return mesh
    raise ValueError("the state has no leaf laid out on a mesh: give it the plan's shardings")


def compile_replica_sums(abstract_state: Any, compile: Callable | None = None):
    """The program that gives every device's sums of its blocks: called with the state's leaves,
    it returns a `[devices, leaves, 2]` uint32 table (rows in the mesh's device order), on every
    device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _mesh(abstract_state)
    leaves = jax.tree.leaves(abstract_state)

    def local(*blocks):
        return jnp.stack([_leaf_sums(b) for b in blocks])[None]

    every = tuple(mesh.axis_names)
    sums = jax.shard_map(local, mesh=mesh, in_specs=tuple(x.sharding.spec for x in leaves), out_specs=P(every),
                         check_vma=False)  # fmt: skip
    lowered = jax.jit(sums, out_shardings=NamedSharding(mesh, P())).lower(*leaves)
    return compile(lowered) if compile else lowered.compile()


def disagreements(table, abstract_state: Any) -> list[Disagreement]:
    """The blocks whose copies differ, from `table` (`compile_replica_sums`'s, read to the host)."""
    import jax

    from checkpoint import leaf_path

    mesh = _mesh(abstract_state)
    row = {d: i for i, d in enumerate(mesh.devices.flat)}
    out = []
    for n, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(abstract_state)[0]):
        blocks: dict[tuple, list] = collections.defaultdict(list)
        for device, index in leaf.sharding.devices_indices_map(tuple(leaf.shape)).items():
            blocks[tuple(s.indices(d)[:2] for s, d in zip(index, leaf.shape))].append(device)
        for block, devices in blocks.items():
            found = _odd_ones(devices, [tuple(table[row[d], n]) for d in devices])
            if found is not None:
                odd, majority = found
                out.append(Disagreement(leaf_path(path), block, len(devices), tuple(d.id for d in odd),
                                        tuple(sorted({d.process_index for d in odd})), majority))  # fmt: skip
    return out


def _odd_ones(devices: list, sums: list[tuple]) -> tuple[list, bool] | None:
    """(the devices whose sums differ from the majority's, whether there is a majority), or None
    where every copy agrees."""
    counts = collections.Counter(sums)
    if len(counts) <= 1:
        return None
    common, times = counts.most_common(1)[0]
    if times * 2 > len(sums):
        return [d for d, s in zip(devices, sums) if s != common], True
    return list(devices), False
