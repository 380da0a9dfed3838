"""The one FSDP rule: a state leaf is sharded over the FSDP axis on its largest dimension (the
first of equals) that the axis's size divides and is no smaller than, among those no other axis
splits yet; a leaf with none stays replicated. The FSDP axis is `data`, the batch's own (ZeRO-3:
each data-parallel rank holds a slice of the state); where the state is replicated over a group
of FSDP shards (HSDP, or a plan across slices), that outer axis is `replica`.
"""

from __future__ import annotations

from collections.abc import Sequence

AXIS = "data"


def fsdp_dim(shape: Sequence[int], size: int, taken: Sequence[bool] = ()) -> int | None:
    """The dimension of `shape` FSDP shards over an axis of `size`, or None; `taken[i]`: an axis
    already splits dimension i."""
    free = [i for i, n in enumerate(shape) if not (i < len(taken) and taken[i]) and n % size == 0 and n >= size]
    return max(free, key=lambda i: shape[i]) if free else None
