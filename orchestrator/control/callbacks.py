"""What watches a job is a callback: the controller tells its callbacks of every transition, host
report, event and poll, and they keep the run summary, the goodput ledger, the fleet store, Ray's
metrics and the terminal (telemetry/), or inject faults (orchestrator/chaos/). Each reads the job
through a `ControllerView`; none of them changes what the controller decides.

Example: a callback that prints every host loss.

    class Losses(ControllerCallback):
        def on_event(self, view, event):
            if event.kind == EventKind.HOST_LOST:
                print(f"lost hosts {event.fields['hosts']} at step {event.step}")

    JobController(job, cluster, plans=plans, callbacks=[Losses()])
"""

from __future__ import annotations

from collections.abc import Sequence

from ..protocol import ControllerCallback, Event, HookRef, Report

__all__ = ["Callbacks", "ControllerCallback"]


class Callbacks(ControllerCallback):
    """Several callbacks as one, called in the order given."""

    def __init__(self, callbacks: Sequence[ControllerCallback]):
        self.callbacks = list(callbacks)

    def on_attach(self, view) -> None:
        for c in self.callbacks:
            c.on_attach(view)

    def on_start(self, view) -> None:
        for c in self.callbacks:
            c.on_start(view)

    def on_state(self, view, previous, state) -> None:
        for c in self.callbacks:
            c.on_state(view, previous, state)

    def on_report(self, view, host: int, report: Report, speaker: bool) -> None:
        for c in self.callbacks:
            c.on_report(view, host, report, speaker)

    def on_event(self, view, event: Event) -> None:
        for c in self.callbacks:
            c.on_event(view, event)

    def on_recovered(self, view, seconds: float) -> None:
        for c in self.callbacks:
            c.on_recovered(view, seconds)

    def on_warning(self, view, text: str) -> None:
        for c in self.callbacks:
            c.on_warning(view, text)

    def on_poll(self, view) -> None:
        for c in self.callbacks:
            c.on_poll(view)

    def on_end(self, view) -> None:
        for c in self.callbacks:
            c.on_end(view)

    def test_hooks(self, view, hosts: int) -> dict[int, HookRef]:
        hooks: dict[int, HookRef] = {}
        for c in self.callbacks:
            hooks.update(c.test_hooks(view, hosts))
        return hooks

    def lost_at(self, node_ids: Sequence[str]) -> float | None:
        times = [t for t in (c.lost_at(node_ids) for c in self.callbacks) if t is not None]
        return min(times) if times else None
