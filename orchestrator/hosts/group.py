"""Mechanism for one host group: one Ray actor per host, gang-scheduled with a placement group,
or taken from a pool of standby actors started ahead (`StandbyPool`).

The group is made for one segment and thrown away after it: a `jax.distributed` group cannot be
resized in place, so every resize or failure starts a new group with a new coordinator. What can
be ready before that, is: a standby actor per host has its process up and JAX and the program
imported, so a recovery takes actors instead of spawning processes.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import socket
import threading
import traceback
from collections.abc import Callable, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from ..worker.segment import SegmentSpec, Stop

HOST_RESOURCE = "remesh_host"


class HostsUnavailableError(RuntimeError):
    pass


class HostsLostError(RuntimeError):
    """Actors of the group died or stopped answering."""

    def __init__(
        self,
        indices: Sequence[int],
        node_ids: Sequence[str],
        detail: str,
        survivors: Sequence[tuple[int, HostStatus]] = (),
    ):
        super().__init__(f"hosts {list(indices)} lost: {detail}")
        self.indices = list(indices)
        self.node_ids = list(node_ids)
        # What the hosts that did answer reported in the same poll: steps they finished before
        # the loss, which the checkpoint restored next may already include.
        self.survivors = list(survivors)


class SegmentFailedError(RuntimeError):
    """The training code raised on a host (a bug, not a lost host): resizing will not help."""


@dataclasses.dataclass(frozen=True)
class HostStatus:
    reports: list[dict]
    done: bool
    error: str | None


class HostActor:
    """Runs `worker.run_segment` in a thread; `poll` drains its reports. Threaded (max_concurrency)
    so that poll and request_stop answer while the segment trains."""

    def __init__(self):
        import jax  # noqa: F401  paid here, while the group forms, not on the critical path later

        self._reports: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = Stop.NO
        self._ahead: queue.SimpleQueue = queue.SimpleQueue()  # plans to compile ahead
        self._done = False
        self._error: str | None = None

    def warm(self, modules: Sequence[str]) -> float:
        """Import what a segment will (the program's module, the partitioner and checkpoint code)
        while the actor waits in the standby pool; returns the seconds it took."""
        import importlib
        import time

        t = time.perf_counter()
        for name in ("checkpoint", "partitioner", "orchestrator.job.program", *modules):
            try:
                importlib.import_module(name)
            except ImportError:
                pass  # the segment imports it again and reports the error where it belongs
        return time.perf_counter() - t

    def where(self) -> dict:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        ip = ray.util.get_node_ip_address()
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ip, "port": port, "pid": os.getpid()}

    def start(self, spec_json: str, snapshots=None, executables: dict | None = None) -> None:
        """`snapshots`: a `snapshots.HostSnapshots`, where peer snapshots go and come from;
        `executables`: compiled ahead by an earlier group (`worker.run_segment`)."""
        spec = SegmentSpec.from_json(spec_json)
        args = (spec, snapshots, executables)
        threading.Thread(target=self._run, args=args, daemon=True, name="segment").start()

    def _run(self, spec: SegmentSpec, snapshots, executables: dict | None) -> None:
        from ..telemetry.metrics import RayMetrics
        from ..worker.segment import run_segment

        metrics = RayMetrics()
        memory = snapshots.open() if snapshots is not None else None

        def report(r: dict) -> None:
            if r["kind"] == "step":  # exported from the host that measured it, labelled by host
                metrics.step(spec.job, spec.process_id, r)
            self._reports.put(r)

        try:
            run_segment(
                spec, report, lambda: self._stop, memory=memory, ahead=self._next_ahead, executables=executables
            )
        except BaseException:
            self._error = traceback.format_exc()
        finally:
            if memory is not None:
                memory.close()  # the last share sent before the segment counts as done
            self._done = True

    def _next_ahead(self) -> str | None:
        try:
            return self._ahead.get_nowait()
        except queue.Empty:
            return None

    def compile_ahead(self, plan_json: str) -> None:
        """Compile `plan_json`'s programs beside training, for a later group (process 0)."""
        self._ahead.put(plan_json)

    def poll(self) -> HostStatus:
        done = self._done  # read before draining, so no report is left behind when done
        reports = []
        while True:
            try:
                reports.append(self._reports.get_nowait())
            except queue.Empty:
                return HostStatus(reports, done, self._error)

    def request_stop(self, now: bool = False) -> None:
        """Finish at the next checkpoint boundary, or (`now`) save the step reached and finish."""
        self._stop = max(self._stop, Stop.NOW if now else Stop.AT_CHECKPOINT)


@dataclasses.dataclass(frozen=True)
class HostGroupConfig:
    env_vars: dict = dataclasses.field(default_factory=dict)  # the host actors' environment
    schedule_timeout_s: float = 60.0
    # A poll unanswered this long counts as a lost host. Dead actors are reported by Ray within a
    # second; this catches a host that hangs (stopped, swapping, a wedged driver). A host process
    # answers from a thread of its own, and JAX releases the GIL while it compiles or waits in
    # a collective, so a live host answers within milliseconds even while a group forms.
    poll_timeout_s: float = 10.0


def _actor_cls():
    return ray.remote(num_cpus=0, max_concurrency=4, max_restarts=0)(HostActor)


def alive_hosts() -> list[str]:
    """Node ids of the live nodes that offer a host (the `remesh_host` resource)."""
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(HOST_RESOURCE))


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
                    _actor_cls()
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

    def shutdown(self) -> None:
        for actor in self._idle.values():
            ray.kill(actor, no_restart=True)
        self._idle.clear()


class HostGroup:
    def __init__(self, hosts: int, config: HostGroupConfig, standby: StandbyPool | None = None):
        self.size = hosts
        self.config = config
        self._pg = None
        if standby is not None:
            self.actors = self._from_standby(hosts, standby)
        else:
            self.actors = self._placed(hosts)
        try:
            self.places = ray.get([a.where.remote() for a in self.actors], timeout=config.schedule_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            self.shutdown()
            raise HostsUnavailableError(f"a host actor did not start: {type(e).__name__}") from e
        self.node_ids = [p["node_id"] for p in self.places]

    def _placed(self, hosts: int) -> list:
        """New actors, gang-scheduled one per host by a placement group."""
        config = self.config
        self._pg = placement_group([{HOST_RESOURCE: 1}] * hosts, strategy="STRICT_SPREAD")
        if not self._ready(self._pg.ready(), config.schedule_timeout_s):
            remove_placement_group(self._pg)
            raise HostsUnavailableError(f"could not place {hosts} hosts within {config.schedule_timeout_s:.0f} s")
        return [
            _actor_cls()
            .options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": dict(config.env_vars)},
            )
            .remote()
            for i in range(hosts)
        ]

    def _from_standby(self, hosts: int, standby: StandbyPool) -> list:
        """Standby actors on `hosts` live nodes; where a node has none, one started there now."""
        alive = alive_hosts()
        if len(alive) < hosts:
            raise HostsUnavailableError(f"{len(alive)} hosts are alive, {hosts} were asked for")
        taken = standby.take(hosts, alive)
        missing = [n for n in alive if n not in taken][: hosts - len(taken)]
        standby.refill(missing, self.config.env_vars)
        taken.update(standby.take(len(missing), missing))
        return list(taken.values())

    @staticmethod
    def _ready(ref, timeout: float) -> bool:
        ready, _ = ray.wait([ref], timeout=timeout)
        return bool(ready)

    @property
    def coordinator(self) -> str:
        return f"{self.places[0]['ip']}:{self.places[0]['port']}"

    def start(
        self,
        spec_for: Callable[[int, str], SegmentSpec],
        snapshots: Sequence | None = None,
        executables: dict | None = None,
    ) -> None:
        """`snapshots`: one `snapshots.HostSnapshots` per host, or None (no peer snapshots);
        `executables`: compiled ahead for this group's plan, or None (put in the object store
        once, for every host). Raises HostsLostError if a host died since the group was made
        (its node killed before Ray noticed, say)."""
        shared = ray.put(executables) if executables else None
        refs = [
            a.start.remote(spec_for(i, self.coordinator).to_json(), snapshots[i] if snapshots else None, shared)
            for i, a in enumerate(self.actors)
        ]
        self._answers(refs, "as the group started")

    def poll(self) -> list[HostStatus]:
        answered = self._answers([a.poll.remote() for a in self.actors], "")
        statuses = [s for _, s in answered]
        for i, s in enumerate(statuses):
            if s.error:
                raise SegmentFailedError(f"host {i} failed:\n{s.error}")
        return statuses

    def _answers(self, refs: list, when: str) -> list[tuple[int, object]]:
        """(host index, answer) of every host, waiting at most `poll_timeout_s` for all; raises
        HostsLostError (with what the others answered) if a host died or did not answer."""
        timeout = self.config.poll_timeout_s
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        answered, lost, details = [], [], []
        for i, ref in enumerate(refs):
            if ref not in ready:
                lost.append(i)
                details.append(f"host {i} did not answer within {timeout:.0f} s {when}".rstrip())
                continue
            try:
                answered.append((i, ray.get(ref)))
            except ray.exceptions.RayActorError as e:
                lost.append(i)
                details.append(f"host {i}: {type(e).__name__} {when}".rstrip())
        if lost:
            raise HostsLostError(lost, [self.node_ids[i] for i in lost], "; ".join(details), answered)
        return answered

    def compile_ahead(self, plan_json: str) -> None:
        """Have process 0 compile a smaller mesh's plan beside training (worker._compile_ahead);
        its report carries the executables."""
        self.actors[0].compile_ahead.remote(plan_json)

    def request_stop(self, now: bool = False) -> None:
        # Only process 0's flag is read (worker.StopAgreement broadcasts it), but asking every
        # host costs nothing and survives a change of that rule.
        for a in self.actors:
            a.request_stop.remote(now)

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        if self._pg is not None:
            remove_placement_group(self._pg)
