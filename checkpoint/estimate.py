"""What a restore onto a given plan would read, computed from chunk grids alone (no data read, no
devices needed): for each host, the bytes its devices need and the bytes of the chunks that cover
them. Plans are given as data, `{path: {"mesh": {axis: size}, "spec": [None | axis | [axes]]}}`,
the same form a checkpoint records the sharding it was saved under in.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping

from . import layout


@dataclasses.dataclass(frozen=True)
class ReadEstimate:
    path: str
    bytes_needed: int  # per host, the most any host needs
    bytes_read: int  # per host, the most any host reads

    @property
    def amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


def device_boxes(shape: tuple[int, ...], sharding: Mapping) -> list[layout.Box]:
    """Each device's box, devices in mesh order (row-major over the mesh axes)."""
    mesh = dict(sharding["mesh"])
    spec = list(sharding.get("spec") or []) + [None] * (len(shape) - len(sharding.get("spec") or []))
    names = list(mesh)
    boxes = []
    for coord in itertools.product(*[range(mesh[n]) for n in names]):
        at = dict(zip(names, coord))
        box = []
        for dim, entry in zip(shape, spec):
            axes = [] if entry is None else [entry] if isinstance(entry, str) else list(entry)
            parts = math.prod(mesh[a] for a in axes)
            index = 0
            for a in axes:  # the first axis named is the most significant
                index = index * mesh[a] + at[a]
            size = dim // parts
            box.append(slice(index * size, (index + 1) * size))
        boxes.append(tuple(box))
    return boxes


def estimate(leaves: Mapping, targets: Mapping[str, Mapping], devices_per_host: int) -> list[ReadEstimate]:
    """`leaves`: path -> LeafInfo of a checkpoint step; `targets`: path -> target sharding."""
    out = []
    for path, sharding in targets.items():
        info = leaves[path]
        boxes = device_boxes(tuple(info.shape), sharding)
        item = info.dtype.itemsize
        chunk_bytes = math.prod(info.chunk_shape) * item
        per_host_needed, per_host_read = [], []
        for h in range(0, len(boxes), devices_per_host):
            unique = {tuple((s.start, s.stop) for s in b): b for b in boxes[h : h + devices_per_host]}.values()
            per_host_needed.append(sum(layout.box_size(b, info.shape) for b in unique) * item)
            per_host_read.append(
                sum(layout.chunks_touched(b, info.shape, info.chunk_shape) for b in unique) * chunk_bytes
            )
        out.append(ReadEstimate(path, max(per_host_needed), max(per_host_read)))
    return out


def default_targets(leaves: Mapping, devices: int) -> dict[str, dict]:
    """Without the program's plan: FSDP over all devices on each leaf's first dimension they
    divide, replicated where none does."""
    out = {}
    for path, info in leaves.items():
        dims = [i for i, d in enumerate(info.shape) if d % devices == 0]
        spec = [("x" if dims and i == dims[0] else None) for i in range(len(info.shape))]
        out[path] = {"mesh": {"x": devices}, "spec": spec}
    return out
