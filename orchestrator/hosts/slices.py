"""Slices: hosts that share a fast network (a TPU slice on ICI, a GPU NVLink domain), joined to
the other slices by a slower one, and the unit that fails together on TPUs.

Each host says its slice. On a Ray cluster: the node label `ray.io/tpu-slice-name` (Ray sets it
on Cloud TPU VMs), or the label `remesh.io/slice`, or a resource `remesh_slice_<NAME>` (what
`ray start --resources` or a KubeRay worker group can set anywhere). On the embedded cluster the
job file's `[hosts] hosts_per_slice` lays its hosts out, slice by slice, as resources.

`SlicedCluster` wraps a cluster so that the controller sees the hosts it may run on: on a profile
whose slices fail whole (TPU), only hosts of complete slices; ordered slice-major, as the plan's
devices are.
"""

from __future__ import annotations

import collections

import ray

from ..job.slices import SliceLayout
from ..protocol.fleet import HOST_RESOURCE
from .interface import Cluster, Placement

__all__ = ["SliceLayout", "SliceLayoutError", "SlicedCluster", "cluster_layout", "host_slices"]

SLICE_LABELS = ("ray.io/tpu-slice-name", "remesh.io/slice")
SLICE_RESOURCE = "remesh_slice_"


class SliceLayoutError(ValueError):
    """The cluster's hosts do not say their slices consistently."""


def host_slices(nodes: list[dict] | None = None) -> dict[str, str]:
    """Live hosts' slices (node id -> slice name), as the nodes say them; {} where no host says
    one (the cluster is flat). A host that says none while others do is an error naming the fix."""
    nodes = ray.nodes() if nodes is None else nodes
    hosts = [n for n in nodes if n["Alive"] and n["Resources"].get(HOST_RESOURCE)]
    said = {n["NodeID"]: _slice_of(n) for n in hosts}
    missing = [node for node, name in said.items() if name is None]
    if len(missing) == len(said):
        return {}
    if missing:
        raise SliceLayoutError(
            f"{len(missing)} of {len(said)} hosts say no slice (e.g. node {missing[0][:12]}): every host needs the "
            f"label {SLICE_LABELS[1]}=NAME (`ray start --labels`) or the resource {SLICE_RESOURCE}NAME "
            f'(`ray start --resources \'{{"{HOST_RESOURCE}": 1, "{SLICE_RESOURCE}0": 1}}\'`), or none of them'
        )
    return said


def cluster_layout(layout: SliceLayout, said: dict[str, str], explicit: bool) -> SliceLayout:
    """The job's slice layout on a cluster whose hosts say their slices (`said`): hosts per slice
    as the cluster has them where the job file leaves it to the profile (`explicit` False); a
    job file's that a slice of the cluster outgrows is an error naming the fix."""
    if not said:
        return layout
    name, most = max(collections.Counter(said.values()).items(), key=lambda kv: kv[1])
    if not explicit:
        return SliceLayout(most, layout.fails_by)
    if most > layout.hosts_per_slice:
        raise SliceLayoutError(
            f"the job file sets [hosts] hosts_per_slice = {layout.hosts_per_slice}, but slice {name!r} of the "
            f"cluster has {most} hosts: set it to {most}, or leave it out to take the cluster's slices"
        )
    return layout


def _slice_of(node: dict) -> str | None:
    labels = node.get("Labels") or {}
    for key in SLICE_LABELS:
        if labels.get(key):
            return str(labels[key])
    names = [r[len(SLICE_RESOURCE) :] for r in node["Resources"] if r.startswith(SLICE_RESOURCE)]
    return names[0] if names else None


class SlicedCluster(Cluster):
    """A cluster seen through its slices: `alive_hosts()` are the hosts a group may run on
    (`SliceLayout.usable`), slice-major; `live_hosts()` every live host (a broken slice's
    survivors still hold peer snapshots). It adds slices to the cluster it wraps and forwards
    nothing else: fault injection and the fleet's heartbeat are given the wrapped cluster."""

    def __init__(self, cluster: Cluster, layout: SliceLayout):
        self.cluster, self.layout = cluster, layout

    def slice_of(self) -> dict[str, str]:
        """Each of this job's live hosts' slice: as the wrapped cluster says (the embedded one
        lays its hosts out; a Ray cluster's hosts say theirs; a shared cluster's are those granted
        to this job); where none says one, every host its own slice or one slice of all."""
        said = self.cluster.slice_of()
        if said:
            return said
        per = self.layout.hosts_per_slice
        if per not in (None, 1):
            raise SliceLayoutError(
                f"the job sets {per} hosts per slice but the cluster's hosts say no slice: give every host the label "
                f'{SLICE_LABELS[1]}=NAME or the resource {SLICE_RESOURCE}NAME (README, "Slices")'
            )
        alive = self.cluster.alive_hosts()
        return {node: str(i) if per == 1 else "0" for i, node in enumerate(alive)}

    def alive_hosts(self) -> list[str]:
        return self.layout.usable(self.slice_of())

    def live_hosts(self) -> list[str]:
        return self.cluster.live_hosts()

    def loss_unit(self, hosts: int) -> int:
        if self.layout.fails_by != "slice":
            return 1
        return self.layout.hosts_per_slice or hosts  # no size said: the group is one slice

    def host_env(self) -> dict[str, str]:
        return self.cluster.host_env()

    def placement(self, hosts: int) -> Placement:
        return self.cluster.placement_on(self.alive_hosts()[:hosts])  # whole slices, slice-major

    def placement_on(self, nodes) -> Placement:
        return self.cluster.placement_on(nodes)

    def cluster_hosts(self) -> int:
        return self.cluster.cluster_hosts()

    def shutdown(self) -> None:
        self.cluster.shutdown()
