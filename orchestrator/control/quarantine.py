"""A cluster without the hosts the health loop set aside."""

from __future__ import annotations

from collections.abc import Sequence

from ..hosts.interface import Cluster, Placement


class Quarantine(Cluster):
    """`cluster` without the hosts set aside: a group is placed on the others. A host set aside
    comes back (`release`) once it passes its probe."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.excluded: dict[str, str] = {}  # node -> why

    def exclude(self, node: str, why: str) -> None:
        self.excluded[node] = why

    def release(self, node: str) -> None:
        self.excluded.pop(node, None)

    def alive_hosts(self) -> list[str]:
        return [n for n in self.cluster.alive_hosts() if n not in self.excluded]

    def live_hosts(self) -> list[str]:
        return self.cluster.live_hosts()  # (an excluded host's keeper still holds its snapshots)

    def slice_of(self) -> dict[str, str]:
        return self.cluster.slice_of()

    def loss_unit(self, hosts: int) -> int:
        return self.cluster.loss_unit(hosts)

    def host_env(self) -> dict[str, str]:
        return self.cluster.host_env()

    def placement(self, hosts: int) -> Placement:
        if not self.excluded:
            return self.cluster.placement(hosts)
        return self.cluster.placement_on(self.alive_hosts()[:hosts])

    def placement_on(self, nodes: Sequence[str]) -> Placement:
        return self.cluster.placement_on(nodes)

    def cluster_hosts(self) -> int:
        return self.cluster.cluster_hosts()

    def shutdown(self) -> None:
        self.cluster.shutdown()
