"""A step's arguments as both planners read them: abstract leaves, their key names, which
arguments hold the batch, and the devices asked for."""

from __future__ import annotations

import jax
import numpy as np

from .errors import PlanInputError


def abstract_leaf(x) -> jax.ShapeDtypeStruct:
    """An argument leaf (an array, a ShapeDtypeStruct, a Python number) as a bare ShapeDtypeStruct."""
    if type(x) is jax.ShapeDtypeStruct and x.sharding is None and not x.weak_type:
        return x  # (already bare: a deep model has ~10^4 leaves)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(x, "dtype") else np.result_type(x))


def device_count(devices) -> int:
    """`devices` (a count or a list of devices) as a count, at least 1."""
    n = devices if isinstance(devices, int) else len(devices)
    if n < 1:
        raise PlanInputError(f"devices must be at least 1, got {n}")
    return n


def key_name(key) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def batch_argnums(abstract, out) -> tuple[int, ...]:
    """Arguments that are not carried state. A training step returns its new state first, so an
    argument with the same tree and shapes as the first output is state; the rest are batch."""
    carried = out[0] if isinstance(out, tuple) and out else out
    state = {i for i, a in enumerate(abstract) if _signature(a) == _signature(carried)}
    batch = tuple(i for i in range(len(abstract)) if i not in state)
    if not batch:
        raise PlanInputError("could not tell the batch argument from the state: pass batch_argnums=")
    return batch


def _signature(tree):
    return jax.tree.structure(tree), [(l.shape, l.dtype) for l in jax.tree.leaves(tree)]
