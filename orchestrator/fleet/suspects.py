"""Hosts a job's health loop set aside and handed back to the fleet marked suspect: the scheduler
holds each (the job's reservation of it becomes the scheduler's, so no job gets it) and keeps it
on probation (`hosts.probe.Probation`: the same device work on it and on another host, after
`ProbeConfig.first_after_s`, then at doubling waits); it is free again once its probes pass
(`ProbeConfig.passes` in a row).
"""

from __future__ import annotations

import dataclasses

from ..hosts.probe import HostProbe, Probation, ProbeConfig


@dataclasses.dataclass
class _Held:
    why: str
    run: str  # the job that set it aside
    since: float
    reservation: object  # the placement group that holds it, the job's before
    probe: HostProbe
    probation: Probation


class Suspects:
    """The suspect hosts of a cluster, by node id."""

    def __init__(self, config: ProbeConfig):
        self.config = config
        self._held: dict[str, _Held] = {}

    def __contains__(self, node: str) -> bool:
        return node in self._held

    def __iter__(self):
        return iter(list(self._held))

    def hold(self, node: str, run: str, said: dict, reservation, now: float) -> None:
        """`node`, handed back by `run` with `said` ("why", and how to probe it: "env", "hook",
        `HostProbe.spec`), held by `reservation` from now on."""
        probe = HostProbe.for_node(node, said)
        self._held[node] = _Held(said.get("why", ""), run, now, reservation, probe,
                                 Probation.begin(node, self.config, now))  # fmt: skip

    def probe(self, alive: set[str], now: float) -> None:
        """Each suspect due is probed beside another live host that is not suspect, without
        waiting (a later call reads it); one that passed, or whose host is gone, is let go."""
        peers = sorted(alive - set(self._held))
        for node, h in list(self._held.items()):
            if node not in alive or h.probation.poll(h.probe, now, peers[0] if peers else None):
                _let_go(self._held.pop(node))

    def report(self, now: float) -> dict:
        """node id -> why, by which run, how long ago, and each probe's time over its peer's."""
        return {node: {"why": h.why, "run": h.run, "seconds": round(now - h.since, 1),
                       "probe_ratios": h.probation.ratios} for node, h in self._held.items()}  # fmt: skip


def _let_go(h: _Held) -> None:
    import ray

    h.probation.stop()
    ray.util.remove_placement_group(h.reservation)
