"""What the controller asks of every cluster (`Cluster`), where a new group's actors go
(`Placement`), and what fault injection asks of a cluster whose hosts it may kill (`EmulatedHosts`).

The clusters: `cluster.LocalCluster` (embedded), `cluster.RayCluster` (a running one of its own),
`fleet.cluster.FleetCluster` (the share of a running one that the fleet scheduler grants a job),
and `slices.SlicedCluster` (any of them seen through its slices). None forwards to another by
attribute: each says what it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a new group's host actors go: on `nodes`, in process order (whole slices,
    slice-major), or into `reservations` (placement groups the fleet scheduler reserved for the
    job, one per host); neither: on any live hosts."""

    nodes: Sequence[str] | None = None
    reservations: Sequence | None = None


class Cluster(Protocol):
    """What the controller asks of a cluster. The defaults are a flat cluster's that keeps nothing
    from the job: every host its own, any live host usable."""

    def alive_hosts(self) -> list[str]:
        """The hosts a group may run on now, in the order a group takes them (node ids)."""
        ...

    def live_hosts(self) -> list[str]:
        """Every live host of the job, those no group may run on included (a broken slice's
        survivors: their keepers still hold peer snapshots)."""
        return self.alive_hosts()

    def slice_of(self) -> dict[str, str]:
        """Each of the job's live hosts' slice (node id -> name); {} where the hosts say none."""
        return {}

    def loss_unit(self, hosts: int) -> int:
        """Hosts a loss takes at once from a group of `hosts`: a slice's where slices fail whole,
        else 1."""
        return 1

    def host_env(self) -> dict[str, str]:
        """Environment variables every host process needs, set before it imports JAX."""
        return {}

    def placement(self, hosts: int) -> Placement:
        """Where a group of `hosts` goes."""
        return Placement()

    def placement_on(self, nodes: Sequence[str]) -> Placement:
        """Where a group on exactly `nodes` goes."""
        return Placement(nodes=list(nodes))

    def cluster_hosts(self) -> int:
        """Every live host of the cluster, other jobs' and idle ones included; 0 where the job
        sees only its own (a cluster of its own)."""
        return 0

    def shutdown(self) -> None: ...


class EmulatedHosts(Protocol):
    """A cluster whose hosts can be killed, stopped and added: the embedded one (fault injection)."""

    def kill_host(self, node_id: str) -> None: ...

    def freeze_process(self, pid: int) -> None: ...

    def add_host(self) -> None: ...
