"""The job controller: an explicit state machine that executes policy decisions.

    PLANNING --plan for the hosts there are--> STARTING --new group, restore--> RUNNING
    PLANNING --the last step is already committed--> FINISHED
    RUNNING --hosts lost--> (FailurePolicy) PLANNING | FAILED
    RUNNING --more hosts--> (ScalingPolicy) stop at the next checkpoint --> PLANNING
    RUNNING --segment ended without a new step--> (FailurePolicy) PLANNING | FAILED
    RUNNING --last step--> FINISHED
    RUNNING --request_stop (a signal)--> STOPPING --the step reached saved, or grace over--> STOPPED

`step()` performs exactly one transition (in RUNNING: one poll of the hosts), so a test can drive
it one move at a time; `run()` loops until a terminal phase. Clocks, the poll interval, the
planner and the host-group class are parameters.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import enum
import hashlib
import json
import os
import time
from collections.abc import Callable

from ..hosts.group import HostGroup, HostGroupConfig, HostsLostError, HostsUnavailableError, SegmentFailedError
from ..job.jobfile import JobSpec
from ..telemetry.goodput import REPORT_CATEGORY, USEFUL, Ledger, Throughput
from ..telemetry.recorder import Recorder
from ..telemetry.summary import RunSummary
from ..testing.chaos import PHASES, ChaosInjector, Fault
from ..worker.segment import SegmentSpec, plan_key
from . import policies

LOSS_BADPUT = ("lost", "startup", "planning", "compile", "restore")  # what a host loss costs


class Phase(enum.Enum):
    PLANNING = "planning"
    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"

    @property
    def is_terminal(self) -> bool:
        return self in (Phase.FINISHED, Phase.FAILED, Phase.STOPPED)


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
        cluster,
        *,
        planner: Callable,
        fingerprint: str,
        config: ControllerConfig = ControllerConfig(),
        chaos: tuple[Fault, ...] = (),
        scaling: policies.ScalingPolicy | None = None,
        failure: policies.FailurePolicy | None = None,
        group_cls=HostGroup,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        printer: Callable[[str], None] | None = None,
        recorder: Recorder | None = None,
        wall: Callable[[], float] = time.time,
        model_flops: float | None = None,
        committed: Callable[[], int] = lambda: 0,
        snapshots=None,
        standby=None,
    ):
        """`committed`: the newest committed checkpoint step (a re-run of a finished job ends at once).
        `snapshots`: the peer snapshots' keepers (`snapshots.Keepers`); None: restores read the disk.
        `standby`: a `hosts.StandbyPool` the groups take their actors from; None: each group spawns."""
        self.job = job
        self.cluster = cluster
        self.planner = planner
        self.fingerprint = fingerprint
        self.model_flops = model_flops  # of one step, for MFU; None: each host counts it
        self.committed = committed
        self.snapshots = snapshots
        self.standby = standby
        self.config = config
        self.scaling = scaling or policies.ScalingPolicy(job.hosts.min, job.hosts.max)
        self.failure = failure or policies.FailurePolicy(job.hosts.min, job.hosts.max)
        self.chaos = ChaosInjector(chaos)
        self.group_cls = group_cls
        self.clock, self.sleep = clock, sleep
        self.print = printer or (lambda line: print(line, flush=True))
        self.phase = Phase.PLANNING
        self.summary = RunSummary(job=job.name, steps=job.steps)
        self.recorder = recorder or Recorder()
        self.wall = wall  # wall-clock time, which host reports are stamped with
        self.ledger = Ledger(wall())
        self.throughput = Throughput()
        self._segment_throughputs: list[Throughput] = []  # one per summary segment
        self._t0 = clock()
        self._target: int | None = None  # hosts the next segment should run on
        self._plans: dict[tuple[str, int], object] = {}
        self._ahead: dict[tuple[str, int], concurrent.futures.Future] = {}  # plans being made ahead
        self._ahead_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._planned_ahead: set[tuple[str, int]] = set()
        self._plan = None
        self._group: HostGroup | None = None
        self._segment: dict | None = None
        self._failures = 0  # in a row: reset once a group gets past the step the last loss reached
        self._recovering_since: float | None = None  # loss detected at, until the first new step
        self._snapshot_every = 0  # the group's peer snapshot interval, as its last step reported it
        # A host loss being recovered from: the step reached, the ledger then, and whether the
        # restore (which says how many steps are computed again) has been reported.
        self._loss: dict | None = None
        self._stopping = False  # a resize is waiting for the next checkpoint boundary
        self._stop_reason: str | None = None  # a stop was requested (a signal)
        self._stop_deadline = 0.0
        self._stalled = 0  # segments in a row that ended without a new step
        self._segment_from = 0  # the step the running segment started after
        self._last_host_check = 0.0
        self._injected: dict[str, float] = {}  # node id -> when chaos killed it
        self._executables: dict[str, dict] = {}  # plan key -> programs compiled ahead for it

    # -- the state machine -------------------------------------------------------------------
    def step(self) -> Phase:
        if self._stop_reason and self.phase is Phase.RUNNING:
            self.phase = self._begin_stop()
            return self.phase
        handler = {
            Phase.PLANNING: self._planning,
            Phase.STARTING: self._starting,
            Phase.RUNNING: self._running,
            Phase.STOPPING: self._stopping_hosts,
        }[self.phase]
        self.phase = handler()
        return self.phase

    def request_stop(self, reason: str) -> None:
        """Stop the job (from a signal handler, say): a training group saves the step it reached
        and ends within `stop_grace_s`; in any other phase, or asked twice, stop at once."""
        if self._stop_reason is not None or self.phase not in (Phase.RUNNING, Phase.STOPPING):
            raise JobStopped(reason)
        self._stop_reason = reason

    def run(self) -> RunSummary:
        self.recorder.started()
        try:
            while not self.phase.is_terminal:
                self.step()
        except JobStopped as e:
            self.phase = Phase.STOPPED
            self.summary.reason = str(e)
            self.print(f"stop  {e}: stopped at once after step {self._done_step()}")
        finally:
            self._stop_group()
            if self._ahead_pool is not None:
                self._ahead_pool.shutdown(wait=False, cancel_futures=True)
            self.summary.state = self.phase.value
            self.summary.wall_seconds = self._now()
            self.summary.goodput = self.ledger.breakdown(self.wall())
            self.summary.throughput = self.throughput.summary()
            self._record_status()  # also the segments' medians
            self.recorder.close()
        return self.summary

    def _segment_medians(self) -> None:
        for seg, t in zip(self.summary.segments, self._segment_throughputs):
            s = t.summary()
            seg.update({f"median_{k}": s[k] for k in ("step_seconds", "tokens_per_second", "mfu")})

    def _event(self, kind: str, **fields) -> dict:
        e = self.summary.event(kind, **fields)
        self.recorder.event({**e, "at": self.ledger.start + e["at"]})  # the store keeps wall-clock times
        return e

    def _record_status(self) -> None:
        seg = self._segment or {}
        goodput = self.summary.goodput or self.ledger.breakdown(self.wall())
        recent = self.throughput.recent(20)
        self._segment_medians()
        self.recorder.status(
            state=self.phase.value,
            steps_completed=self._done_step(),
            mesh=seg.get("mesh", {}),
            hosts=seg.get("hosts", 0),
            devices=seg.get("devices", 0),
            reason=self.summary.reason,
            tokens_per_second=recent["tokens_per_second"],
            mfu=recent["mfu"],
            goodput_ratio=goodput["goodput_ratio"],
            goodput=goodput,
            throughput=self.summary.throughput or self.throughput.summary(),
            segments=self.summary.segments,
        )

    def _now(self) -> float:
        return self.clock() - self._t0

    def _done_step(self) -> int:
        return self.summary.steps_completed

    # -- PLANNING ----------------------------------------------------------------------------
    def _planning(self) -> Phase:
        if not self.summary.segments and self._done_step() == 0:
            committed = self.committed()
            if committed >= self.job.steps:
                self.summary.reached(committed)
                self.summary.reason = (
                    f"already complete: step {committed} of {self.job.steps} is committed in {self.job.checkpoint.dir}"
                    " (to train again, use a new checkpoint directory or more steps)"
                )
                return Phase.FINISHED
        available = len(self.cluster.alive_hosts())
        if self._target is None:
            decision = self.scaling.initial(available)
            if isinstance(decision, policies.Fail):
                return self._fail(decision.reason)
            self._target = decision.hosts
        # Hosts may have gone since the decision was made; run on what is there now.
        self._target = min(self._target, available)
        if self._target < self.job.hosts.min:
            return self._fail(f"{available} hosts left, the job needs at least {self.job.hosts.min} (hosts.min)")
        hosts = self._target
        devices = hosts * self.job.hosts.devices_per_host
        t, wall = self.clock(), self.wall()
        key = (self.fingerprint, devices)
        if key in self._ahead:
            self._plans[key] = self._ahead.pop(key).result()
        ahead = key in self._planned_ahead  # planned while an earlier group trained
        cached = key in self._plans
        if not cached:  # on the planning thread if there is one: one search at a time
            pool = self._ahead_pool
            self._plans[key] = pool.submit(self.planner, devices).result() if pool else self.planner(devices)
        self._plan = self._plans[key]
        self.ledger.add("planning", wall, self.wall())
        self.ledger.gap = "startup"  # until the new group's first report
        self._event(
            "replan",
            step=self._done_step(),
            at=self._now(),
            seconds=self.clock() - t,
            devices=devices,
            mesh=dict(self._plan.mesh),
            cached=cached,
            ahead=ahead,
            notes=list(self._plan.notes),
        )
        used = self._hosts_used()
        idle = (
            f"\n      note: {hosts - used} of {hosts} hosts left idle: the plan uses {self._plan.devices_used} devices"
            if used < hosts
            else ""
        )
        self.print(
            f"plan  {self._plan.describe()} on {used} hosts"
            + (" (planned ahead)" if ahead else " (cached)" if cached else "")
            + "".join(f"\n      note: {n}" for n in self._plan.notes)
            + idle
        )
        return Phase.STARTING

    def _hosts_used(self) -> int:
        """Hosts whose devices the plan uses: a host none of whose devices is in the mesh would
        only wait on the others, so it is not started."""
        per_host = self.job.hosts.devices_per_host
        return min(self._target, -(-self._plan.devices_used // per_host))

    # -- STARTING ----------------------------------------------------------------------------
    def _starting(self) -> Phase:
        hosts = self._hosts_used()
        t = self.clock()
        try:
            config = HostGroupConfig(env_vars=self._host_env())
            self._group = self.group_cls(hosts, config, self.standby)
        except HostsUnavailableError as e:
            self.print(f"warn  {e}; re-planning")
            self._target = None
            return Phase.PLANNING
        spawn = self.clock() - t
        hangs = self.chaos.hangs(self._done_step())
        freeze = {f.host_in(hosts): f.step for f in hangs if f.phase == "save"}
        # A host carrying several phase faults hangs in the first of those phases it reaches.
        phase = {f.host_in(hosts): f.phase for f in sorted(hangs, key=_phase_order, reverse=True) if f.phase != "save"}
        slow = {(h if h is not None else hosts - 1): s for h, s in self.chaos.slow_hosts().items()}
        plan_json = self._plan.to_json()
        spec_for = lambda i, coordinator: self._spec(
            i, coordinator, hosts, plan_json, freeze.get(i), slow.get(i), phase.get(i)
        )
        snapshots = self._snapshot_plans()
        try:
            self._group.start(spec_for, snapshots, self._executables.get(plan_key(plan_json)))
        except HostsLostError as e:  # a host died between the plan and the start: recover as from any loss
            return self._on_hosts_lost(e)
        if self._loss is not None:  # a recovery: a host that joins now arrives in the middle of it
            for fault in self.chaos.recovery_adds(self._loss["step"]):
                self.print(f"chaos {fault}: adding a host while the new group starts")
                self.cluster.add_host()
        self._segment = {
            "mesh": dict(self._plan.mesh),
            "hosts": hosts,
            "devices": self._plan.devices_used,
            "first_step": None,
            "last_step": None,
            "spawn_seconds": round(spawn, 3),
            "started_at": round(t - self._t0, 3),
            "first_step_at": None,
            "plan": self._plan.describe(),
        }
        self._segment_throughputs.append(Throughput())
        self.summary.segments.append(self._segment)
        self._record_status()
        self._stopping = False
        self._segment_from = self._done_step()
        self._last_host_check = self.clock()
        return Phase.RUNNING

    def _host_env(self) -> dict:
        return {**self.cluster.host_env(), **self.config.env_vars}

    def _prepare_next(self) -> None:
        """What the next group will need, made while this one trains: a standby actor on every live
        host, and plans for the meshes a resize would likely go to (a host fewer, a host more)."""
        if self.standby is not None:
            self.standby.refill(self.cluster.alive_hosts(), self._host_env())
        hosts = self._segment["hosts"] if self._segment else 0
        for n in (hosts - 1, hosts + 1):
            key = (self.fingerprint, n * self.job.hosts.devices_per_host)
            if self.job.hosts.min <= n <= self.job.hosts.max and key not in self._plans and key not in self._ahead:
                if self._ahead_pool is None:
                    self._ahead_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="remesh-plan")
                self._ahead[key] = self._ahead_pool.submit(self.planner, key[1])

    def _preempted(self) -> bool:
        path = self.config.stop_file
        if not path or self._stop_reason or not os.path.exists(path):
            return False
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        self._stop_reason = f"preemption notice: {path} appeared"
        return True

    def _send_ahead(self) -> None:
        """A plan made ahead for a smaller mesh goes to the group, whose process 0 compiles its
        programs while it trains and reports them: a group on that plan loads them instead."""
        for key in [k for k, f in self._ahead.items() if f.done()]:
            try:
                plan = self._ahead.pop(key).result()
            except Exception as e:  # noqa: BLE001 (a resize plans again, on its own path)
                self.print(f"warn  planning ahead for {key[1]} devices failed: {e}")
                continue
            self._plans[key] = plan
            self._planned_ahead.add(key)
            if plan.devices_used < self._plan.devices_used:
                self._group.compile_ahead(plan.to_json())

    def _snapshot_plans(self) -> list | None:
        """Where each host keeps its snapshots, and the newest complete one to restore (at or after
        the newest commit: a snapshot older than that would lose steps the disk holds)."""
        if self.snapshots is None or self.job.checkpoint.memory_budget <= 0:
            return None
        restore = None
        if self.summary.segments:  # a new run's keepers hold nothing
            restore = self.snapshots.newest(set(self.cluster.alive_hosts()), after=self.committed())
        return self.snapshots.plans(self._group.node_ids, len(self.summary.segments), restore)

    def _spec(
        self,
        process_id: int,
        coordinator: str,
        hosts: int,
        plan_json: str,
        freeze: int | None,
        slow: int | None = None,
        freeze_in: str | None = None,
    ) -> SegmentSpec:
        job = self.job
        return SegmentSpec(
            program=job.program,
            steps=job.steps,
            global_batch=job.global_batch,
            seed=job.seed,
            checkpoint=job.checkpoint,
            plan_json=plan_json,
            coordinator=coordinator,
            num_processes=hosts,
            process_id=process_id,
            segment=len(self.summary.segments),
            freeze_before_save=freeze,
            freeze_in=freeze_in,
            slow_input_from=slow,
            compilation_cache=self.config.compilation_cache,
            fingerprint=self.fingerprint,
            hardware=job.hardware,
            job=job.name,
            model_flops=self.model_flops,
            options=dict(job.options),
        )

    # -- RUNNING -----------------------------------------------------------------------------
    def _running(self) -> Phase:
        try:
            statuses = self._group.poll()
        except HostsLostError as e:
            # Steps the survivors finished before the loss still count; if process 0 is gone,
            # the lowest surviving host speaks for the group (SPMD: they all report the same steps).
            self._take(e.survivors, speaker=min((host for host, _ in e.survivors), default=None))
            return self._on_hosts_lost(e)
        except SegmentFailedError as e:
            # The program itself raised: another mesh would fail the same way.
            self._stop_group()
            return self._fail(str(e))
        self._take(enumerate(statuses))
        self._send_ahead()
        if self._preempted():
            return Phase.RUNNING  # the next step begins the stop
        if self.recorder.due():  # medians over every step: not at every poll
            self._record_status()
            self.recorder.flush()
        if all(s.done for s in statuses):
            return self._segment_ended()
        self._inject_due_faults()
        self._maybe_grow()
        self.sleep(self.config.poll_interval_s)
        return Phase.RUNNING

    def _take(self, answered, speaker: int | None = 0) -> None:
        """Every report of the hosts that answered a poll: (host, status) pairs."""
        for host, status in answered:
            for report in status.reports:
                self._on_report(host, report, speaker=speaker)

    def _segment_ended(self) -> Phase:
        """Every host of the group is done: the job finished, was stopped, or goes on elsewhere."""
        self._stop_group()
        if self._done_step() >= self.job.steps:
            return Phase.FINISHED
        if self._stop_reason:
            self.print(f"      step {self._done_step()} committed; hosts stopped")
            return Phase.STOPPED
        return self._after_segment()  # stopped at a checkpoint boundary to resize, or stalled

    def _after_segment(self) -> Phase:
        """A segment ended before the last step. One that completed no new step is a stall, and
        stalls in a row are bounded by the failure policy: never an endless restart loop."""
        self._stalled = 0 if self._done_step() > self._segment_from else self._stalled + 1
        decision = self.failure.on_segment_end(self._stalled, self._done_step())
        if isinstance(decision, policies.Fail):
            return self._fail(decision.reason)
        return Phase.PLANNING

    # -- STOPPING ----------------------------------------------------------------------------
    def _begin_stop(self) -> Phase:
        grace = self.config.stop_grace_s
        self.print(f"stop  {self._stop_reason}: saving the step reached, then stopping (at most {grace:.0f} s)")
        self._group.request_stop(now=True)
        self._stop_deadline = self.clock() + grace
        return Phase.STOPPING

    def _stopping_hosts(self) -> Phase:
        self.summary.reason = self._stop_reason
        try:
            statuses = self._group.poll()
        except (HostsLostError, SegmentFailedError) as e:
            self.print(f"      hosts failed while stopping ({str(e).splitlines()[0]}); the newest commit stands")
            self._stop_group()
            return Phase.STOPPED
        self._take(enumerate(statuses))
        if all(s.done for s in statuses):
            return self._segment_ended()
        if self.clock() > self._stop_deadline:
            self.summary.reason += (
                f" (hosts did not finish within {self.config.stop_grace_s:.0f} s; the newest commit stands)"
            )
            self.print(f"      hosts did not finish within {self.config.stop_grace_s:.0f} s; stopping them")
            self._stop_group()
            return Phase.STOPPED
        self.sleep(self.config.poll_interval_s)
        return Phase.STOPPING

    def _on_report(self, host: int, r: dict, speaker: int = 0) -> None:
        kind, now = r["kind"], self._now()
        if kind == "chaos_frozen":  # whichever host froze is the one to kill
            self._kill(host, str(self.chaos.hung(r["phase"], r.get("step"))))
            return
        if kind == "step":
            self.recorder.step(host, len(self.summary.segments), r, speaker=host == speaker)
        if host != speaker:
            return  # SPMD: every host reports the same steps; process 0 speaks for the group
        self._account(r)
        if kind == "step":
            self.summary.record_step(r["step"], r["loss"], r.get("metrics"))
            self._snapshot_every = r.get("snapshot_every", 0)
            seg = self._segment
            if seg["first_step"] is None:
                seg["first_step"], seg["first_step_at"] = r["step"], round(now, 3)
                self._prepare_next()  # off the recovery path: this segment has its first step
            seg["last_step"] = r["step"]
            if self._recovering_since is not None:
                recovery = self.clock() - self._recovering_since
                self.summary.recovery_seconds.append(round(recovery, 3))
                self._recovering_since = None
                self.print(f"      recovered in {recovery:.1f} s")
            self._charge_loss(r["step"])
            self._progress(r)
        elif kind == "eval":
            self.summary.record_eval(r["step"], r["loss"], r.get("metrics"))
            self._event(kind, step=r["step"], at=now, seconds=r["seconds"], loss=r["loss"], metrics=r.get("metrics"))
            self.print(f"eval  {r['step']:>5}/{self.job.steps}  loss {r['loss']:.4f}  ({r['seconds']:.2f} s)")
        elif kind == "compile_ahead":
            extra = {k: v for k, v in r.items() if k not in ("kind", "seconds", "executables")}
            if "executables" in r:  # for the group that runs that plan; held here, where a host loss cannot take them
                self._executables[r["executables"]["plan"]] = r["executables"]
                extra["executables"] = sorted(k for k in r["executables"] if k != "plan")
            self._event(kind, step=self._done_step(), at=now, seconds=r["seconds"], **extra)
            what = f"failed: {r['error'][:200]}" if "error" in r else f"done in {r['seconds']:.1f} s"
            self.print(f"      compiling ahead for {r.get('devices', '?')} devices {what}")
        elif kind == "snapshot_unusable":
            self.print(f"      the snapshot in host memory is unusable ({r['error'][:200]}); restoring from disk")
        elif kind == "checkpoint_failed":
            self._event(kind, step=r["step"], at=now, seconds=0.0, error=r["error"], newest=r["newest"])
            self.print(
                f"warn  checkpoint step {r['step']} was not saved ({r['error'][:200]}); the newest commit "
                f"stays step {r['newest']}, and training goes on"
            )
        elif kind == "checkpoint_corrupt":
            self._event(kind, step=r["step"], at=now, seconds=0.0, error=r["error"])
            self.print(
                f"      checkpoint step {r['step']} is damaged, moved aside; trying the one before: {r['error'][:200]}"
            )
        elif kind in ("group_start", "compile", "restore", "checkpoint"):
            extra = {k: v for k, v in r.items() if k not in ("kind", "step", "seconds", "at", "reported")}
            if kind == "restore" and "reported" in r:
                self._unreported(r["step"], r["reported"])
            if kind == "restore":
                extra["committed"] = self.committed()  # nothing committed is lost: step >= this
                if self._loss is not None and not self._loss["restored"]:
                    # Steps done before the loss that the group now computes again.
                    extra["recomputed"] = max(0, self._loss["step"] - r["step"])
                    self.summary.recomputed_steps.append(extra["recomputed"])
                    self._loss["restored"] = True
            self._event(kind, step=r.get("step", self._done_step()), at=now, seconds=r["seconds"], **extra)
            if kind == "compile":
                self.throughput.model_flops_per_step = r["model_flops"]
                self._segment.update(model_flops=r["model_flops"], device_flops=r["device_flops"])
            if kind == "restore":
                self.summary.reached(r["step"])  # a resumed run starts from there
                where = "host memory" if r.get("source") == "memory" else "disk"
                again = f"; {extra['recomputed']} steps to compute again" if "recomputed" in extra else ""
                self.print(f"      restored step {r['step']} from {where} in {r['seconds']:.2f} s{again}")

    def _unreported(self, step: int, reported: dict) -> None:
        """Steps up to the restored `step` whose reports never came: a group that went before its
        last steps were polled, or, on a resume, a controller killed before it stored them. The
        restored step's metadata kept them (`reported`: the segment that ran them, the reports)."""
        done = self._done_step()
        if done == 0:  # a resume (this run has no step of its own yet): they belong to an earlier run
            self.recorder.resumed(step, {**reported, "segment": reported["segment"] + 1})
            return
        for r in reported["steps"]:
            if done < r["step"] <= step:  # the store counts segments from 1, specs from 0
                self.recorder.step(0, reported["segment"] + 1, r, speaker=False)
                self.summary.record_step(r["step"], r["loss"], r.get("metrics"))

    def _charge_loss(self, step: int) -> None:
        """Once a group computes a step past the one reached at a loss, what the ledger charged
        meanwhile is the loss's badput, by category; its total counts detection and tear-down,
        group start, planning, compile, restore and steps computed again (`LOSS_BADPUT`)."""
        if self._loss is None or step <= self._loss["step"]:
            return
        before, self._loss = self._loss["badput"], None
        self._failures = 0
        charged = {k: round(v - before[k], 4) for k, v in self.ledger.seconds.items() if k != USEFUL}
        # Saves, input waits and evaluations in the window would have happened without the loss.
        total = sum(charged[k] for k in LOSS_BADPUT)
        self.summary.loss_badput.append({"total": round(total, 4), **charged})

    def _account(self, r: dict) -> None:
        """Charge a report of process 0 to the ledger (goodput.py); steps to the throughput."""
        if r["kind"] == "step":
            category = USEFUL if r["step"] > self._done_step() else "lost"  # before losses[step] is set
            self.throughput.add(r)
            self._segment_throughputs[-1].add(r)
            begun = r["at"] - r["seconds"]
            waited = min(r.get("input_seconds") or 0.0, r["seconds"])
            copied = min(r.get("snapshot_seconds") or 0.0, r["seconds"] - waited)
            if waited > 0:  # the step's lap holds its input wait: that part is input badput
                self.ledger.add("input", begun, begun + waited)
            if copied > 0:  # and the copy of a peer snapshot: checkpoint badput
                self.ledger.add("checkpoint", begun + waited, begun + waited + copied)
        else:
            category = REPORT_CATEGORY.get(r["kind"])
        if category is not None and "at" in r:
            self.ledger.add(category, r["at"] - r["seconds"], r["at"])

    def _progress(self, r: dict) -> None:
        if r["step"] % 10 and r["step"] != self.job.steps and r["step"] != self._segment["first_step"]:
            return
        mesh = " x ".join(f"{k}={v}" for k, v in self._segment["mesh"].items())
        self.print(
            f"step  {r['step']:>5}/{self.job.steps}  loss {r['loss']:.4f}  "
            f"{r['tokens_per_second']:>9,.0f} tok/s  MFU {r['mfu']:.2%}  mesh {mesh}  hosts {self._segment['hosts']}"
        )

    def _on_hosts_lost(self, e: HostsLostError) -> Phase:
        detected = self.clock()
        # A loss during a recovery is charged to the first: the ledger is read at the first only.
        badput = self._loss["badput"] if self._loss else dict(self.ledger.seconds)
        # From the last report to now the group was failing, and until the next plan it is torn down.
        self.ledger.fill(self.wall(), "lost")
        self.ledger.gap = "lost"
        alive = set(self.cluster.alive_hosts())
        dead_nodes = [n for n in e.node_ids if n not in alive]
        injected = [self._injected.pop(n) for n in e.node_ids if n in self._injected]
        self._failures += 1
        self._loss = {"step": self._done_step(), "badput": badput, "restored": False}
        self._event(
            "host_lost",
            step=self._done_step(),
            at=self._now(),
            seconds=(detected - injected[0]) if injected else 0.0,
            hosts=e.indices,
            nodes_dead=len(dead_nodes),
            snapshot_every=self._snapshot_every,
            detail=str(e),
        )
        self.print(f"lost  host(s) {e.indices} after step {self._done_step()} ({e})")
        self._stop_group()
        decision = self.failure.on_failure(
            policies.Failure(
                hosts_in_group=self._target,
                hosts_lost=len(dead_nodes),
                processes_lost=len(e.indices) - len(dead_nodes),
                hosts_alive=len(alive),
                failures_in_a_row=self._failures - 1,
            )
        )
        if isinstance(decision, policies.Fail):
            return self._fail(decision.reason)
        self.print(f"      {type(decision).__name__.lower()} onto {decision.hosts} hosts: {decision.reason}")
        self._target = decision.hosts
        self._recovering_since = detected
        return Phase.PLANNING

    def _inject_due_faults(self) -> None:
        for fault in self.chaos.due(self._done_step()):
            if fault.kind == "lose":
                for host in fault.hosts_in(self._group.size):
                    self._kill(host, str(fault))
            elif fault.kind == "freeze":
                host = fault.host_in(self._group.size)
                node = self._group.node_ids[host]
                self.print(f"chaos {fault}: stopping host {host}'s process (node {node[:8]}, SIGSTOP)")
                self._injected[node] = self.clock()
                self.cluster.freeze_process(self._group.places[host]["pid"])
            elif fault.kind == "add":
                self.print(f"chaos {fault}: adding a host")
                self.cluster.add_host()

    def _kill(self, host: int, why: str) -> None:
        node = self._group.node_ids[host]
        self.print(f"chaos {why}: killing host {host} (node {node[:8]})")
        self._injected[node] = self.clock()
        try:
            self.cluster.kill_host(node)
        except KeyError:  # gone already: a loss not yet seen
            self.print(f"      host {host} (node {node[:8]}) is gone already")

    def _maybe_grow(self) -> None:
        if self._stopping or self.clock() - self._last_host_check < self.config.host_check_interval_s:
            return
        self._last_host_check = self.clock()
        alive = self.cluster.alive_hosts()
        if self.standby is not None and self._segment["first_step"] is not None:
            self.standby.refill(alive, self._host_env())  # a host that joined gets its standby actor
        available = len(alive)
        decision = self.scaling.on_progress(self._target, available)
        if isinstance(decision, policies.Resize):
            self._stopping = True
            self._target = decision.hosts
            self._event("host_added", step=self._done_step(), at=self._now(), hosts=decision.hosts)
            self.print(f"grow  {decision.reason}: resizing to {decision.hosts} hosts at the next checkpoint")
            self._group.request_stop()

    def _fail(self, reason: str) -> Phase:
        self.summary.reason = reason
        self.print(f"fail  {reason}")
        return Phase.FAILED

    def _stop_group(self) -> None:
        if self._group is not None:
            self._group.shutdown()
            self._group = None


def _phase_order(fault: Fault) -> int:
    return PHASES.index(fault.phase) if fault.phase in PHASES else len(PHASES)


def program_fingerprint(ref: str, abstract_state, abstract_batch) -> str:
    """Identifies a program's shapes for the plan cache: same shapes, same plan."""
    import jax

    leaves = [
        (jax.tree_util.keystr(p), list(x.shape), str(x.dtype))
        for tree in (abstract_state, abstract_batch)
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    return hashlib.sha256(json.dumps([ref, leaves]).encode()).hexdigest()[:16]
