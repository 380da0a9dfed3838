"""A step's metrics as the reports carry them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Every scalar a step returned, by slash path (`aux/z_loss`); arrays are left out (a step
    that returns none but its loss reports only the loss)."""
    import jax
    import numpy as np

    from checkpoint import leaf_path

    leaves = jax.tree_util.tree_flatten_with_path(metrics)[0]
    return {leaf_path(path): float(value) for path, value in leaves if np.ndim(value) == 0}
