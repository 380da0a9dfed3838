"""Controller -> observers: the run summary's events, and the callbacks that watch a job."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from .reports import REPORTS, Report
from .segment import HookRef


class EventKind(enum.StrEnum):
    """The run summary's events that the controller makes itself; reports with `EVENT` are the others."""

    HOST_LOST = "host_lost"
    HOST_ADDED = "host_added"
    REPLAN = "replan"
    # On a shared cluster (the fleet scheduler's decisions, each with its reason):
    QUEUED = "queued"  # waiting for hosts, at the start or suspended
    SHRINK = "shrink"  # asked to give hosts back: stops at the next step boundary
    GROW = "grow"  # more hosts reserved for it: grows at the next checkpoint boundary
    SUSPEND = "suspend"  # every host asked back: commits the step reached and queues
    ADMITTED = "admitted"  # hosts granted after waiting
    # The health loop's (control/health.py), each with the host, the evidence and the action:
    STRAGGLER = "straggler"  # a host slower than its peers: excluded, or warned of
    HANG = "hang"  # a step that does not finish while every host answers
    CORRUPTION = "corruption"  # replicas that should be equal are not, or a loss spike


EVENT_KINDS = (*EventKind, *(kind for kind, cls in REPORTS.items() if cls.EVENT))


@dataclasses.dataclass(frozen=True)
class Event:
    """One entry of the run summary's events: `at` in seconds since the job began."""

    kind: str
    step: int | None
    at: float
    seconds: float = 0.0
    fields: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "kind": str(self.kind),
            "step": self.step,
            "at": round(self.at, 4),
            "seconds": round(self.seconds, 4),
            **self.fields,
        }


class ControllerCallback:
    """What watches a job. Each method gets a read-only view of the controller
    (`control.view.ControllerView`: the job, its state, segments, group and clocks), never the
    controller itself; callbacks are called in the order given but need none among them."""

    def on_attach(self, view) -> None:
        """The controller is made (its clocks and job are there to read)."""

    def on_start(self, view) -> None:
        """`run()` begins."""

    def on_state(self, view, previous, state) -> None:
        """A transition from `previous` to `state` (state.py) has been made."""

    def on_report(self, view, host: int, report: Report, speaker: bool) -> None:
        """A host's report, before the controller acts on it (`view.step_reached` is still the
        step before a step report's). `speaker`: the host that speaks for the group (SPMD: every
        host reports the same steps)."""

    def on_event(self, view, event: Event) -> None:
        """An event of the run summary."""

    def on_recovered(self, view, seconds: float) -> None:
        """The first step after a host loss is done, `seconds` after the loss was detected."""

    def on_warning(self, view, text: str) -> None:
        """Something went wrong that the job survives (a plan made ahead failed, hosts could not be placed)."""

    def on_poll(self, view) -> None:
        """A training group was polled and is still training."""

    def on_end(self, view) -> None:
        """`run()` ends, in any way."""

    # -- where fault injection reaches in (orchestrator/chaos/); nothing elsewhere uses these ---------
    def test_hooks(self, view, hosts: int) -> dict[int, HookRef]:
        """Hooks to attach to hosts of a group about to start: host index -> hook."""
        return {}

    def lost_at(self, node_ids: Sequence[str]) -> float | None:
        """When the loss of these nodes was caused (controller clock), where a callback caused it."""
        return None
