"""A host's probe: the same fixed piece of device work timed on a host set aside and on a healthy
one, side by side, so that a straggler is taken back once it computes at its peers' pace again;
and a host's probation (`Probation`): probed after a wait, then at doubling waits, until it passes.
The job's health loop keeps a straggler on probation, the fleet scheduler a host handed back
as suspect.

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

SIZE, ROUNDS, ROUND_S = 1024, 5, 0.05


def _work() -> float:
    """Seconds a matmul of SIZE x SIZE takes on this process's first device: the fastest of
    ROUNDS rounds (a moment's contention is not the host's speed), each of as many matmuls as
    take ROUND_S or more (a device that computes one in microseconds is timed, not its dispatch).
    A wrong answer (the sum of a product of ones is SIZE**3, exact in float32) is an infinite time:
    a host whose device computes wrongly never passes."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((SIZE, SIZE), jnp.float32)
    f = jax.jit(lambda a: (a @ a).sum())
    answers, repeats, timed = [f(x).block_until_ready()], 1, []
    while len(timed) < ROUNDS:  # (bounded: `repeats` doubles at most 12 times)
        t = time.perf_counter()
        answers += jax.block_until_ready([f(x) for _ in range(repeats)])
        took = time.perf_counter() - t
        if took < ROUND_S and repeats < 4096:
            repeats *= 2
        else:
            timed.append(took / repeats)
    best = min(timed)
    return best if all(float(a) == SIZE**3 for a in answers) else float("inf")


def _probe(hook: HookRef | None) -> float:
    """The work's seconds, and nothing else of the task (its process start and JAX's import are
    no measure of the device)."""
    from ..worker.hooks import load_fault_hook

    seconds = _work()
    t = time.perf_counter()
    load_fault_hook(hook, lambda report: None).probe_work(seconds)  # (fault injection: a slow node's probe)
    return seconds + (time.perf_counter() - t)


@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """A host set aside is probed `first_after_s` after, then at twice the wait each time it is
    still slow (at most `max_wait_s`); it passes when `passes` probes in a row, the later ones at
    once, each take at most `healthy` times a peer's. (One probe is one sample of two hosts' speed
    while the peer trains: a host 3x slow measured 1.3x to 13x a busy peer on a loaded machine, so
    one pass alone could take a straggler back. Load balancers' health checks ask as much.)"""

    first_after_s: float = 10.0
    max_wait_s: float = 600.0
    healthy: float = 1.25
    passes: int = 2


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

    def spec(self, node: str) -> dict:
        """How to probe `node` elsewhere, in plain data (the fleet scheduler probes a host a job
        handed back as suspect): `for_node` makes the probe again."""
        hook = self.hook(node)
        return {"env": dict(self.env), "hook": dataclasses.asdict(hook) if hook is not None else None}

    @classmethod
    def for_node(cls, node: str, spec: dict) -> HostProbe:
        hook = HookRef(**spec["hook"]) if spec.get("hook") else None
        return cls(spec.get("env") or {}, lambda n: hook if n == node else None)

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

    @staticmethod
    def result(probing: Probing) -> float | None | bool:
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


@dataclasses.dataclass
class Probation:
    """A host set aside, probed `config.first_after_s` after (or `wait_s`), then at twice the wait
    each time it is still slow, until `config.passes` probes in a row take at most
    `config.healthy` times a peer's."""

    node: str
    config: ProbeConfig
    next_at: float  # the caller's clock
    wait_s: float
    probing: Probing | None = None  # a probe under way
    ratios: list = dataclasses.field(default_factory=list)  # each probe's time over its peer's
    streak: int = 0  # the probes passed in a row

    @classmethod
    def begin(cls, node: str, config: ProbeConfig, now: float, wait_s: float | None = None) -> Probation:
        wait_s = config.first_after_s if wait_s is None else wait_s
        return cls(node, config, now + wait_s, wait_s)

    def poll(self, probe: HostProbe, now: float, reference: str | None) -> bool | None:
        """Starts a probe when due (beside `reference`, where there is one) and reads it when done,
        without waiting: True once enough passed in a row; False when one failed (the next waits
        twice as long); None while nothing is new (a pass not yet enough: the next starts at once)."""
        if self.probing is None:
            if now >= self.next_at and reference is not None:
                self.probing = probe.start(self.node, reference)
            return None
        ratio = probe.result(self.probing)
        if ratio is False:
            return None  # (still running)
        self.probing = None
        self.ratios.append(None if ratio is None else round(ratio, 3))
        if ratio is not None and ratio <= self.config.healthy:
            self.streak += 1
            if self.streak >= self.config.passes:
                return True
            self.next_at = now
            return None
        self.streak = 0
        self.wait_s = min(2 * self.wait_s, self.config.max_wait_s)
        self.next_at = now + self.wait_s
        return False
