"""`run_job`: wire a job file to a cluster, a planner, a controller and its callbacks, and run it
(`remesh run`, and a job submitted to a Ray cluster). Fault injection (`chaos`) is loaded only
when faults are given."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

from .control.controller import ControllerConfig, JobController
from .control.corruption import CorruptionWatch, LossWatch
from .control.fleet_following import FleetFollowing
from .control.hangs import HangWatch
from .control.health import HealthyScaling
from .control.planning import PlanCache, program_fingerprint
from .control.policies import ScalingPolicy
from .control.quarantine import Quarantine
from .control.stragglers import StragglerConfig, StragglerWatch
from .dashboard.store import FleetStoreConfig
from .fleet.cluster import FleetCluster
from .hosts.interface import Cluster, EmulatedHosts
from .hosts.probe import HostProbe
from .hosts.slices import SlicedCluster, SliceLayout, cluster_layout, host_slices
from .job.jobfile import JobSpec
from .job.lock import RunLock
from .job.program import check_program, importable_from_here, load_program
from .metrics import RayMetrics
from .telemetry.console import Console, ConsoleCallback
from .telemetry.goodput import GoodputCallback
from .telemetry.recorder import FleetRecorder, Recorder, RecorderCallback
from .telemetry.summary import RunSummary, SummaryCallback
from .worker.compile import step_flops


def run_job(
    job: JobSpec,
    *,
    chaos: str | None = None,
    address: str | None = None,
    hosts: int | None = None,
    config: ControllerConfig | None = None,
    printer=None,
    store: FleetStoreConfig | None = FleetStoreConfig(),  # noqa: B008 (frozen)
    cluster_name: str | None = None,
) -> RunSummary:
    """Run `job` to completion on an embedded local cluster (or the Ray cluster at `address`);
    returns the RunSummary. Progress goes to the fleet store `store` (None: nowhere) under the
    cluster's name (`cluster_name`, else $REMESH_CLUSTER, else where it runs)."""
    faults = _faults(chaos, address)
    importable_from_here()
    program = load_program(job.program, job.settings())
    state, batch = check_program(program, job.global_batch, job.seed)
    model_flops = step_flops(program.step, (state, batch))["model_flops"]  # once, for every host's MFU
    config = _with_job_paths(config or ControllerConfig(), job)
    committed = lambda: _committed_step(job.checkpoint.dir)
    run_id = os.environ.get("REMESH_RUN_ID") or f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(2).hex()}"
    with contextlib.ExitStack() as stack:  # unwinds the cluster first, then the console, then the lock
        stack.enter_context(RunLock(job.checkpoint.dir, job=job.name, run=run_id))
        where = _cluster(job, stack, committed() >= job.steps, address, hosts, printer, run_id)
        cluster, printer = where.cluster, where.printer
        plans = PlanCache(job_planner(job, program.step, state, batch, where.layout),
                          program_fingerprint(job.program, state, batch))  # fmt: skip
        keepers, standby = _keepers_and_standby(job, config, where, stack)
        recorder = Recorder()
        if store is not None:
            name = cluster_name or os.environ.get("REMESH_CLUSTER") or _cluster_name(address)
            recorder = FleetRecorder(store.open(), job, cluster=name, metrics=RayMetrics(), step_rows=store.step_rows,
                                     submission=run_id)  # fmt: skip
        goodput = GoodputCallback()
        summary = SummaryCallback(goodput)
        callbacks = [goodput, summary, RecorderCallback(recorder, goodput, summary), ConsoleCallback(printer)]
        chaos_hooks = None
        if faults:
            from .chaos import ChaosCallback

            chaos_callback = ChaosCallback(faults, printer, hosts=where.emulated)
            callbacks.append(chaos_callback)
            chaos_hooks = chaos_callback.probe_hook
        scaling = FleetFollowing(job.hosts.min, where.fleet) if where.fleet is not None else None
        env = {**cluster.host_env(), **config.env_vars}  # (as the controller gives its host actors)
        cluster, scaling = _health(job, cluster, scaling, plans, callbacks, env, chaos_hooks)
        controller = JobController(job, cluster, plans=plans, config=config, callbacks=callbacks, scaling=scaling,
                                   model_flops=model_flops, committed=committed, snapshots=keepers,
                                   standby=standby)  # fmt: skip
        with _stop_on_signals(controller):
            controller.run()
    return summary.summary


def _health(job: JobSpec, cluster, scaling, plans: PlanCache, callbacks: list, env: dict, probe_hooks=None):
    """The health loop, as the job file's `[health]` says: its watches among the callbacks, and
    the cluster and scaling policy the controller gets with it. Hangs are always watched for;
    stragglers as `[health] stragglers` says."""
    watch = StragglerWatch(StragglerConfig(mode=job.health.stragglers))
    hangs = HangWatch(
        os.path.join(os.path.dirname(job.checkpoint.dir), "logs"), printer=lambda line: print(line, flush=True)
    )
    corruption, losses = CorruptionWatch(), LossWatch()
    callbacks += [watch, hangs, corruption, losses]
    quarantine = Quarantine(cluster)
    inner = scaling or ScalingPolicy(job.hosts.min, job.hosts.max)
    predict = lambda d: _predicted(plans, d)  # noqa: E731
    probe = HostProbe(env, probe_hooks or (lambda node: None))
    return quarantine, HealthyScaling(inner, watch, quarantine, predict, job.hosts.min, hangs, corruption, losses,
                                      probe)  # fmt: skip


def _predicted(plans: PlanCache, devices: int) -> float:
    """A plan's predicted step seconds on `devices`; a plan with no price (by shapes alone) scales
    as its devices do."""
    seconds = getattr(getattr(plans.plan(devices).plan, "cost", None), "total_seconds", 0.0)
    return seconds if seconds and seconds > 0 else 1.0 / devices


def job_planner(job: JobSpec, step, state, batch, layout=None):
    """devices -> the plan of the job's step for that many devices, as the job file says to plan;
    `layout`: the slices its groups run on (default: the job file's)."""
    import partitioner

    layout = layout or job.slice_layout()
    steps = partitioner.StepPlanner(step, state, batch)  # traced once, for every device count

    def planner(devices: int):
        slices = layout.slices(devices // job.hosts.devices_per_host)  # a group runs on whole slices
        if job.search_level is None:
            return partitioner.plan_by_shapes(step, state, batch, devices=devices, hardware=job.hardware)
        # No compile check here: the driver's devices are not the cluster's (one CPU device on a
        # real head node, where the check is skipped anyway), and every re-plan is on the
        # recovery path. `remesh plan` shows what the check would choose.
        return steps.plan(
            devices, hardware=job.hardware, level=job.search_level, compile_check=False, slices=slices,
            pipeline=job.pipeline,
        )  # fmt: skip

    return planner


def _faults(chaos: str | None, address: str | None) -> tuple:
    if not chaos:
        return ()
    from .chaos import ANY_CLUSTER, ChaosSpecError, parse_chaos

    faults = parse_chaos(chaos)
    if address and any(f.kind not in ANY_CLUSTER for f in faults):
        raise ChaosSpecError(
            "--chaos lose, add and lose-in-save kill and add emulated hosts, which needs the embedded "
            f"cluster: drop --address (on a running cluster only {', '.join(ANY_CLUSTER)} applies)"
        )
    return faults


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where a job runs: the cluster the controller sees, where its lines go, its slice layout
    (the cluster's, where the hosts say one), and, where there is one, the fleet link whose grant
    it follows (a shared cluster) or the emulated hosts fault injection acts on (embedded)."""

    cluster: Cluster
    printer: Callable[[str], None]
    layout: SliceLayout
    fleet: FleetCluster | None = None
    emulated: EmulatedHosts | None = None


def _cluster(job: JobSpec, stack, finished: bool, address: str | None, hosts: int | None, printer, run_id: str):
    """Where the job runs (`_Where`), the cluster's shutdown on `stack`. On a running cluster
    (`address`) the job registers with the cluster's fleet scheduler, which grants it hosts beside
    the other jobs there (started now if none runs)."""
    if not (finished or address):
        return _embedded(job, stack, hosts, printer)
    printer = printer or (lambda line: print(line, flush=True))
    if finished:  # the controller ends it before asking for hosts
        return _Where(_NoHosts(), printer, job.slice_layout())
    from .hosts.cluster import RayCluster
    from .protocol.fleet import Registration

    RayCluster(address)  # connected: the hosts say their slices
    said = host_slices()
    layout = cluster_layout(job.slice_layout(), said, explicit=job.hosts.hosts_per_slice > 0)
    whole = layout.hosts_per_slice if said and layout.fails_by == "slice" else 0
    low, high = job.hosts.min, min(job.hosts.max, hosts or job.hosts.max)
    registration = Registration(run_id, job.name, job.priority, job.queue, low, high, job.checkpoint.dir, whole)
    fleet = FleetCluster(address, registration)
    stack.callback(fleet.shutdown)
    if not said:
        return _Where(fleet, printer, layout, fleet=fleet)
    sizes = sorted(collections.Counter(said.values()).values())
    printer(f"slices the cluster's hosts say: {len(sizes)} of {', '.join(map(str, sorted(set(sizes))))} hosts"
            + (" (a host lost takes its slice)" if whole else ""))  # fmt: skip
    return _Where(SlicedCluster(fleet, layout), printer, layout, fleet=fleet)


def _embedded(job: JobSpec, stack, hosts: int | None, printer) -> _Where:
    """An embedded cluster of `hosts` (default: the job's most) emulated hosts; Ray's own output
    goes to a log file beside the checkpoints when no printer is given."""
    from .hosts.cluster import LocalClusterConfig

    if printer is None:
        log = os.path.join(os.path.dirname(job.checkpoint.dir), "logs", f"{job.name}.ray.log")
        printer = stack.enter_context(Console(log)).print
        printer(f"ray   Ray's own output goes to {os.path.relpath(log)}")
    n, layout = hosts or job.hosts.max, job.slice_layout()
    per = layout.hosts_per_slice
    printer(f"start embedded Ray cluster: {n} hosts x {job.hosts.devices_per_host} fake CPU devices"
            + (f", {layout.slices(n)} slices of {per}" if per else ""))  # fmt: skip
    local = LocalClusterConfig(hosts=n, devices_per_host=job.hosts.devices_per_host, hosts_per_slice=per).create()
    stack.callback(local.shutdown)
    cluster = SlicedCluster(local, layout) if per is not None else local
    return _Where(cluster, printer, layout, emulated=local)


def _keepers_and_standby(job: JobSpec, config: ControllerConfig, where: _Where, stack):
    """The keepers of peer snapshots (they start only when a group asks for them), and the pool
    of standby actors: only on a cluster of its own, since standby actors hold no host resource
    and on a shared cluster two jobs could take the same hosts; there each group is gang-scheduled
    by a placement group that reserves them (and a recovery spawns its actors)."""
    if isinstance(where.cluster, _NoHosts):
        return None, None
    from .hosts.keepers import Keepers, KeepersConfig
    from .hosts.standby import StandbyPool

    keepers = Keepers(KeepersConfig(env_vars=dict(config.env_vars)))
    stack.callback(keepers.shutdown)  # before the cluster goes
    if where.fleet is not None:
        return keepers, None
    standby = StandbyPool(modules=(job.program.split(":")[0],))
    stack.callback(standby.shutdown)
    return keepers, standby


def _with_job_paths(config: ControllerConfig, job: JobSpec) -> ControllerConfig:
    pythonpath = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    return dataclasses.replace(
        config,
        env_vars={"PYTHONPATH": pythonpath, **config.env_vars},
        compilation_cache=config.compilation_cache or os.path.join(os.path.dirname(job.checkpoint.dir), "xla-cache"),
    )


def _cluster_name(address: str | None) -> str:
    if address and address != "auto":
        return address
    return f"{'ray' if address else 'embedded'}@{socket.gethostname()}"


def _committed_step(directory: str) -> int:
    """The newest committed checkpoint step in `directory` (0: none)."""
    from checkpoint import Store

    steps = Store(directory).steps()
    return steps[-1] if steps else 0


class _NoHosts(Cluster):
    """The cluster of a job that is already complete: nothing to start or stop."""

    def alive_hosts(self) -> list[str]:
        return []

    def shutdown(self) -> None:
        pass


@contextlib.contextmanager
def _stop_on_signals(controller: JobController):
    """SIGTERM (`remesh stop`, Kubernetes, `timeout`) and SIGINT (Ctrl-C) stop the job through the
    controller: a training group saves the step it reached and ends; a second signal, or one while
    no group trains, stops at once. Installed after Ray connects, whose own SIGTERM handler would
    end the process on the spot; the previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        controller.request_stop(f"stopped by signal {signal.Signals(signum).name}")

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
