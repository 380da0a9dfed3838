"""Mechanism for one host group: one Ray actor per host, gang-scheduled with a placement group,
or taken from a pool of standby actors started ahead (standby.py).

The group is made for one segment and thrown away after it: a `jax.distributed` group cannot be
resized in place, so every resize or failure starts a new group with a new coordinator. What can
be ready before that, is: a standby actor per host has its process up and JAX and the program
imported, so a recovery takes actors instead of spawning processes.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..protocol import Report, SegmentSpec, from_dict
from ..protocol.fleet import HOST_RESOURCE
from .actor import actor_cls
from .standby import StandbyPool

# What Ray raises for an actor whose host is gone: it died there, or it was placed on a node (or
# in a placement group) that went away before it started, which Ray reports as unschedulable.
_HOST_GONE = (
    ray.exceptions.RayActorError,
    ray.exceptions.ActorUnschedulableError,
    ray.exceptions.ActorPlacementGroupRemoved,
)


class HostsUnavailableError(RuntimeError):
    pass


class HostsLostError(RuntimeError):
    """Actors of the group died or stopped answering."""

    def __init__(
        self,
        indices: Sequence[int],
        node_ids: Sequence[str],
        detail: str,
        survivors: Sequence[tuple[int, HostStatus]] = (),
    ):
        super().__init__(f"hosts {list(indices)} lost: {detail}")
        self.indices = list(indices)
        self.node_ids = list(node_ids)
        # What the hosts that did answer reported in the same poll: steps they finished before
        # the loss, which the checkpoint restored next may already include.
        self.survivors = list(survivors)


class SegmentFailedError(RuntimeError):
    """The training code raised on a host (a bug, not a lost host): resizing will not help."""


@dataclasses.dataclass(frozen=True)
class HostStatus:
    """What a host answered a poll: its reports since the last poll, and whether its segment is
    over (`error`: the traceback, where the program raised)."""

    reports: tuple[Report, ...]
    done: bool
    error: str | None
    progress: dict | None = None  # where its loop is: {"step", "where", "at"} (`worker.progress`)

    @classmethod
    def from_wire(cls, answer: dict) -> HostStatus:
        reports = tuple(from_dict(r) for r in answer["reports"])
        return cls(reports, answer["done"], answer["error"], answer.get("progress"))


@dataclasses.dataclass(frozen=True)
class HostGroupConfig:
    env_vars: dict = dataclasses.field(default_factory=dict)  # the host actors' environment
    schedule_timeout_s: float = 60.0
    # A poll unanswered this long counts as a lost host. Dead actors are reported by Ray within a
    # second; this catches a host that hangs (stopped, swapping, a wedged driver). A host process
    # answers from a thread of its own, and JAX releases the GIL while it compiles or waits in
    # a collective, so a live host answers within milliseconds even while a group forms.
    poll_timeout_s: float = 10.0


def alive_hosts() -> list[str]:
    """Node ids of the live nodes that offer a host (the `remesh_host` resource)."""
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(HOST_RESOURCE))


class HostGroup:
    def __init__(
        self, hosts: int, config: HostGroupConfig, standby: StandbyPool | None = None, placements=None, nodes=None
    ):
        """`placements`: one placement group per host, reserved for this job by the fleet scheduler
        (fleet/cluster.py): the actors go there; None: a placement group of its own for the group.
        `nodes`: the hosts to run on, in process order (slices: whole ones, slice-major); None:
        any `hosts` live ones."""
        self.size = hosts
        self.config = config
        self._pg = None
        self.progress: tuple[dict | None, ...] = (None,) * hosts  # each host's loop, at the latest poll
        if placements is not None:
            self.actors = [self._actor(pg, 0) for pg in placements[:hosts]]
        elif nodes is not None:
            self.actors = self._on_nodes(list(nodes)[:hosts], standby)
        elif standby is not None:
            self.actors = self._from_standby(hosts, standby)
        else:
            self.actors = self._placed(hosts)
        try:
            self.places = ray.get([a.where.remote() for a in self.actors], timeout=config.schedule_timeout_s)
        except (*_HOST_GONE, ray.exceptions.GetTimeoutError) as e:
            self.shutdown()
            said = str(e).strip().partition("\n")[0]  # Ray's first line says why; the rest is the actor's record
            raise HostsUnavailableError(f"a host actor did not start: {type(e).__name__}: {said}") from e
        self.node_ids = [p["node_id"] for p in self.places]

    def _placed(self, hosts: int) -> list:
        """New actors, gang-scheduled one per host by a placement group."""
        config = self.config
        self._pg = placement_group([{HOST_RESOURCE: 1}] * hosts, strategy="STRICT_SPREAD")
        if not self._ready(self._pg.ready(), config.schedule_timeout_s):
            remove_placement_group(self._pg)
            raise HostsUnavailableError(f"could not place {hosts} hosts within {config.schedule_timeout_s:.0f} s")
        return [self._actor(self._pg, i) for i in range(hosts)]

    def _actor(self, pg, bundle: int):
        return (
            actor_cls()
            .options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
                runtime_env={"env_vars": dict(self.config.env_vars)},
            )
            .remote()
        )

    def _from_standby(self, hosts: int, standby: StandbyPool) -> list:
        """Standby actors on `hosts` live nodes; where a node has none, one started there now."""
        alive = alive_hosts()
        if len(alive) < hosts:
            raise HostsUnavailableError(f"{len(alive)} hosts are alive, {hosts} were asked for")
        taken = standby.take(hosts, alive)
        missing = [n for n in alive if n not in taken][: hosts - len(taken)]
        standby.refill(missing, self.config.env_vars)
        taken.update(standby.take(len(missing), missing))
        return list(taken.values())

    def _on_nodes(self, nodes: list[str], standby: StandbyPool | None) -> list:
        """An actor on each of `nodes`, in that order: a standby one where there is one."""
        taken = standby.take_on(nodes) if standby is not None else {}
        return [taken.get(n) or self._pinned(n) for n in nodes]

    def _pinned(self, node: str):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return (
            actor_cls()
            .options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                runtime_env={"env_vars": dict(self.config.env_vars)},
            )
            .remote()
        )

    @staticmethod
    def _ready(ref, timeout: float) -> bool:
        ready, _ = ray.wait([ref], timeout=timeout)
        return bool(ready)

    @property
    def coordinator(self) -> str:
        return f"{self.places[0]['ip']}:{self.places[0]['port']}"

    def start(
        self,
        spec_for: Callable[[int, str], SegmentSpec],
        snapshots: Sequence | None = None,
        executables: dict | None = None,
    ) -> None:
        """`snapshots`: one `keepers.Keepers.placements` entry per host, or None (no peer snapshots);
        `executables`: compiled ahead for this group's plan, or None (pickled, and put in the object store
        once, for every host). Raises HostsLostError if a host died since the group was made
        (its node killed before Ray noticed, say)."""
        # Pickled here and loaded by the segment: unpickled as an argument, its tree definitions
        # would import the program's libraries while the actor may still be importing them.
        shared = ray.put(pickle.dumps(executables)) if executables else None
        refs = [
            a.start.remote(spec_for(i, self.coordinator).to_json(), snapshots[i] if snapshots else None, shared)
            for i, a in enumerate(self.actors)
        ]
        self._answers(refs, "as the group started")

    def poll(self) -> list[HostStatus]:
        answered = self._answers([a.poll.remote() for a in self.actors], "", HostStatus.from_wire)
        statuses = [s for _, s in answered]
        self.progress = tuple(s.progress for s in statuses)
        for i, s in enumerate(statuses):
            if s.error:
                raise SegmentFailedError(f"host {i} failed:\n{s.error}")
        return statuses

    def _answers(self, refs: list, when: str, answer: Callable = lambda a: a) -> list[tuple[int, object]]:
        """(host index, `answer(what it returned)`) of every host, waiting at most `poll_timeout_s`
        for all; raises HostsLostError (with what the others answered) if a host died or did not
        answer."""
        timeout = self.config.poll_timeout_s
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        answered, lost, details = [], [], []
        for i, ref in enumerate(refs):
            if ref not in ready:
                lost.append(i)
                details.append(f"host {i} did not answer within {timeout:.0f} s {when}".rstrip())
                continue
            try:
                answered.append((i, answer(ray.get(ref))))
            except _HOST_GONE as e:
                lost.append(i)
                details.append(f"host {i}: {type(e).__name__} {when}".rstrip())
        if lost:
            raise HostsLostError(lost, [self.node_ids[i] for i in lost], "; ".join(details), answered)
        return answered

    def stacks(self, timeout_s: float = 5.0) -> list[str]:
        """Every host's threads' stacks, in process order ("" for a host that did not answer)."""
        refs = [a.stacks.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref) if ref in ready else "")
            except _HOST_GONE:
                out.append("")
        return out

    def compile_ahead(self, plan_json: str) -> None:
        """Have process 0 compile a smaller mesh's plan beside training (worker.compile.compile_ahead);
        its report carries the executables."""
        self.actors[0].compile_ahead.remote(plan_json)

    def request_stop(self, now: bool = False) -> None:
        # Only process 0's flag is read (worker.StopAgreement broadcasts it), but asking every
        # host costs nothing and survives a change of that rule.
        for a in self.actors:
            a.request_stop.remote(now)

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        if self._pg is not None:
            remove_placement_group(self._pg)
