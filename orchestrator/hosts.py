"""Mechanism for one host group: one Ray actor per host, gang-scheduled with a placement group.

The group is made for one segment and thrown away after it: a `jax.distributed` group cannot be
resized in place, so every resize or failure starts a new group with a new coordinator.
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
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .worker import SegmentSpec, Stop

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
        self._done = False
        self._error: str | None = None

    def where(self) -> dict:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        ip = ray.util.get_node_ip_address()
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ip, "port": port, "pid": os.getpid()}

    def start(self, spec_json: str) -> None:
        spec = SegmentSpec.from_json(spec_json)
        threading.Thread(target=self._run, args=(spec,), daemon=True, name="segment").start()

    def _run(self, spec: SegmentSpec) -> None:
        from .metrics import RayMetrics
        from .worker import run_segment

        metrics = RayMetrics()

        def report(r: dict) -> None:
            if r["kind"] == "step":  # exported from the host that measured it, labelled by host
                metrics.step(spec.job, spec.process_id, r)
            self._reports.put(r)

        try:
            run_segment(spec, report, lambda: self._stop)
        except BaseException:
            self._error = traceback.format_exc()
        finally:
            self._done = True

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
    # second; this only catches a host that hangs, so it can be generous.
    poll_timeout_s: float = 30.0


class HostGroup:
    def __init__(self, hosts: int, config: HostGroupConfig):
        self.size = hosts
        self.config = config
        self._pg = placement_group([{HOST_RESOURCE: 1}] * hosts, strategy="STRICT_SPREAD")
        if not self._ready(self._pg.ready(), config.schedule_timeout_s):
            remove_placement_group(self._pg)
            raise HostsUnavailableError(f"could not place {hosts} hosts within {config.schedule_timeout_s:.0f} s")
        actor_cls = ray.remote(num_cpus=0, max_concurrency=4, max_restarts=0)(HostActor)
        self.actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": dict(config.env_vars)},
            ).remote()
            for i in range(hosts)
        ]
        self.places = ray.get([a.where.remote() for a in self.actors], timeout=config.schedule_timeout_s)
        self.node_ids = [p["node_id"] for p in self.places]

    @staticmethod
    def _ready(ref, timeout: float) -> bool:
        ready, _ = ray.wait([ref], timeout=timeout)
        return bool(ready)

    @property
    def coordinator(self) -> str:
        return f"{self.places[0]['ip']}:{self.places[0]['port']}"

    def start(self, spec_for: Callable[[int, str], SegmentSpec]) -> None:
        ray.get([a.start.remote(spec_for(i, self.coordinator).to_json()) for i, a in enumerate(self.actors)])

    def poll(self) -> list[HostStatus]:
        refs = [a.poll.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.poll_timeout_s)
        answered, lost, details = [], [], []  # answered: (host index, status)
        for i, ref in enumerate(refs):
            if ref not in ready:
                lost.append(i)
                details.append(f"host {i} did not answer within {self.config.poll_timeout_s:.0f} s")
                continue
            try:
                answered.append((i, ray.get(ref)))
            except ray.exceptions.RayActorError as e:
                lost.append(i)
                details.append(f"host {i}: {type(e).__name__}")
        if lost:
            raise HostsLostError(lost, [self.node_ids[i] for i in lost], "; ".join(details), answered)
        statuses = [s for _, s in answered]
        for i, s in enumerate(statuses):
            if s.error:
                raise SegmentFailedError(f"host {i} failed:\n{s.error}")
        return statuses

    def request_stop(self, now: bool = False) -> None:
        # Only process 0's flag is read (worker.StopAgreement broadcasts it), but asking every
        # host costs nothing and survives a change of that rule.
        for a in self.actors:
            a.request_stop.remote(now)

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self._pg)
