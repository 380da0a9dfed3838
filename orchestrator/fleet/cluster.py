"""A running Ray cluster shared by several jobs through its fleet scheduler (fleet/scheduler.py):
this job's hosts are the ones the scheduler reserved for it, its host actors run in those
reservations, and what it no longer runs on it gives back.

A thread reports to the scheduler every `FleetClusterConfig.heartbeat_s` while the job lives
(whatever the controller is doing: a long compile must not look like a dead driver), carrying what
a shrink would cost the job now (`attach`: the job's progress, handed in by whoever follows the
grant, `control.fleet_following`); each report answers with the job's grant.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import ray

from ..hosts.cluster import RayCluster
from ..hosts.group import alive_hosts
from ..hosts.interface import Placement
from ..hosts.slices import host_slices
from ..protocol.fleet import FleetProgress, Grant, Registration
from .scheduler import FleetSchedulerConfig, start


@dataclasses.dataclass(frozen=True)
class FleetClusterConfig:
    heartbeat_s: float = 2.0
    scheduler: FleetSchedulerConfig = dataclasses.field(default_factory=FleetSchedulerConfig)  # if it starts one


class FleetCluster(RayCluster):
    def __init__(self, address: str, registration: Registration, config: FleetClusterConfig = FleetClusterConfig()):
        super().__init__(address)
        self.run, self.config, self.registration = registration.run, config, registration
        self.scheduler = start(config.scheduler)
        self._progress: Callable[[], FleetProgress] = FleetProgress  # nothing known until `attach`
        self._lock = threading.Lock()
        self._grant = self._call("register", dataclasses.asdict(registration))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="remesh-fleet-heartbeat")
        self._thread.start()

    @property
    def grant(self) -> Grant:
        with self._lock:
            return self._grant

    def attach(self, progress: Callable[[], FleetProgress]) -> None:
        """Report the job's progress (what `progress()` answers) with every heartbeat from now on."""
        self._progress = progress

    def report(self) -> Grant:
        p = self._progress()
        return self._call("report", self.run, p.since_snapshot, p.smaller_ready, p.grows)

    def alive_hosts(self) -> list[str]:
        """This job's hosts: reserved for it, placed, and alive."""
        alive = set(alive_hosts())
        return [node for node, _ in self.grant.hosts if node in alive]

    def cluster_hosts(self) -> int:
        """Every live host of the cluster, this job's and the others' and the idle ones."""
        return len(alive_hosts())

    def slice_of(self) -> dict[str, str]:
        """The slices of this job's hosts, as the hosts say them (one read of Ray's node table)."""
        nodes = ray.nodes()
        alive = {n["NodeID"] for n in nodes if n["Alive"]}
        mine = {node for node, _ in self.grant.hosts if node in alive}
        return {node: name for node, name in host_slices(nodes).items() if node in mine}

    def placement(self, hosts: int) -> Placement:
        return self.placement_on(self.alive_hosts()[:hosts])

    def placement_on(self, node_ids: Sequence[str]) -> Placement:
        """The reservation (a placement group) of each of `node_ids`, for the host actors there."""
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup

        groups = dict(self.grant.hosts)
        return Placement(reservations=[PlacementGroup(PlacementGroupID(bytes.fromhex(groups[n]))) for n in node_ids])

    def release(self, node_ids: Sequence[str], suspect: dict[str, dict] | None = None) -> Grant:
        """Give back `node_ids`; `suspect`: those of them the health loop set aside (node -> why
        and how to probe it, `hosts.probe.HostProbe.spec`), which no job gets until they pass."""
        return self._call("release", self.run, list(node_ids), dict(suspect or {}))

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            ray.get(self.scheduler.finish.remote(self.run), timeout=30)
        finally:
            super().shutdown()

    def _call(self, method: str, *args) -> Grant:
        try:
            answer = ray.get(getattr(self.scheduler, method).remote(*args), timeout=60)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, ValueError):  # the job's own mistake (an unknown queue, say): said as such
                raise cause from None
            raise
        grant = Grant.from_dict(answer)
        with self._lock:
            self._grant = grant
        return grant

    def _beat(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            try:
                self.report()
            except Exception:  # the controller's own calls say what is wrong; the beat tries again
                pass
