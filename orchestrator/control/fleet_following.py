"""Following the fleet scheduler's grant on a shared cluster: a scaling policy.

The scheduler (fleet/scheduler.py) decides how many hosts each job holds; this policy turns its
grant into the controller's decisions, as Ray Train v2's scaling policies do: start on the hosts
granted and placed (or wait, with the reason), shrink at the next step boundary when fewer are
granted, suspend when none are, and grow at the next checkpoint boundary once more are placed. It
gives back hosts the job can no longer use, and it hands the fleet link the job's progress (what
a shrink would cost now, whether growing would pay), which every heartbeat then carries.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from ..protocol import EventKind
from ..protocol.fleet import FleetProgress, Grant
from .policies import Continue, Resize, Wait


class FleetFollowing:
    """A `policies.Scaling`. `fleet`: the job's link to the scheduler (`fleet.cluster.FleetCluster`, or any object
    with its `report`, `release`, `registration` and `grant`). `reserve_wait_s`: how long to wait
    for granted hosts another job has not given back yet before starting on fewer (at least
    `min_hosts`)."""

    def __init__(self, min_hosts: int, fleet, reserve_wait_s: float = 30.0):
        self.min_hosts, self.fleet, self.reserve_wait_s = min_hosts, fleet, reserve_wait_s
        self._suspect: dict[str, dict] = {}  # node -> why and how to probe it, until given back

    def set_aside(self, node: str, why: str, probe: dict) -> bool:
        """A host the health loop set aside goes back to the fleet marked suspect: no job gets it
        until it passes the fleet's probe."""
        self._suspect[node] = {"why": why, **probe}
        return True

    def attach(self, view) -> None:
        self.fleet.attach(lambda: self.progress(view))

    def admit(self, view, wanted: int | None, since: float) -> Resize | Wait:
        """The hosts granted and placed, giving back any beyond the grant; or the wait, with its
        reason. Granted hosts that another job still holds are waited for `reserve_wait_s`, then
        the job starts on those it has (at least `min_hosts`); `wanted`: a count already settled
        for (after that wait, or by the failure policy after a host loss), taken if that many are
        placed."""
        grant, alive = self._usable(view)
        if grant.target == 0:
            return Wait(grant.reason or "waiting for hosts")
        if len(alive) >= grant.target:
            return Resize(grant.target, "granted")
        if wanted is not None and self.min_hosts <= wanted <= len(alive):
            return Resize(wanted, "granted")
        if len(alive) >= self.min_hosts and view.clock() - since >= self.reserve_wait_s:
            return Resize(len(alive), f"{len(alive)} of the {grant.target} granted placed")
        return Wait(f"waiting for hosts: {len(alive)} of the {grant.target} granted are free, the rest still held "
                    "by jobs that are giving them back")  # fmt: skip

    def _usable(self, view) -> tuple[Grant, list[str]]:
        """The grant, and the hosts the job may use of it, having given back the rest: hosts of a
        slice that lost one (no use to a group) and those beyond the grant (shrunk or suspended)."""
        grant = self.fleet.report()
        alive = view.cluster.alive_hosts()
        stranded = sorted(set(view.cluster.live_hosts()) - set(alive))
        if stranded:
            grant = self.fleet.release(stranded, {n: self._suspect.pop(n) for n in stranded if n in self._suspect})
        if len(alive) > grant.target:
            grant = self.fleet.release(alive[grant.target :])
            alive = alive[: grant.target]
        return grant, alive

    def while_running(self, view, state, alive: Callable[[], list[str]]) -> Continue | Resize:
        """Fewer hosts granted: stop at the next step boundary (the step reached is committed: at
        most the step in flight is computed again), also while a grow waits for its boundary;
        none: suspend likewise; more, once placed: grow at the next checkpoint boundary."""
        grant = self.fleet.report()
        if grant.target < state.target:
            event = EventKind.SUSPEND if grant.target == 0 else EventKind.SHRINK
            return Resize(grant.target, grant.reason, event, at_once=True)
        if not state.resize and state.target < grant.target <= len(alive()):  # placed: asked only then
            return Resize(grant.target, f"{grant.target - state.target} more host(s) granted", EventKind.GROW)
        return Continue()

    def status(self) -> str:
        return self.fleet.grant.reason

    def progress(self, view) -> FleetProgress:
        """What a shrink would cost the job now: steps since its last snapshot or commit, and
        whether a group one host smaller would start at once (plan and programs ready); and
        whether growing to its maximum would pay for the resize (`grows`)."""
        segment, job = view.segment, view.job
        every = (segment.snapshot_every if segment else 0) or job.checkpoint.every
        hosts = segment.hosts if segment else 0
        smaller = hosts > 1 and view.plan_ready((hosts - 1) * job.hosts.devices_per_host)
        return FleetProgress(view.step_reached % every, smaller, self.grows(view))

    def grows(self, view) -> bool:
        """Whether the steps left, on the most hosts the job takes, would save more time than a
        resize costs: the last group's start (from planning to its first step) is the estimate
        of the next, and steps are taken to shorten in proportion to hosts. Until a group has
        stepped, nothing is known against growing."""
        segment, times = view.segment, view.recent_step_seconds
        if segment is None or segment.first_step_at is None or not times:
            return True
        resize = segment.first_step_at - segment.started_at
        step = statistics.median(times)
        top = self.fleet.registration.max_hosts  # the job file's, or less (`--hosts`)
        saved = (view.job.steps - view.step_reached) * step * (1 - segment.hosts / top)
        return saved > resize
