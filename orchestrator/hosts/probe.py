"""A host's probe: the same fixed piece of device work timed on a host set aside and on a healthy
one, side by side, so that a straggler is taken back once it computes at its peers' pace again.

The work is a jitted matmul loop on the host's first device, in a fresh process on that node
(a Ray task pinned to it, with the hosts' environment): no collective, so what it times is the
host's own speed. Asked without waiting (`start`), read when done (`result`): the controller's
loop polls on meanwhile.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import ray

from ..protocol import HookRef

SIZE, REPEATS = 512, 20


def _work() -> float:
    """Seconds for REPEATS matmuls of SIZE x SIZE on this process's first device (compiled first)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((SIZE, SIZE), jnp.float32)
    f = jax.jit(lambda a: (a @ a).sum())
    f(x).block_until_ready()
    t = time.perf_counter()
    for _ in range(REPEATS):
        f(x).block_until_ready()
    return time.perf_counter() - t


def _probe(hook: HookRef | None) -> float:
    from ..worker.hooks import load_fault_hook

    t = time.perf_counter()
    seconds = _work()
    load_fault_hook(hook, lambda report: None).probe_work(seconds)  # (fault injection: a slow node's probe)
    return time.perf_counter() - t


@dataclasses.dataclass(frozen=True)
class Probing:
    node: str
    reference: str
    refs: tuple  # (the node's, the reference's)


class HostProbe:
    """Probes nodes on a Ray cluster whose hosts get `env` (`Cluster.host_env`); `hook(node)`:
    fault injection's hook for a node's probe (None in real jobs)."""

    def __init__(self, env: dict[str, str], hook: Callable[[str], HookRef | None] = lambda node: None):
        self.env, self.hook = env, hook

    def start(self, node: str, reference: str) -> Probing:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0, max_retries=0)(_probe)
        refs = tuple(
            task.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False),
                runtime_env={"env_vars": dict(self.env)},
            ).remote(self.hook(n))  # fmt: skip
            for n in (node, reference)
        )
        return Probing(node, reference, refs)

    def result(self, probing: Probing) -> float | None | bool:
        """The node's time over the reference's once both are done; False while they run; None
        where a probe failed (the node gone: it stays set aside)."""
        ready, _ = ray.wait(list(probing.refs), num_returns=2, timeout=0)
        if len(ready) < 2:
            return False
        try:
            mine, theirs = ray.get(list(probing.refs))
        except ray.exceptions.RayError:
            return None
        return mine / max(theirs, 1e-9)
