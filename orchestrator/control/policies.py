"""Policies make decisions; the controller only executes them.

A decision is a small frozen value. `ScalingPolicy` decides how many hosts to run on at start and
when to grow; `FailurePolicy` decides what a failure means: resize onto the hosts left, restart on
the same hosts, or fail the job with a reason.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Continue:
    pass


@dataclasses.dataclass(frozen=True)
class Resize:
    hosts: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Restart:
    hosts: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Fail:
    reason: str


Decision = Continue | Resize | Restart | Fail


@dataclasses.dataclass(frozen=True)
class Failure:
    """What the controller saw: hosts whose actors died, and whether their nodes are gone too."""

    hosts_in_group: int
    hosts_lost: int  # hosts whose node is dead
    processes_lost: int  # actors that died while their node lives on
    hosts_alive: int  # hosts the cluster offers now
    failures_in_a_row: int  # earlier failures since the job last got past the step it had reached


@dataclasses.dataclass(frozen=True)
class ScalingPolicy:
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
            return Resize(target, f"{available - current} more host(s) available")
        return Continue()


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
            # Only processes died; their hosts are still there, so run on the same hosts again.
            return Restart(
                min(failure.hosts_in_group, available), f"{failure.processes_lost} process(es) died on live hosts"
            )
        return Resize(available, f"{failure.hosts_lost} host(s) lost")
