"""Policies make decisions; the controller only executes them.

A decision is a small frozen value. A scaling policy decides how many hosts to run on when a
group starts (`admit`) and whether to resize while one trains (`while_running`): `ScalingPolicy`
takes what a cluster of its own offers, `fleet_following.FleetFollowing` what the fleet scheduler
grants on a shared one. `FailurePolicy` decides what a failure means: resize onto the hosts left,
restart on the same hosts, or fail the job with a reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from ..protocol import EventKind


@dataclasses.dataclass(frozen=True)
class Continue:
    pass


@dataclasses.dataclass(frozen=True)
class Resize:
    hosts: int
    reason: str
    event: str | None = None  # what the run summary says of a resize decided while a group trains
    at_once: bool = False  # stop the group at its next step boundary, not its next checkpoint
    fields: dict = dataclasses.field(default_factory=dict)  # the event's evidence, beside hosts and reason


@dataclasses.dataclass(frozen=True)
class Evict:
    """The group cannot go on as it is (a step that never finishes): its processes are stopped and
    the job recovers as from the loss of `hosts` (indices in the group; () names none, and the
    group restarts on the same hosts)."""

    hosts: tuple[int, ...]
    reason: str
    event: str
    fields: dict = dataclasses.field(default_factory=dict)
    restore_at_most: int | None = None  # the newest step the state may be restored from (a corruption's)


@dataclasses.dataclass(frozen=True)
class Warn:
    """Nothing to change, something to say: an event (the health loop's, where it does not act)."""

    event: str
    reason: str
    fields: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Restart:
    hosts: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Fail:
    reason: str


@dataclasses.dataclass(frozen=True)
class Wait:
    """No hosts to start on yet (a shared cluster): the job queues, saying why."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Failure:
    """What the controller saw: hosts whose actors died, and whether their nodes are gone too."""

    hosts_in_group: int
    hosts_lost: int  # hosts whose node is dead
    processes_lost: int  # actors that died while their node lives on
    hosts_alive: int  # hosts the cluster offers now
    failures_in_a_row: int  # earlier failures since the job last got past the step it had reached


class Scaling(Protocol):
    """What the controller asks a scaling policy (`view`: a `control.view.ControllerView`)."""

    def attach(self, view) -> None:
        """The controller is made; `view` reads its job from now on."""

    def admit(self, view, wanted: int | None, since: float) -> Resize | Wait | Fail:
        """The hosts the next group starts on: `wanted` (a count settled before, by this policy or
        the failure policy), else as at a job's start. `since`: when the job began to wait for
        hosts (controller clock)."""
        ...

    def while_running(self, view, state, alive: Callable[[], list[str]]) -> Continue | Resize | Warn | Evict:
        """Whether the training group (`state`, a `Running`) should resize; `alive()`: the hosts
        the cluster offers now (a round trip to the cluster: asked only where it decides)."""
        ...

    def status(self) -> str:
        """Why the job runs on fewer hosts than it could, where the policy knows; else ""."""
        return ""

    def set_aside(self, node: str, why: str, probe: dict) -> bool:
        """The health loop set `node` aside (`why`); `probe`: how to probe it elsewhere
        (`hosts.probe.HostProbe.spec`). True where the policy hands it on (to a shared cluster's
        fleet, which probes it before any job gets it again); False: the job keeps it aside."""
        return False


@dataclasses.dataclass(frozen=True)
class ScalingPolicy(Scaling):
    """A cluster of the job's own: start on what it offers, up to `max_hosts`, and grow when it
    offers more."""

    min_hosts: int
    max_hosts: int

    def initial(self, available: int) -> Resize | Fail:
        if available < self.min_hosts:
            return Fail(f"the cluster offers {available} hosts, the job needs at least {self.min_hosts} (hosts.min)")
        return Resize(min(available, self.max_hosts), f"{available} hosts available at start")

    def on_progress(self, current: int, available: int) -> Continue | Resize:
        """Grow when the cluster offers more hosts than the job runs on (at the next checkpoint)."""
        target = min(available, self.max_hosts)
        if target > current:
            return Resize(target, f"{available - current} more host(s) available", EventKind.HOST_ADDED)
        return Continue()

    def admit(self, view, wanted: int | None, since: float) -> Resize | Wait | Fail:
        """Never more than the cluster offers now."""
        available = len(view.cluster.alive_hosts())
        decision = self.initial(available) if wanted is None else Resize(wanted, "")
        if isinstance(decision, Fail):
            return decision
        return Resize(min(decision.hosts, available), decision.reason)  # hosts may have gone since

    def while_running(self, view, state, alive: Callable[[], list[str]]) -> Continue | Resize:
        if state.resize:
            return Continue()
        return self.on_progress(state.target, len(alive()))


@dataclasses.dataclass(frozen=True)
class FailurePolicy:
    min_hosts: int
    max_hosts: int
    # Failures in a row, with no step gained between them: a crash loop. A long job on many hosts
    # sees failures all along; only failures that stop it from getting anywhere end it.
    max_failures: int = 10
    max_stalled_segments: int = 3  # segments in a row that end without completing a step

    def on_segment_end(self, stalled: int, step: int) -> Continue | Fail:
        """A segment ended before the job's last step (a resize, or a group that stopped early);
        `stalled` counts such segments in a row that completed no new step."""
        if stalled >= self.max_stalled_segments:
            return Fail(
                f"{stalled} segments in a row ended without completing a step after step {step} "
                f"(max_stalled_segments={self.max_stalled_segments}): the hosts stop before training; "
                "see their output above"
            )
        return Continue()

    def on_failure(self, failure: Failure) -> Resize | Restart | Fail:
        if failure.failures_in_a_row >= self.max_failures:
            return Fail(
                f"{failure.failures_in_a_row + 1} failures in a row, no step gained between them "
                f"(more than max_failures={self.max_failures})"
            )
        available = min(failure.hosts_alive, self.max_hosts)
        if available < self.min_hosts:
            return Fail(f"{failure.hosts_alive} hosts left, the job needs at least {self.min_hosts} (hosts.min)")
        if failure.hosts_lost == 0:
            # Only processes died (or none: the health loop stopped the group); their hosts are
            # still there, so run on the same hosts again.
            why = (f"{failure.processes_lost} process(es) died on live hosts" if failure.processes_lost
                   else "the group was stopped, its hosts live")  # fmt: skip
            return Restart(min(failure.hosts_in_group, available), why)
        return Resize(available, f"{failure.hosts_lost} host(s) lost")
