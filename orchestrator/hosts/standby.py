"""Standby host actors: one idle actor per host node, started ahead of need, so that a recovery
takes actors instead of spawning processes."""

from __future__ import annotations

from collections.abc import Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .actor import actor_cls


class StandbyPool:
    """One idle host actor per host node, started ahead of need: its process up, JAX and the
    program imported. `refill` starts the missing ones (off the recovery path: after a new
    group's first step, or when a host joins); a group `take`s them."""

    def __init__(self, modules: Sequence[str] = ()):
        self.modules = tuple(modules)
        self._idle: dict[str, ray.actor.ActorHandle] = {}  # node id -> a standby actor there

    def refill(self, node_ids: Sequence[str], env_vars: dict) -> None:
        """Start a standby actor on each of `node_ids` that has none."""
        for node in node_ids:
            if node not in self._idle:
                actor = (
                    actor_cls()
                    .options(
                        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                        runtime_env={"env_vars": dict(env_vars)},
                    )
                    .remote()
                )
                actor.warm.remote(self.modules)
                self._idle[node] = actor

    def take(self, hosts: int, alive: Sequence[str]) -> dict[str, ray.actor.ActorHandle]:
        """Up to `hosts` standby actors on live nodes (node id -> actor), out of the pool."""
        for node in [n for n in self._idle if n not in alive]:
            self._idle.pop(node)  # died with its node
        return {node: self._idle.pop(node) for node in [n for n in alive if n in self._idle][:hosts]}

    def take_on(self, nodes: Sequence[str]) -> dict[str, ray.actor.ActorHandle]:
        """The standby actors on `nodes` (node id -> actor) that the pool has, out of it."""
        return {node: self._idle.pop(node) for node in nodes if node in self._idle}

    def shutdown(self) -> None:
        for actor in self._idle.values():
            ray.kill(actor, no_restart=True)
        self._idle.clear()
