"""One segment of one process: join the group, load, compile beside the restore, train.

`run_segment` is a plain function so that it runs the same under a Ray host actor, in a bare
process on a GPU machine without Ray (`python -m orchestrator.worker`), or in a test. It binds the
plan to this group's devices, restores the newest committed checkpoint onto the plan's shardings
(or a peer snapshot, or initialises), and trains until the job's last step or until the
controller asks it to stop. Everything it does is reported as `protocol` reports through `report`.

The loop itself (`_train`) reads a batch, dispatches the step and runs the hooks after it
(hooks.py); saves, peer snapshots, evaluation and compiling ahead are hooks in modules of their
own, the stop agreement a component beside them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time
from collections.abc import Callable

from ..job.data import DataPosition, HostBatches
from ..protocol import CheckpointFlush, Compile, GroupStart, Load, LoopAt, SegmentSpec, Step, Stop
from .agreement import StopAgreement
from .compile import AheadHook, DigestProgram, Executables, sharded, step_flops
from .evaluation import EvalHook
from .hooks import FaultHook, Hook, StepDispatched, closing, load_fault_hook
from .inputs import Prefetch, batches
from .laps import Deferred, Laps, Reporter
from .process import compile_once, start_group
from .progress import Progress
from .replicas import ReplicaCheck
from .restore import Restored, restore_or_init
from .saves import SaveHook, Saves
from .scalars import scalar_metrics
from .snapshots import SnapshotHook, SnapshotPace


def run_segment(
    spec: SegmentSpec,
    report: Reporter,
    should_stop: Callable[[], Stop] = lambda: Stop.RUN,
    peers=None,
    ahead: Callable[[], str | None] = lambda: None,
    executables: dict | None = None,
    progress: Progress | None = None,
) -> dict:
    """Train one segment. `peers`: where peer snapshots go and the one to restore comes from
    (`hosts.keepers.PeerSnapshots`, or anything with its `offer` and `restore_step`); None where
    there is none (a plain process without Ray). `ahead`: a plan (JSON) for a smaller mesh to
    compile beside training (`compile.compile_ahead`), or None; asked between steps, on process 0
    only. `executables`: what an earlier group compiled ahead (`CompileAhead.executables`), used
    if it was compiled for this segment's plan. `progress`: where the loop is, marked each step
    (`progress.Progress`), for whoever answers the controller's polls."""
    import jax

    fault = load_fault_hook(spec.test_hook, report)
    lap = Laps(report)
    fault.entering("start")
    start_group(spec)
    lap(GroupStart, devices=jax.device_count())
    loaded = _Loaded.load(spec)
    lap(Load)
    programs, restored = _compile_beside_restore(loaded, spec, lap, fault, peers, executables)
    return _train(loaded, programs, restored, spec, lap, report, should_stop, peers, ahead, fault,
                  progress or Progress())  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Loaded:
    """The program, its abstract inputs, the plan bound to this group's devices, and the store."""

    program: object
    abstract_state: object
    abstract_batch: object
    plan: object
    mesh: object
    state_shardings: object
    batch_shardings: object
    store: object

    @classmethod
    def load(cls, spec: SegmentSpec) -> _Loaded:
        import jax

        from checkpoint import StoreConfig
        from partitioner import Plan

        from ..job.program import JobSettings, abstract_inputs, load_program

        program = load_program(spec.program, JobSettings(spec.steps, spec.global_batch, spec.seed, spec.options))
        abstract_state, abstract_batch = abstract_inputs(program, spec.global_batch, spec.seed)
        plan = Plan.from_json(spec.plan_json)
        mesh = plan.bind(jax.devices())
        config = StoreConfig(keep_last=spec.checkpoint.keep, keep_every=spec.checkpoint.keep_every or None)
        return cls(
            program,
            abstract_state,
            abstract_batch,
            plan,
            mesh,
            plan.shardings(mesh, abstract_state, argnum=0),
            plan.shardings(mesh, abstract_batch, argnum=1),
            config.create(spec.checkpoint.dir),
        )

    @property
    def inputs(self) -> tuple:
        return self.abstract_state, self.abstract_batch


@dataclasses.dataclass(frozen=True)
class _Programs:
    step: object
    evaluation: object | None
    digest: DigestProgram
    model_flops: float


def _compile_beside_restore(loaded: _Loaded, spec, lap: Laps, fault: FaultHook, peers, executables):
    """Compile (or load, compiled ahead) the step and the evaluation while another thread
    restores the state: the restore needs none of the programs. Its laps are taken once the
    compile's is, so laps stay back to back: a restore's holds what it took beyond the compile."""
    import jax

    program, devices = loaded.program, jax.devices()
    target = sharded(loaded.abstract_state, loaded.state_shardings)
    shared = lambda lowered: compile_once(lowered, spec)  # compiled once for the whole group
    prepared = Executables(executables, spec, loaded.mesh)
    digest = DigestProgram(target, shared, spec.digest, prepared)
    if peers is not None and spec.segment > 0:
        digest.start()  # a group after the first likely restores a snapshot: beside the step's compile
    fault.entering("compile")
    restoring, deferred = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="remesh-restore"), Deferred()

    def restore() -> Restored:
        fault.entering("restore")
        key = jax.random.key(spec.seed)
        return restore_or_init(loaded.store, program, key, target, digest, spec.global_batch, deferred, peers,
                               spec.restore_at_most)  # fmt: skip

    restored = restoring.submit(restore)
    plan_jit, as_planned = loaded.plan.jit, loaded.plan.program
    step_fn = plan_jit(as_planned(program.step), loaded.inputs, devices, carry={0: 0}, donate_argnums=(0,))
    compiled = prepared.get("step", lambda: shared(step_fn.lower(*loaded.inputs)))
    evaluated = None
    if program.evaluation is not None:
        eval_fn = plan_jit(
            as_planned(program.evaluation.step, required=False), loaded.inputs, devices, replicated_outputs=True
        )
        evaluated = prepared.get("evaluation", lambda: shared(eval_fn.lower(*loaded.inputs)))
    flops = step_flops(program.step, loaded.inputs, compiled, model_flops=spec.model_flops)
    lap(Compile, loaded=list(prepared.loaded), load_failed=list(prepared.failed), **flops)
    state = restored.result()
    restoring.shutdown()
    deferred.replay(lap)
    return _Programs(compiled, evaluated, digest, flops["model_flops"]), state


class StepReports:
    """Steps dispatched whose metrics are read back after the next step is dispatched, so the
    device is never idle while the host waits for them. A step's report holds the input waits
    (`waited`), peer-snapshot copies (`copied`) and the time blocked on the devices and the peers
    (`blocked`: dispatching a step, reading one back, agreeing on a stop) since the report before
    it."""

    def __init__(self, lap: Laps, tokens: int, model_flops: float, peak: float, on_step: Callable[[Step], None]):
        self._lap, self._tokens, self._flops, self._peak, self._on_step = lap, tokens, model_flops, peak, on_step
        self._pending: tuple | None = None  # (step, metrics on the devices, snapshot interval)
        self.seconds = 0.0  # the last step's time, read back
        self.waited = 0.0
        self.copied = 0.0
        self.blocked = 0.0

    def dispatched(self, step: int, metrics, snapshot_every: int) -> None:
        self.read_back()
        self._pending = (step, metrics, snapshot_every)

    def read_back_seconds(self) -> float:
        """`read_back`, then the time of the step read back."""
        self.read_back()
        return self.seconds

    def read_back(self) -> None:
        """Wait for the dispatched step's metrics and report it."""
        if self._pending is None:
            return
        import jax

        (step, metrics, snapshot_every), self._pending = self._pending, None
        t = time.time()
        values = scalar_metrics(jax.device_get(metrics))
        self.blocked += time.time() - t
        seconds, now = self._lap.split()
        waited = min(self.waited, seconds)
        copied = min(self.copied, max(seconds - waited, 0.0))
        # SPMD hosts finish each step together, so step time alone cannot tell a straggler; the
        # time each host spent blocked on the devices and its peers can (in dispatch or in the
        # read-back, as the backend decides where): the straggler waits least, the others for it.
        report = self._lap(
            Step,
            now=now,
            step=step,
            loss=values.pop("loss"),
            metrics=values,
            tokens_per_second=self._tokens / seconds,
            mfu=self._flops / (seconds * self._peak),
            input_seconds=waited,
            snapshot_seconds=copied,
            wait_seconds=min(self.blocked, max(seconds - waited - copied, 0.0)),
            snapshot_every=snapshot_every,
        )
        self.seconds, self.waited, self.copied, self.blocked = report.seconds, 0.0, 0.0, 0.0
        self._on_step(report)


def _train(
    loaded: _Loaded, programs: _Programs, restored: Restored, spec, lap, report, should_stop, peers, ahead, fault,
    progress: Progress,
):  # fmt: skip
    from partitioner import profile

    position = DataPosition(spec.global_batch, *restored.position)
    saves = Saves(loaded.store, report, spec.checkpoint.dir)
    pace = SnapshotPace(spec.checkpoint.snapshot_time_share, peers, fixed=spec.checkpoint.snapshot_every)
    replicas = ReplicaCheck(_replica_program(loaded, spec), sharded(loaded.abstract_state, loaded.state_shardings),
                            spec.digest_every, restored.meta.data_position, report,
                            agreed=lambda: agreement.replica_every)  # fmt: skip
    agreement = StopAgreement(
        should_stop, spec.num_processes, propose_snapshots=lambda: pace.interval, propose_digest=programs.digest.ready,
        propose_replica_every=lambda: replicas.measured,
    )  # fmt: skip
    # MFU: the program's FLOPs over what the devices the plan uses could do in the step's time.
    peak = loaded.plan.devices_used * profile(spec.hardware).peak_flops
    tokens = spec.global_batch * loaded.program.tokens_per_example

    def on_step(step: Step) -> None:
        saves.step_done(step)
        programs.digest.start()  # once a step is done: beside training, not beside a segment's first step

    reports = StepReports(lap, tokens, programs.model_flops, peak, on_step)
    hooks: list[Hook] = []
    if loaded.program.evaluation is not None:
        held_out = HostBatches(loaded.program.evaluation.data, DataPosition(spec.global_batch),
                               loaded.batch_shardings, loaded.abstract_batch)  # fmt: skip
        hooks.append(EvalHook(programs.evaluation, held_out, loaded.program.evaluation, lap))
    hooks.append(replicas)  # (before the save and the snapshot: what it finds corrupt is neither)
    hooks.append(SaveHook(saves, loaded.plan, programs.digest, position, spec, fault, lap))
    hooks.append(AheadHook(ahead, loaded.program, loaded.abstract_state, loaded.abstract_batch, spec, report))
    hooks.append(SnapshotHook(peers, pace, position, spec, programs.digest, lambda: agreement.digest_ready))
    data = batches(loaded.program, position, loaded.batch_shardings, loaded.abstract_batch)
    inputs = Prefetch(data, restored.meta.data_position, spec.steps)
    try:
        with closing(hooks):  # the save in flight settles there
            reached = _loop(programs.step, restored, spec, inputs, reports, agreement, hooks, fault, saves.unsaved,
                            progress)  # fmt: skip
    finally:
        inputs.close()
        programs.digest.close()
    lap(CheckpointFlush, step=reached)
    return {"last_step": reached}


def _replica_program(loaded: _Loaded, spec) -> Callable:
    """The replicas' comparison program, compiled once, when first asked for."""
    import functools

    from ..job.replicas import compile_replica_sums

    target = sharded(loaded.abstract_state, loaded.state_shardings)
    return functools.cache(lambda: compile_replica_sums(target, lambda lowered: compile_once(lowered, spec)))


def _loop(step_fn, restored: Restored, spec, inputs: Prefetch, reports: StepReports, agreement, hooks, fault,
          unsaved=lambda upto: [], progress: Progress | None = None) -> int:  # fmt: skip
    """Train from the restored step to the job's last, or until a stop ends the segment; returns
    the step reached. `unsaved(step)`: the records of the steps past the newest commit."""
    first = reached = restored.meta.data_position
    state = restored.state
    progress = progress or Progress()
    for index in range(first, spec.steps):
        t_input = time.time()
        batch = fault.batch(index + 1, inputs.take(index))
        fault.input_read(index + 1)
        t_dispatch = time.time()
        reports.waited += t_dispatch - t_input
        progress.mark(index + 1, LoopAt.DISPATCHING)
        fault.dispatching(index + 1)
        state, metrics = step_fn(state, batch)
        progress.mark(index + 1, LoopAt.DISPATCHED)
        reports.blocked += time.time() - t_dispatch
        state = fault.corrupt(index + 1, state)
        reports.dispatched(index + 1, metrics, agreement.snapshot_every)
        reached = index + 1
        fault.step_work(reached, reports.read_back_seconds)
        done = StepDispatched(reached, state, boundary=reached % spec.checkpoint.every == 0 or reached == spec.steps,
                              last=reached == spec.steps, read_back=reports.read_back_seconds, unsaved=unsaved)  # fmt: skip
        if index == first or any(h.wants_state(reached, done.boundary) for h in hooks):
            # Read back now: the next step would donate the state a hook needs, and an evaluation's
            # time is its own only with the step done. Before the agreement, whose first broadcast
            # compiles: a step is reported as soon as it is done. A segment's first step likewise:
            # it ends a recovery, which is over once that step is done, not once the next one is
            # dispatched.
            reports.read_back()
        t_agree = time.time()
        done.stop = agreement.agree(reached, done.boundary, reports.seconds)
        reports.blocked += time.time() - t_agree  # (a collective of the hosts: waiting for the slowest)
        if done.stop is Stop.NOW:  # likewise, before the save of the step reached
            reports.read_back()
        done.step_seconds, done.snapshot_every = reports.seconds, agreement.snapshot_every  # known once agreed
        for hook in hooks:
            hook.after_step(done)
        reports.copied += done.copied
        if done.ends_segment:
            break
    return reached


def main(argv: list[str] | None = None) -> int:
    """Run one segment without Ray: `python -m orchestrator.worker SPEC.json` (prints reports)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("spec", help="SegmentSpec as JSON (a file path)")
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        spec = SegmentSpec.from_json(f.read())
    run_segment(spec, lambda r: print(json.dumps(r.to_dict()), flush=True))
    return 0
