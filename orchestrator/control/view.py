"""What a callback or a policy reads of a job: a read-only view of its controller.

Callbacks (`protocol.ControllerCallback`) and scaling policies get a `ControllerView`, never the
controller: they can read the job's state, its segments, the hosts of its group and the clocks,
and change nothing the controller decides with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class GroupView:
    """The training group's hosts: `node_ids` and `places` (each host's ip, port, pid) in
    process order."""

    size: int
    node_ids: tuple[str, ...]
    places: tuple[dict, ...]
    progress: tuple[dict | None, ...] = ()  # where each host's loop was at the latest poll (`worker.progress`)


def _read(name: str, doc: str | None = None) -> property:
    """A property that reads the controller's attribute `name`."""
    return property(lambda self: getattr(self._c, name), doc=doc)


class ControllerView:
    def __init__(self, controller):
        self._c = controller

    job = _read("job")
    config = _read("config")
    cluster = _read("cluster", "The `hosts.interface.Cluster` the job runs on.")
    state = _read("state")
    phase = _read("phase")
    step_reached = _read("step_reached", "The highest step known done.")
    segment = _read("segment", "The newest segment, or None before the first.")
    started_wall = _read("started_wall")

    @property
    def segments(self) -> Sequence:
        return tuple(self._c.segments)

    @property
    def group(self) -> GroupView | None:
        group = self._c.group
        if group is None:
            return None
        return GroupView(group.size, tuple(group.node_ids), tuple(group.places), tuple(getattr(group, "progress", ())))

    def host_stacks(self) -> list[str]:
        """Every host's threads' stacks, in process order ("" where a host did not answer): a
        read of the hosts, for a callback that must say where a hung group was."""
        group = self._c.group
        return group.stacks() if group is not None and hasattr(group, "stacks") else []

    @property
    def recent_step_seconds(self) -> tuple[float, ...]:
        """The training group's latest step times (its first step, which waits for its peers, left out)."""
        return tuple(self._c.step_seconds)

    def plan_ready(self, devices: int) -> bool:
        """Whether a group on `devices` would start at once (plan made, programs compiled ahead)."""
        return self._c.plans.ready(devices)

    def scaling_status(self) -> str:
        """Why the job runs on fewer hosts than it could, where its scaling policy knows."""
        return self._c.scaling.status()

    def clock(self) -> float:
        return self._c.clock()

    def wall(self) -> float:
        return self._c.wall()

    def now(self) -> float:
        """Seconds since the job began, on the controller's clock (events are stamped with it)."""
        return self._c.now()
