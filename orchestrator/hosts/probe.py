"""A host's probe: the same fixed piece of device work timed on a host set aside and on a healthy
one, side by side, so that a straggler is taken back once it computes at its peers' pace again;
and a host's probation (`Probation`): probed after a wait, then at doubling waits, until it passes.
The job's health loop keeps a straggler on probation, the fleet scheduler a host handed back
as suspect.

The work is a jitted matmul loop on the host's first device, in a fresh process on that node
(a Ray actor pinned to it, with the hosts' environment): no collective, so what it times is the
host's own speed. Both sides, once started and compiled, time rounds of it in turns. Asked
without waiting (`start`), read when done (`result`): the controller's loop polls on meanwhile.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import ray

from ..protocol import HookRef

SIZE, ROUNDS, ROUND_S = 1024, 5, 0.05


class _Work:
    """A jitted matmul of SIZE x SIZE on this process's first device, compiled and sized when made:
    a round is as many matmuls as take ROUND_S or more (a device that computes one in
    microseconds is timed, not its dispatch)."""

    def __init__(self):
        import jax
        import jax.numpy as jnp

        self.x = jnp.ones((SIZE, SIZE), jnp.float32)
        self.f = jax.jit(lambda a: (a @ a).sum())
        self.f(self.x).block_until_ready()
        self.repeats = 1
        while self.round() * self.repeats < ROUND_S and self.repeats < 4096:  # (doubles at most 12 times)
            self.repeats *= 2

    def round(self) -> float:
        """A matmul's seconds over one round; a wrong answer (the sum of a product of ones is
        SIZE**3, exact in float32) is an infinite time: a host whose device computes wrongly never
        passes."""
        import jax

        t = time.perf_counter()
        answers = jax.block_until_ready([self.f(self.x) for _ in range(self.repeats)])
        took = (time.perf_counter() - t) / self.repeats
        return took if all(float(a) == SIZE**3 for a in answers) else float("inf")


class _Prober:
    """One side of a probe, in a fresh process on its node: `ready` imports JAX and compiles and
    sizes the work; `round` times one round of it, after the `after` refs (the other side's
    round before it) are done. The two sides take turns, so that neither is timed while the
    other computes: on hosts sharing a machine, two sides timed at once measured a healthy host
    at 0.47x to 2.2x its peer."""

    def __init__(self, hook: HookRef | None):
        self.hook, self.work, self.fault = hook, None, None

    def ready(self) -> bool:
        from ..worker.hooks import load_fault_hook

        self.work, self.fault = _Work(), load_fault_hook(self.hook, lambda report: None)
        return True

    def round(self, *after) -> float:
        """A matmul's seconds in one round (with fault injection's slowness, where the hook asks)."""
        seconds = self.work.round()
        t = time.perf_counter()
        self.fault.probe_work(seconds)  # (a slow node's probe)
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
    sides: tuple  # the `_Prober` actors: (the node's, the reference's)
    rounds: tuple  # each side's rounds' refs: (the node's, the reference's), taken in turns


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

        prober = ray.remote(num_cpus=0, max_restarts=0)(_Prober)
        sides = tuple(
            prober.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False),
                runtime_env={"env_vars": dict(self.env)},
            ).remote(self.hook(n))  # fmt: skip
            for n in (node, reference)
        )
        # The rounds in turns, chained by their refs (Ray runs a call once its arguments are
        # done): the node's first round once both sides are ready, then the reference's, and so on.
        before, mine, theirs = tuple(side.ready.remote() for side in sides), [], []
        for _ in range(ROUNDS):
            mine.append(sides[0].round.remote(*before))
            theirs.append(sides[1].round.remote(mine[-1]))
            before = (theirs[-1],)
        return Probing(node, reference, sides, (tuple(mine), tuple(theirs)))

    @staticmethod
    def result(probing: Probing) -> float | None | bool:
        """The node's fastest round over the reference's (a moment's contention is not a host's
        speed) once every round is done; False until then; None where a side failed (the node
        gone: it stays set aside)."""
        last = probing.rounds[1][-1]
        if not ray.wait([last], timeout=0)[0]:
            return False
        try:
            mine, theirs = (ray.get(list(refs)) for refs in probing.rounds)
        except ray.exceptions.RayError:
            mine = theirs = None
        HostProbe.stop(probing)
        return None if mine is None else min(mine) / max(min(theirs), 1e-9)

    @staticmethod
    def stop(probing: Probing) -> None:
        """Ends both sides' processes (done, failed, or no longer wanted)."""
        for side in probing.sides:
            ray.kill(side)


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

    def stop(self) -> None:
        """A probe under way ended: the host is let go without it."""
        if self.probing is not None:
            HostProbe.stop(self.probing)
            self.probing = None

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
