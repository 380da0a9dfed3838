"""The job controller: a state machine that executes the decisions of its policies.

`step()` performs exactly one transition (in Running: one poll of the hosts), so a test can drive
it one move at a time; `run()` loops until a terminal state. The states and the transitions
between them are in state.py, each state carrying its own data. The controller only decides and
acts: everything that watches a job (the run summary, the goodput ledger, the fleet store, Ray's
metrics, the terminal, fault injection) is a callback (callbacks.py). Clocks, the poll interval,
the planner and the host-group class are parameters. Callbacks and policies read the job through a
`ControllerView`; the cluster is any `hosts.interface.Cluster`, and whether the job follows a
fleet scheduler's grant or takes what its own cluster offers is its scaling policy's business.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence

from ..hosts.group import HostGroup, HostGroupConfig, HostsLostError, HostsUnavailableError, SegmentFailedError
from ..hosts.interface import Cluster
from ..job.jobfile import JobSpec
from ..protocol import Compile, CompileAhead, Event, EventKind, Report, Restore, Step
from . import policies
from .ahead import Ahead
from .callbacks import Callbacks, ControllerCallback
from .losses import read_loss
from .planning import PlanCache
from .specs import GroupSpecs, slice_ids
from .state import (
    Failed,
    Finished,
    Phase,
    Planning,
    Queued,
    Recovery,
    Running,
    Segment,
    Starting,
    State,
    StopOutcome,
    Stopped,
    Stopping,
)
from .view import ControllerView


class JobStopped(BaseException):
    """Raised into the controller's loop when the job must stop at once (a signal while no group
    trains, or a second signal). A BaseException, like KeyboardInterrupt, so that no `except
    Exception` on the way swallows it."""


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    poll_interval_s: float = 0.1
    host_check_interval_s: float = 1.0  # how often to ask the cluster for new hosts
    compilation_cache: str | None = None
    stop_grace_s: float = 20.0  # after a stop request, how long hosts get to save the step reached
    # A preemption notice: when this file appears (a Kubernetes preStop hook, a spot-instance
    # watcher), the job stops as on SIGTERM; the file is removed, so a re-run trains on.
    stop_file: str | None = None
    env_vars: dict = dataclasses.field(default_factory=dict)


class JobController:
    def __init__(
        self,
        job: JobSpec,
        cluster: Cluster,
        *,
        plans: PlanCache,
        config: ControllerConfig = ControllerConfig(),
        callbacks: Sequence[ControllerCallback] = (),
        scaling: policies.Scaling | None = None,
        failure: policies.FailurePolicy | None = None,
        group_cls=HostGroup,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        wall: Callable[[], float] = time.time,
        model_flops: float | None = None,
        committed: Callable[[], int] = lambda: 0,
        snapshots=None,
        standby=None,
    ):
        """`committed`: the newest committed checkpoint step (a re-run of a finished job ends at once).
        `snapshots`: the peer snapshots' keepers (`hosts.keepers.Keepers`); None: restores read the disk.
        `standby`: a `hosts.standby.StandbyPool` the groups take their actors from; None: each group spawns."""
        self.job, self.cluster, self.plans, self.config = job, cluster, plans, config
        self.scaling = scaling or policies.ScalingPolicy(job.hosts.min, job.hosts.max)
        self.failure = failure or policies.FailurePolicy(job.hosts.min, job.hosts.max)
        self.group_cls, self.clock, self.sleep, self.wall = group_cls, clock, sleep, wall
        self.model_flops = model_flops  # of one step, for MFU; None: each host counts it
        self.committed, self.snapshots, self.standby = committed, snapshots, standby
        self.callbacks = Callbacks(callbacks)
        self.view = ControllerView(self)
        self.state: State = Planning()
        self.step_reached = 0  # the highest step known done: reported, or restored (a resumed run starts there)
        self.segments: list[Segment] = []
        self.started_wall, self._t0 = wall(), clock()
        self.group: HostGroup | None = None
        self._stop_request: str | None = None  # a stop asked for (a signal), not yet begun
        # This group's latest step times: a median of 9 rides out a slow step or two (a save, a
        # collection) and still follows a change of pace within a few steps.
        self.step_seconds: collections.deque[float] = collections.deque(maxlen=9)
        self._shrunk_at: int | None = None  # the step reached when the scaling policy last shrank the job
        self._hosts_checked_at = 0.0  # when the cluster was last asked for hosts while a group trains
        # The reports that change the controller's own data; every report goes to the callbacks.
        self._handlers = {
            Step: self._stepped,
            Restore: self._restored,
            Compile: self._compiled,
            CompileAhead: self.plans.compiled_ahead,
        }
        self.ahead = Ahead(job, cluster, plans, standby, self._host_env)
        self.scaling.attach(self.view)
        self.callbacks.on_attach(self.view)

    @property
    def phase(self) -> Phase:
        return self.state.phase

    @property
    def segment(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def now(self) -> float:
        """Seconds since the job began, on the controller's clock (events are stamped with it)."""
        return self.clock() - self._t0

    # -- the state machine -------------------------------------------------------------------
    def step(self) -> Phase:
        state = self.state
        if self._stop_request and isinstance(state, Running):
            return self._set(self._begin_stop(state))
        handler = {Planning: self._planning, Starting: self._starting, Running: self._running, Stopping: self._stopping,
                   Queued: self._queued}  # fmt: skip
        return self._set(handler[type(state)](state))

    def _set(self, state: State) -> Phase:
        previous, self.state = self.state, state
        if state is not previous:
            self.callbacks.on_state(self.view, previous, state)
        return state.phase

    def request_stop(self, reason: str) -> None:
        """Stop the job (from a signal handler, say): a training group saves the step it reached
        and ends within `stop_grace_s`; in any other phase, or asked twice, stop at once."""
        if self._stop_request is not None or self.phase not in (Phase.RUNNING, Phase.STOPPING):
            raise JobStopped(reason)
        self._stop_request = reason

    def run(self) -> State:
        self.callbacks.on_start(self.view)
        try:
            while not self.phase.is_terminal:
                self.step()
        except JobStopped as e:
            self._set(Stopped(str(e), StopOutcome.AT_ONCE))
        finally:
            self._stop_group()
            self.plans.shutdown()
            self.callbacks.on_end(self.view)
        return self.state

    def _event(self, kind: str, step: int | None = None, seconds: float = 0.0, **fields) -> None:
        step = self.step_reached if step is None else step
        self.callbacks.on_event(self.view, Event(kind, step, self.now(), seconds, fields))

    # -- Planning ----------------------------------------------------------------------------
    def _planning(self, state: Planning) -> State:
        if not self.segments and self.step_reached == 0:
            committed = self.committed()
            if committed >= self.job.steps:
                self.step_reached = max(self.step_reached, committed)
                return Finished(
                    f"already complete: step {committed} of {self.job.steps} is committed in {self.job.checkpoint.dir}"
                    " (to train again, use a new checkpoint directory or more steps)"
                )
        decision = self.scaling.admit(self.view, state.target, self.clock())
        if isinstance(decision, policies.Wait):
            return self._queue(decision.reason, self.clock(), state.recovery)
        if isinstance(decision, policies.Fail):
            return Failed(decision.reason)
        target = decision.hosts
        if target < self.job.hosts.min:
            return Failed(f"{target} hosts left, the job needs at least {self.job.hosts.min} (hosts.min)")
        t, wall = self.clock(), self.wall()
        planned = self.plans.plan(target * self.job.hosts.devices_per_host)
        plan = planned.plan
        starting = Starting(plan, target, self._hosts_used(plan, target), planned.cached, planned.ahead,
                            state.recovery, state.stalled, planning_wall=(wall, self.wall()))  # fmt: skip
        self._event(EventKind.REPLAN, seconds=self.clock() - t, devices=target * self.job.hosts.devices_per_host,
                    mesh=dict(plan.mesh), cached=planned.cached, ahead=planned.ahead, notes=list(plan.notes))  # fmt: skip
        return starting

    def _hosts_used(self, plan, target: int) -> int:
        """Hosts whose devices the plan uses: a host none of whose devices is in the mesh would
        only wait on the others, so it is not started."""
        return min(target, -(-plan.devices_used // self.job.hosts.devices_per_host))

    # -- Queued (a shared cluster) ------------------------------------------------------------
    def _queue(self, reason: str, since: float, recovery: Recovery | None) -> Queued:
        previous = self.state
        if not isinstance(previous, Queued) or previous.reason != reason:
            self._event(EventKind.QUEUED, reason=reason)
        if isinstance(previous, Queued) and previous.reason == reason:
            return previous
        return Queued(reason, since, recovery)

    def _queued(self, state: Queued) -> State:
        self.callbacks.on_poll(self.view)
        self.sleep(self.config.host_check_interval_s)
        decision = self.scaling.admit(self.view, None, state.since)
        if isinstance(decision, policies.Wait):
            return self._queue(decision.reason, state.since, state.recovery)
        if isinstance(decision, policies.Fail):
            return Failed(decision.reason)
        self._event(EventKind.ADMITTED, hosts=decision.hosts, waited=round(self.clock() - state.since, 3))
        return Planning(decision.hosts, state.recovery)

    # -- Starting ----------------------------------------------------------------------------
    def _starting(self, state: Starting) -> State:
        t = self.clock()
        placed = self.cluster.placement(state.hosts)
        config = HostGroupConfig(env_vars=self._host_env())
        try:
            self.group = self.group_cls(state.hosts, config, self.standby, placed.reservations, placed.nodes)
        except HostsUnavailableError as e:
            self.callbacks.on_warning(self.view, f"{e}; re-planning")
            return Planning(None, state.recovery, state.stalled)
        spawn = self.clock() - t
        plan_json = state.plan.to_json()
        specs = GroupSpecs(self.job, plan_json, len(self.segments),
                           slice_ids(self.cluster.slice_of(), self.group.node_ids), self.plans.fingerprint,
                           self.config.compilation_cache, self.model_flops,
                           self.callbacks.test_hooks(self.view, state.hosts),
                           state.recovery.at_most if state.recovery is not None else None)  # fmt: skip
        try:
            self.group.start(specs.for_process, self._snapshot_placements(), self.plans.executables(plan_json))
        except HostsLostError as e:  # a host died between the plan and the start: recover as from any loss
            return self._on_hosts_lost(e, state.target, state.recovery)
        segment = Segment(len(self.segments), dict(state.plan.mesh), state.hosts, state.plan.devices_used,
                          state.plan.describe(), round(spawn, 3), round(t - self._t0, 3))  # fmt: skip
        self.segments.append(segment)
        self._hosts_checked_at = self.clock()
        return Running(segment, state.target, self.step_reached, state.recovery, state.stalled)

    def _host_env(self) -> dict:
        return {**self.cluster.host_env(), **self.config.env_vars}

    def _snapshot_placements(self) -> list | None:
        """Where each host keeps its snapshots, and the newest complete one to restore (at or after
        the newest commit: a snapshot older than that would lose steps the disk holds)."""
        if self.snapshots is None or self.job.checkpoint.snapshot_time_share <= 0:
            return None
        restore = None
        if self.segments:  # a new run's keepers hold nothing
            recovery = getattr(self.state, "recovery", None)
            at_most = recovery.at_most if recovery is not None else None
            restore = self.snapshots.newest(set(self.cluster.live_hosts()), after=self.committed(), at_most=at_most)
        return self.snapshots.placements(self.group.node_ids, len(self.segments), restore, self.cluster.slice_of())

    # -- Running -----------------------------------------------------------------------------
    def _running(self, state: Running) -> State:
        try:
            statuses = self.group.poll()
        except HostsLostError as e:
            # Steps the survivors finished before the loss still count; if process 0 is gone,
            # the lowest surviving host speaks for the group (SPMD: they all report the same steps).
            self._take(e.survivors, speaker=min((host for host, _ in e.survivors), default=None))
            return self._on_hosts_lost(e, state.target, self.state.recovery)
        except SegmentFailedError as e:
            # The program itself raised: another mesh would fail the same way.
            self._stop_group()
            return Failed(str(e))
        self._take(enumerate(statuses))
        state = self.state  # the reports may have moved it on (a recovery ends with a step)
        self._send_ahead(state)
        if self._preempted():
            return state  # the next step begins the stop
        if all(s.done for s in statuses):
            return self._segment_ended(state)
        self.callbacks.on_poll(self.view)
        state = self._check_hosts(self.state)
        self.sleep(self.config.poll_interval_s)
        return state

    def _take(self, answered, speaker: int | None = 0) -> None:
        """Every report of the hosts that answered a poll: (host, status) pairs."""
        for host, status in answered:
            for report in status.reports:
                self._on_report(host, report, speaker)

    def _on_report(self, host: int, report: Report, speaker: int | None) -> None:
        self.callbacks.on_report(self.view, host, report, host == speaker)
        if host != speaker:
            return  # SPMD: every host reports the same steps; one speaks for the group
        handle = self._handlers.get(type(report))
        extra = (handle(report) if handle else None) or {}
        if report.EVENT:
            self._event(report.KIND, getattr(report, "step", None), report.event_seconds(),
                        **report.event_fields(), **extra)  # fmt: skip

    def _stepped(self, report: Step) -> None:
        self.step_reached = max(self.step_reached, report.step)
        if self._shrunk_at is not None:
            self._shrunk_at = max(self._shrunk_at, report.step)  # steps the stopping group still finished
        segment = self.segment
        if segment.first_step is None:
            segment.first_step, segment.first_step_at = report.step, round(self.now(), 3)
            self.step_seconds.clear()  # the first step of a group includes waiting for its peers
            self.ahead.prepare(segment.hosts)  # once a segment, off the recovery path: it has its first step
        elif report.seconds:
            self.step_seconds.append(report.seconds)
        segment.last_step, segment.snapshot_every = report.step, report.snapshot_every
        recovery = getattr(self.state, "recovery", None)
        if recovery is not None and not recovery.recovered:
            recovery = dataclasses.replace(recovery, recovered=True)
            self._set(dataclasses.replace(self.state, recovery=recovery))
            self.callbacks.on_recovered(self.view, self.clock() - recovery.detected)
        if recovery is not None and report.step > recovery.step:
            self._set(dataclasses.replace(self.state, recovery=None))  # past the step reached at the loss

    def _restored(self, report: Restore) -> dict:
        extra = {"committed": self.committed()}  # nothing committed is lost: step >= this
        recovery = getattr(self.state, "recovery", None)
        if recovery is not None and not recovery.restored:
            extra["recomputed"] = max(0, recovery.step - report.step)  # done before the loss, computed again
            self._set(dataclasses.replace(self.state, recovery=dataclasses.replace(recovery, restored=True)))
        elif self._shrunk_at is not None:  # likewise after a shrink the fleet asked for
            extra["recomputed"] = max(0, self._shrunk_at - report.step)
            self._shrunk_at = None
        self.step_reached = max(self.step_reached, report.step)  # a resumed run starts from there
        return extra

    def _compiled(self, report: Compile) -> None:
        self.segment.model_flops, self.segment.device_flops = report.model_flops, report.device_flops

    def _send_ahead(self, state: Running) -> None:
        """A plan made ahead for a smaller mesh goes to the group, whose process 0 compiles its
        programs while it trains and reports them: a group on that plan loads them instead."""
        plans, failed = self.ahead.made(state.segment.devices)
        for text in failed:
            self.callbacks.on_warning(self.view, text)
        for plan_json in plans:
            self.group.compile_ahead(plan_json)

    def _preempted(self) -> bool:
        path = self.config.stop_file
        if not path or self._stop_request or not os.path.exists(path):
            return False
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        self._stop_request = f"preemption notice: {path} appeared"
        return True

    def _check_hosts(self, state: Running) -> State:
        """Every `host_check_interval_s`: a standby actor for a host that joined, and the scaling
        policy asked whether to resize (a new state, the resize pending, if so)."""
        if self.clock() - self._hosts_checked_at < self.config.host_check_interval_s:
            return state
        self._hosts_checked_at = self.clock()
        alive = functools.cache(self.cluster.alive_hosts)  # asked once, and only where needed
        if self.standby is not None and state.segment.first_step is not None:
            self.ahead.refill(alive())  # a host that joined gets its standby actor
        decision = self.scaling.while_running(self.view, state, alive)
        if isinstance(decision, policies.Warn):
            self._event(decision.event, reason=decision.reason, **decision.fields)
        if isinstance(decision, policies.Evict):
            self._event(decision.event, hosts=list(decision.hosts), reason=decision.reason, **decision.fields)
            nodes = [self.group.node_ids[i] for i in decision.hosts]
            return self._on_hosts_lost(HostsLostError(list(decision.hosts), nodes, decision.reason, []), state.target,
                                       state.recovery, decision.restore_at_most)  # fmt: skip
        if not isinstance(decision, policies.Resize):
            return state
        if decision.hosts < state.target:
            self._shrunk_at = self.step_reached  # updated as the group reports steps up to its stop
        self._event(decision.event, hosts=decision.hosts, reason=decision.reason, **decision.fields)
        self.group.request_stop(now=decision.at_once)
        return dataclasses.replace(state, resize=decision, target=decision.hosts)

    def _segment_ended(self, state: Running | Stopping) -> State:
        """Every host of the group is done: the job finished, was stopped, or goes on elsewhere."""
        self._stop_group()
        if self.step_reached >= self.job.steps:
            return Finished()
        if isinstance(state, Stopping) or self._stop_request:
            return Stopped(getattr(state, "reason", self._stop_request), StopOutcome.COMMITTED)
        # Stopped at a checkpoint boundary to resize, or stalled. A segment that completed no new
        # step is a stall, and stalls in a row are bounded by the failure policy: never an endless
        # restart loop.
        stalled = 0 if self.step_reached > state.started_after else state.stalled + 1
        decision = self.failure.on_segment_end(stalled, self.step_reached)
        if isinstance(decision, policies.Fail):
            return Failed(decision.reason)
        return Planning(state.target, state.recovery, stalled)

    def _on_hosts_lost(self, e: HostsLostError, target: int, recovery: Recovery | None,
                       at_most: int | None = None) -> State:  # fmt: skip
        detected = self.clock()
        alive = self.cluster.alive_hosts()
        loss = read_loss(self.group.node_ids, e.indices, alive, set(self.cluster.live_hosts()))
        if loss.left:
            self.callbacks.on_warning(
                self.view, f"{loss.left} host(s) of the slice that lost a host leave the group with it"
            )
        caused = self.callbacks.lost_at(e.node_ids)
        failures = recovery.failures + 1 if recovery is not None else 1
        snapshot_every = self.segment.snapshot_every if self.segment else 0
        self._event(EventKind.HOST_LOST, seconds=(detected - caused) if caused is not None else 0.0, hosts=loss.hosts,
                    processes=loss.processes, nodes_dead=loss.dead, slice_left=loss.left,
                    snapshot_every=snapshot_every, detail=str(e))  # fmt: skip
        self._stop_group()
        decision = self.failure.on_failure(loss.failure(target, len(alive), failures - 1))
        if isinstance(decision, policies.Fail):
            return Failed(decision.reason)
        return Planning(decision.hosts, Recovery(self.step_reached, detected, failures, at_most=at_most),
                        decision=decision)  # fmt: skip

    # -- Stopping ----------------------------------------------------------------------------
    def _begin_stop(self, state: Running) -> State:
        self.group.request_stop(now=True)
        return Stopping(state.segment, self._stop_request, self.clock() + self.config.stop_grace_s)

    def _stopping(self, state: Stopping) -> State:
        try:
            statuses = self.group.poll()
        except (HostsLostError, SegmentFailedError) as e:
            self._stop_group()
            return Stopped(state.reason, StopOutcome.HOSTS_FAILED, str(e).splitlines()[0])
        self._take(enumerate(statuses))
        if all(s.done for s in statuses):
            return self._segment_ended(state)
        if self.clock() > state.deadline:
            self._stop_group()
            grace = f"{self.config.stop_grace_s:.0f} s"
            return Stopped(f"{state.reason} (hosts did not finish within {grace}; the newest commit stands)",
                           StopOutcome.GRACE_OVER)  # fmt: skip
        self.sleep(self.config.poll_interval_s)
        return state

    def _stop_group(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None
