"""What is computed once per graph and read by every candidate, kept by the module that computes
it (`PerGraph`), keyed by the graph itself and held weakly: gone with the graph, and never a field
of the IR, which knows nothing of its readers. The caches are `repeats` (op signatures),
`propagate` (what propagation reads of the ops, and the first stages it kept) and `cost` (the
ops' work, the values off the matmul path).

A graph made from another's ops (depth planning's deep graph: a shallow fold's ops with the deep
step's outputs) reads what the other found (`share`): the same ops, the same answers.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

_CACHES: list[PerGraph] = []


class PerGraph:
    """One module's cache of something computed from a graph."""

    def __init__(self, name: str):
        self.name = name
        self._values: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        _CACHES.append(self)

    def get(self, graph, make: Callable[[], Any] | None = None):
        """The value kept for `graph`; where none is, `make()` kept and returned (None without `make`)."""
        value = self._values.get(graph)
        if value is None and make is not None:
            value = self._values[graph] = make()
        return value

    def put(self, graph, value) -> None:
        self._values[graph] = value

    def forget(self, graph) -> None:
        self._values.pop(graph, None)


def share(new, old) -> None:
    """`new` (made from `old`'s ops) reads every cache `old` has, the same objects."""
    for cache in _CACHES:
        value = cache.get(old)
        if value is not None:
            cache.put(new, value)
