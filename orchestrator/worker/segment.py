"""The per-host SPMD worker: one process of one `jax.distributed` group, training one segment.

`run_segment` is a plain function so that it runs the same under a Ray host actor, in a bare
process on a GPU machine without Ray (`python -m orchestrator.worker`), or in a test. It binds the
plan to this group's devices, restores the newest committed checkpoint onto the plan's shardings
(or initialises), and trains until the job's last step or until the controller asks it to stop at a
checkpoint boundary. Everything it does is reported as small dicts through `report`.

Process set-up (`XLA_FLAGS` for fake devices, `JAX_PLATFORMS`) must happen before jax is imported,
so it belongs to whoever starts the process, never to this module.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import functools
import hashlib
import json
import math
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..job.data import DataPosition
from ..job.digest import KIND as DIGEST_KIND
from ..job.digest import compile_digest, digest, digest_later
from ..job.jobfile import CheckpointSpec
from ..telemetry.recorder import STEP_FIELDS as REPORTED_FIELDS
from ..testing.chaos import SLOW_INPUT_SECONDS

Report = Callable[[dict], None]


class RestoredStateMismatchError(ValueError):
    """A restored state differs from the state that was saved."""


class CheckpointSaveError(RuntimeError):
    """Saves failed `MAX_FAILED_SAVES` times in a row: training on would risk more than it keeps."""


MAX_FAILED_SAVES = 3
MAX_UNSAVED_REPORTS = 1024  # step reports kept for the next checkpoint's metadata


@dataclasses.dataclass(frozen=True)
class SegmentSpec:
    """Everything one process needs to run one segment; plain data, so it crosses Ray and JSON."""

    program: str
    steps: int
    global_batch: int
    seed: int
    checkpoint: CheckpointSpec
    plan_json: str
    coordinator: str
    num_processes: int
    process_id: int
    segment: int = 0
    digest: bool = True  # record a digest of the state at every save, check it at restore (digest.py)
    freeze_before_save: int | None = None  # fault injection: hang instead of saving this step
    freeze_in: str | None = None  # fault injection: hang as this phase begins (chaos.PHASES)
    slow_input_from: int | None = None  # fault injection: a straggler's slow input from this step on
    compilation_cache: str | None = None
    fingerprint: str = ""  # of the program and its abstract inputs; saved with every checkpoint
    hardware: str = "cpu"  # profile whose peak FLOP/s MFU is measured against
    job: str = ""  # the job's name, for labels
    model_flops: float | None = None  # of one step (step_flops), counted once by the controller; None: count here
    options: dict = dataclasses.field(default_factory=dict)  # the job file's [options], for a program factory

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SegmentSpec:
        d = json.loads(text)
        d["checkpoint"] = CheckpointSpec(**d["checkpoint"])
        return cls(**d)


def start_group(spec: SegmentSpec) -> None:
    """Join this process to its `jax.distributed` group (Gloo on CPU; NCCL on GPUs)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if spec.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", spec.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        _process_invariant_cpu_cache_keys()
    if spec.num_processes > 1:
        if spec.process_id != 0:
            _wait_for_coordinator(spec.coordinator, timeout_s=60)
        jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id, initialization_timeout=60)


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Wait until process 0's coordination service accepts connections. A client that dials it
    before it listens backs off for about a second before dialling again, which was the group
    start's time whenever process 0 came up last."""
    import socket

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.01)
    # jax.distributed.initialize reports an unreachable coordinator itself, with its own timeout


def _process_invariant_cpu_cache_keys() -> None:
    """Make compilation-cache keys of multi-process CPU programs equal on every process.

    JAX keys the cache partly on XLA's topology fingerprint, which on CPU differs between the
    processes of one group although they compile the same SPMD program; so no process can reuse
    another's executable. On CPU, key on each device's kind, global id and process instead
    (the device assignment itself is already in the compile options). Other platforms keep
    JAX's own key. Idempotent; installed at process set-up, never at import."""
    from jax._src import cache_key

    original = getattr(cache_key._hash_accelerator_config, "__wrapped__", cache_key._hash_accelerator_config)

    def hash_accelerator_config(hash_obj, accelerators):
        if all(d.platform == "cpu" for d in accelerators.flat):
            for d in accelerators.flat:
                hash_obj.update(f"{d.device_kind}/{d.id}/{d.process_index};".encode())
        else:
            original(hash_obj, accelerators)

    hash_accelerator_config.__wrapped__ = original
    cache_key._hash_accelerator_config = hash_accelerator_config


def _compile_once(lowered, spec: SegmentSpec):
    """One process compiles the step and hands the executable to the others via the coordinator,
    instead of every host compiling the same SPMD program (hosts that share cores, as emulated
    hosts do, would each take n times as long). Scoped to this compile: Orbax compiles helpers on
    some processes only, and those must never wait for a peer."""
    from jax._src import config as jax_config

    if not spec.compilation_cache or spec.num_processes == 1:
        return lowered.compile()
    with jax_config.share_binary_between_hosts(True):
        return lowered.compile()


class _Laps:
    """Back-to-back laps of wall-clock time: every report says how long since the previous one
    and when it ended, so a host's reports cover its whole segment without gaps (goodput.py)."""

    def __init__(self, report: Report):
        self._report = report
        self._last = time.time()

    def split(self) -> tuple[float, float]:
        """(seconds since the previous lap, now): to derive figures from before reporting them."""
        now = time.time()
        return now - self._last, now

    def __call__(self, kind: str, *, now: float | None = None, **fields) -> dict:
        now = time.time() if now is None else now
        report = {"kind": kind, "seconds": now - self._last, "at": now, **fields}
        self._report(report)
        self._last = now
        return report


@dataclasses.dataclass
class _Dispatched:
    """A step dispatched to the devices whose metrics are not yet read back."""

    step: int
    metrics: Any
    snapshot_every: int = 0  # the peer snapshot interval agreed when it was dispatched

    def read_back(
        self, lap: _Laps, tokens: int, model_flops: float, peak: float, waited: float, copied: float = 0.0
    ) -> dict:
        """Wait for the step's metrics and report it; returns the report. `waited`: the time spent
        waiting for input since the last step report, which this report's lap holds; `copied`: the
        time the loop was held copying a peer snapshot to the host, which it holds too."""
        import jax

        values = scalar_metrics(jax.device_get(self.metrics))
        seconds, now = lap.split()
        # SPMD hosts finish each step together, so step time alone cannot tell a straggler; what
        # each host waited for besides its input can (blocked in dispatch or in the read-back, as
        # the backend decides where): the straggler waits least, the others for it.
        return lap(
            "step",
            now=now,
            step=self.step,
            loss=values.pop("loss"),
            metrics=values,
            tokens_per_second=tokens / seconds,
            mfu=model_flops / (seconds * peak),
            input_seconds=min(waited, seconds),
            snapshot_seconds=min(copied, max(seconds - waited, 0.0)),
            wait_seconds=max(seconds - waited - copied, 0.0),
            snapshot_every=self.snapshot_every,
        )


def _evaluate(compiled, state, held_out, batches: int, lap: _Laps, step: int) -> None:
    """The program's evaluation after `step`, reported as an "eval" lap: the mean of each metric
    over the held-out batches."""
    import jax

    results = [scalar_metrics(jax.device_get(compiled(state, held_out(b)))) for b in range(batches)]
    mean = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
    lap("eval", step=step, loss=mean.pop("loss"), metrics=mean)


class _Digest:
    """The state digest's compiled program (digest.py), compiled once per group when first needed
    (a restore from disk, a save) or when `start`ed after the first step is done, in a thread
    beside training: off the path from a new group's start to its first step unless that step
    restores from disk."""

    def __init__(self, target, compile, enabled: bool, prepared: _Prepared | None = None):
        self._target, self._compile, self.enabled = target, compile, enabled
        self._prepared = prepared
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="remesh-digest")
        self._future: concurrent.futures.Future | None = None

    def start(self) -> None:
        if self.enabled and self._future is None:
            compile = functools.partial(compile_digest, self._target, self._compile)
            make = functools.partial(self._prepared.get, "digest", compile) if self._prepared else compile
            self._future = self._pool.submit(make)

    def get(self):
        self.start()
        return self._future.result() if self._future else None

    def ready(self) -> bool:
        """Compiled already: `get` returns without waiting."""
        return self._future is not None and self._future.done() and self._future.exception() is None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class Stop(enum.IntEnum):
    """What the controller asked of a running segment."""

    NO = 0
    AT_CHECKPOINT = 1  # finish the segment at the next checkpoint boundary (a resize)
    NOW = 2  # save the step reached and finish (a stop or a preemption)


class StopAgreement:
    """Makes every process of the group stop after the same step, and take peer snapshots after
    the same steps.

    A request reaches each host at a different moment, so it is acted on only at steps that all
    processes agree to check, by one small broadcast from process 0: every checkpoint boundary, and
    in between about every `check_seconds` of steps (process 0 proposes the interval with the
    flag), so the collective costs a bounded share of step time however short the steps are. The
    same broadcast carries process 0's snapshot interval (`propose_snapshots`, measured by its
    `_SnapshotPace`): a snapshot is complete only if every process takes it at the same step."""

    def __init__(
        self,
        should_stop: Callable[[], Stop],
        processes: int,
        check_seconds: float = 0.5,
        propose_snapshots: Callable[[], int] = lambda: 0,
    ):
        self._should_stop = should_stop
        self._processes = processes
        self._check_seconds = check_seconds
        self._propose_snapshots = propose_snapshots
        self.snapshot_every = 0  # agreed: snapshot after steps divisible by this (0: none yet)
        # The next step to check at. Not a segment's first step: the broadcast's own first run
        # compiles a small program, which would delay the step a recovery waits for.
        self._next: int | None = None

    def agree(self, step: int, boundary: bool, step_seconds: float) -> Stop:
        if self._processes == 1:
            self.snapshot_every = self._propose_snapshots()
            return self._should_stop()
        if self._next is None:
            self._next = step + 1
        if not (boundary or step >= self._next):
            return Stop.NO
        import numpy as np
        from jax.experimental import multihost_utils

        interval = max(1, int(self._check_seconds / max(step_seconds, 1e-6)))
        proposal = np.array([int(self._should_stop()), interval, self._propose_snapshots()], np.int32)
        agreed = multihost_utils.broadcast_one_to_all(proposal)
        self._next = step + int(agreed[1])
        self.snapshot_every = int(agreed[2])
        return Stop(int(agreed[0]))


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Every scalar a step returned, by slash path (`aux/z_loss`); arrays are left out (a step
    that returns none but its loss reports only the loss)."""
    import jax
    import numpy as np

    from checkpoint import leaf_path

    leaves = jax.tree_util.tree_flatten_with_path(metrics)[0]
    return {leaf_path(path): float(value) for path, value in leaves if np.ndim(value) == 0}


class _SnapshotPace:
    """How often to take a peer snapshot: after every step whose copy to the host fits the budget
    (a share of step time), measured as it goes: a copy (with any wait for queued sends) taking
    `c` seconds beside steps of `t` seconds is taken every `ceil(c / (budget * t))` steps.
    Process 0's interval is the group's (`StopAgreement`)."""

    def __init__(self, budget: float, memory, window: int = 5):
        self.interval = 1 if memory is not None and budget > 0 else 0  # 0: never
        self._budget = budget
        self.index: dict | None = None  # the snapshot index, made by the first take
        # The medians of the last few: one copy slowed by something else (a compile beside
        # training) does not stretch the interval for long.
        self._copies: collections.deque = collections.deque(maxlen=window)
        self._steps: collections.deque = collections.deque(maxlen=window)

    def took(self, copy_seconds: float, step_seconds: float) -> None:
        if not self.interval or step_seconds <= 0:
            return
        self._copies.append(copy_seconds)
        self._steps.append(step_seconds)
        copy, step = statistics.median(self._copies), statistics.median(self._steps)
        self.interval = max(1, math.ceil(copy / (self._budget * step)))


def _snapshot(
    memory, state, step: int, examples_seen: int, spec: SegmentSpec, pace: _SnapshotPace, digest_fn, reports
) -> float:
    """Copy this process's shards of the state after `step` to the host and hand them to `memory`
    (sent in the background); returns the seconds the copy held the training loop. With the
    state's digest once its program is compiled (never waited for here): a restore checks it;
    and with the step reports since the newest commit (`reports`), which a restore hands back."""
    import jax

    from checkpoint import take_snapshot

    jax.block_until_ready(state)  # the step's own time is not the copy's
    t = time.perf_counter()
    pace.index, arrays = take_snapshot(state, pace.index)
    meta = {
        "data_position": step,
        "examples_seen": examples_seen,
        "segment": spec.segment,
        "step": step,
        "reports": reports,
    }
    # The digest is dispatched now and read by the send thread: the loop does not wait for it.
    later = digest_later(digest_fn.get(), state) if digest_fn.ready() else None
    memory.offer(step, pace.index, arrays, meta, later)  # waits only while two earlier ones are queued
    return time.perf_counter() - t


def _sharded(abstract, shardings):
    """`abstract`'s shapes and dtypes carrying `shardings`: a restore's or a compile's target."""
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)


def plan_key(plan_json: str) -> str:
    """Names the plan that executables compiled ahead were compiled for."""
    return hashlib.sha256(plan_json.encode()).hexdigest()[:16]


class _ThreadCompiles(threading.local):
    """This thread's XLA compiles and persistent-cache hits, counted from JAX's monitoring events."""

    compiles = 0
    hits = 0


_compiles = _ThreadCompiles()


@functools.cache  # once per process: registered twice, both counts would still only grow together
def _listen() -> None:
    import jax
    from jax._src.dispatch import BACKEND_COMPILE_EVENT

    def compiled(event: str, duration: float, **_) -> None:
        if event == BACKEND_COMPILE_EVENT:
            _compiles.compiles += 1

    def hit(event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            _compiles.hits += 1

    jax.monitoring.register_event_duration_secs_listener(compiled)
    jax.monitoring.register_event_listener(hit)


def _fresh(lowered):
    """`lowered` compiled and serialised, or None where the executable is not a fresh compile (a
    persistent-cache hit, or JAX's in-memory cache): on XLA:CPU an executable loaded from the
    cache and serialised again fails when run ("Function ... not found"), and the cache's
    switch cannot be turned off for one thread once the process has used the cache."""
    from jax.experimental.serialize_executable import serialize

    compiles, hits = _compiles.compiles, _compiles.hits
    compiled = lowered.compile()
    return serialize(compiled) if _compiles.compiles > compiles and _compiles.hits == hits else None


def _compile_ahead(plan_json: str, program, abstract_state, abstract_batch, spec: SegmentSpec, report: Report):
    """Compile the step, the evaluation and the digest for a mesh this group may shrink to, and
    report them serialised (`executables`): the group that runs that plan loads them instead of
    tracing, lowering and compiling.

    The smaller mesh's plan is bound to this group's first devices, which are the devices (global
    ids and processes) a group of that many hosts would have. Only fresh compiles are handed over
    (`_fresh`); a program the persistent cache held is left out, and the group loads it from
    there as it would have anyway. Process 0 alone compiles, in a thread beside training; a
    failure is reported, never raised into the training loop."""
    import jax

    from partitioner import Plan

    t = time.perf_counter()
    try:
        _listen()
        plan = Plan.from_json(plan_json)
        devices = jax.devices()
        step_fn = plan.jit(program.step, (abstract_state, abstract_batch), devices, carry={0: 0}, donate_argnums=(0,))
        executables = {"plan": plan_key(plan_json), "step": _fresh(step_fn.lower(abstract_state, abstract_batch))}
        if program.evaluation is not None:
            fn = plan.jit(program.evaluation.step, (abstract_state, abstract_batch), devices, replicated_outputs=True)
            executables["evaluation"] = _fresh(fn.lower(abstract_state, abstract_batch))
        if spec.digest:
            shardings = plan.shardings(plan.bind(devices), abstract_state, argnum=0)
            executables["digest"] = compile_digest(_sharded(abstract_state, shardings), _fresh)
        executables = {k: v for k, v in executables.items() if v is not None}
        seconds = time.perf_counter() - t
        report({"kind": "compile_ahead", "devices": plan.devices_used, "seconds": seconds, "executables": executables})
    except Exception as e:  # noqa: BLE001 (anything: the segment trains on regardless)
        report({"kind": "compile_ahead", "seconds": time.perf_counter() - t, "error": f"{type(e).__name__}: {e}"})


class _Prepared:
    """Executables compiled ahead for this segment's plan (`_compile_ahead`), loaded in place of
    a compile; a program not among them, or one that fails to load, is compiled as usual."""

    def __init__(self, executables: dict | None, spec: SegmentSpec, mesh):
        ours = executables is not None and executables.get("plan") == plan_key(spec.plan_json)
        self._executables = executables if ours else {}
        self._devices = tuple(mesh.devices.flat)  # the plan's, which may be fewer than the process has
        self.loaded: list[str] = []  # the programs loaded, for the compile report
        self.failed: list[str] = []

    def get(self, name: str, compile: Callable[[], Any]):
        if name in self._executables:
            from jax.experimental.serialize_executable import deserialize_and_load

            try:
                loaded = deserialize_and_load(*self._executables[name], execution_devices=self._devices)
                self.loaded.append(name)
                return loaded
            except Exception as e:  # noqa: BLE001 (any load failure: compile instead)
                self.failed.append(f"{name}: {type(e).__name__}: {e}"[:500])
        return compile()


def run_segment(
    spec: SegmentSpec,
    report: Report,
    should_stop: Callable[[], Stop] = lambda: Stop.NO,
    memory=None,
    ahead: Callable[[], str | None] = lambda: None,
    executables: dict | None = None,
) -> dict:
    """Train one segment. `memory`: where peer snapshots go and the one to restore comes from
    (`snapshots.PeerSnapshots`, or anything with its `offer` and `restore_step`); None
    where there is none (a plain process without Ray). `ahead`: a plan (JSON) for a smaller mesh
    to compile beside training (`_compile_ahead`), or None; asked between steps, on process 0
    only. `executables`: what an earlier group compiled ahead (`_compile_ahead`'s report), used
    if it was compiled for this segment's plan."""
    import jax

    from checkpoint import StoreConfig
    from partitioner import Plan, profile

    from ..job.program import JobSettings, abstract_inputs, load_program

    lap = _Laps(report)
    _maybe_hang(spec, "start", report)
    start_group(spec)
    lap("group_start", devices=jax.device_count())

    program = load_program(spec.program, JobSettings(spec.steps, spec.global_batch, spec.seed, spec.options))
    abstract_state, abstract_batch = abstract_inputs(program, spec.global_batch, spec.seed)

    plan = Plan.from_json(spec.plan_json)
    mesh = plan.bind(jax.devices())
    key = jax.random.key(spec.seed)
    state_sh = plan.shardings(mesh, abstract_state, argnum=0)
    batch_sh = plan.shardings(mesh, abstract_batch, argnum=1)

    store = StoreConfig(keep_last=spec.checkpoint.keep, keep_every=spec.checkpoint.keep_every or None).create(
        spec.checkpoint.dir
    )
    lap("load")

    target = _sharded(abstract_state, state_sh)
    step_fn = plan.jit(program.step, (abstract_state, abstract_batch), jax.devices(), carry={0: 0}, donate_argnums=(0,))
    share = lambda lowered: _compile_once(lowered, spec)
    prepared = _Prepared(executables, spec, mesh)
    digest_fn = _Digest(target, share, spec.digest, prepared)
    if memory is not None and spec.segment > 0:
        digest_fn.start()  # a group after the first likely restores a snapshot: beside the step's compile
    _maybe_hang(spec, "compile", report)
    # The restore needs none of the programs: it runs beside their compile (or load). Its laps are
    # taken once the compile's is, so laps stay back to back: a restore's holds what it took
    # beyond the compile (and says what it took in all).
    restoring, deferred = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="remesh-restore"), _Deferred()
    restored = restoring.submit(_restore_beside, store, program, key, target, digest_fn, spec, deferred, memory, report)
    compiled = prepared.get("step", lambda: share(step_fn.lower(abstract_state, abstract_batch)))
    evaluation = program.evaluation
    if evaluation is not None:
        eval_fn = plan.jit(evaluation.step, (abstract_state, abstract_batch), jax.devices(), replicated_outputs=True)
        eval_compiled = prepared.get("evaluation", lambda: share(eval_fn.lower(abstract_state, abstract_batch)))
    flops = step_flops(program.step, (abstract_state, abstract_batch), compiled, model_flops=spec.model_flops)
    lap("compile", loaded=list(prepared.loaded), load_failed=list(prepared.failed), **flops)

    state, first, first_example = restored.result()
    restoring.shutdown()
    deferred.replay(lap)
    position = DataPosition(spec.global_batch, first, first_example)
    batches = _batches(program, position, batch_sh, abstract_batch)
    if evaluation is not None:
        from ..job.data import HostBatches

        held_out = HostBatches(evaluation.data, DataPosition(spec.global_batch), batch_sh, abstract_batch)

    tokens = spec.global_batch * program.tokens_per_example
    # MFU: the program's FLOPs over what the devices the plan uses could do in the step's time.
    peak = plan.devices_used * profile(spec.hardware).peak_flops
    done = first
    pace = _SnapshotPace(spec.checkpoint.memory_budget, memory)
    saves = _Saves(store, report, spec.checkpoint.dir)
    stops = StopAgreement(should_stop, spec.num_processes, propose_snapshots=lambda: pace.interval)
    # The next step's batch is read and laid out on the devices while this step runs; the time
    # a step waits for it is its input time.
    prefetch = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="remesh-input")
    upcoming = prefetch.submit(batches, first) if first < spec.steps else None
    # A step's metrics are read back after the next step is dispatched, so the device is never
    # idle while the host waits for them; a step whose state is saved (or stopped at) is read
    # back first, since the next step donates that state.
    pending: _Dispatched | None = None
    seconds = 0.0  # the last step's time, read back
    waited = 0.0  # input waits since the last step was reported: charged to the lap that holds them
    copied = 0.0  # likewise, peer snapshots' copies to the host

    def read_back() -> None:
        """Report the dispatched step; its lap holds the waits and copies since the last report."""
        nonlocal seconds, waited, copied, pending
        step_report = pending.read_back(lap, tokens, flops["model_flops"], peak, waited, copied)
        seconds = step_report["seconds"]
        saves.reported(step_report)
        waited = copied = 0.0
        pending = None
        digest_fn.start()  # once a step is done: beside training, not beside a segment's first step

    try:
        for index in range(first, spec.steps):
            t_input = time.time()
            batch = upcoming.result()
            upcoming = prefetch.submit(batches, index + 1) if index + 1 < spec.steps else None
            if spec.slow_input_from is not None and index + 1 >= spec.slow_input_from:
                time.sleep(SLOW_INPUT_SECONDS)
            t_dispatch = time.time()
            waited += t_dispatch - t_input
            state, metrics = compiled(state, batch)
            if pending is not None:
                read_back()
            pending = _Dispatched(index + 1, metrics, stops.snapshot_every)
            done = index + 1
            evaluated = evaluation is not None and done % evaluation.every == 0
            boundary = done % spec.checkpoint.every == 0 or done == spec.steps
            if evaluated or boundary or done == first + 1:
                # Read back now: the next step would donate the state that a save or an
                # evaluation needs, and an evaluation's time is its own only with the step done.
                # Before the agreement, whose first broadcast compiles: a step is reported as
                # soon as it is done. A segment's first step likewise: it ends a recovery, which
                # is over once that step is done, not once the next one is dispatched.
                read_back()
            stop = stops.agree(done, boundary, seconds)
            if stop is Stop.NOW and pending is not None:  # likewise, before the save of the step reached
                read_back()
            if evaluated:
                _evaluate(eval_compiled, state, held_out, evaluation.batches, lap, done)
            if saves.saving is not None and not store.saving:
                saves.settle()  # a save that failed is reported as soon as it has, not at the next
            if boundary or stop is Stop.NOW:
                args = (store, state, plan, digest_fn, done, position.example_index(done), spec, report)
                saves.save(done, functools.partial(_save, *args))
                lap("checkpoint", step=done)
            if done < spec.steps and (stop is Stop.NOW or (stop is Stop.AT_CHECKPOINT and boundary)):
                break
            next_plan = ahead() if jax.process_index() == 0 else None
            if next_plan is not None:
                args = (next_plan, program, abstract_state, abstract_batch, spec, report)
                threading.Thread(target=_compile_ahead, args=args, daemon=True, name="remesh-ahead").start()
            if done < spec.steps and stops.snapshot_every and done % stops.snapshot_every == 0:
                if pending is not None:  # the copy waits for the step anyway; its report goes with it
                    read_back()
                reports = saves.unsaved(done)
                copy = _snapshot(memory, state, done, position.example_index(done), spec, pace, digest_fn, reports)
                pace.took(copy, seconds)
                copied += copy
    finally:
        prefetch.shutdown(wait=True, cancel_futures=True)
        digest_fn.close()
    saves.settle()
    lap("checkpoint_flush", step=done)
    store.close()
    return {"last_step": done}


class _Saves:
    """The save in flight, settled before the next one begins. A save that failed (a full disk,
    a lost mount) is reported and training goes on: nothing committed is touched, peer snapshots
    still cover a host loss, and the next boundary saves again. `MAX_FAILED_SAVES` in a row end
    the segment with what to do."""

    def __init__(self, store, report: Report, directory: str):
        self.store, self.report, self.directory = store, report, directory
        self.saving: int | None = None  # the step whose save is in flight
        self.failed: list[str] = []  # saves failed in a row
        # Step reports past the newest commit, saved with the next one: a controller killed
        # before it stored them (its store is written once a second) gets them back on resume.
        self._reports: list[dict] = []

    def reported(self, report: dict) -> None:
        self._reports.append({k: report.get(k) for k in REPORTED_FIELDS})
        # The store loses at most a flush interval's rows (about a second); a long interval
        # between checkpoints of fast steps keeps its newest reports only.
        del self._reports[:-MAX_UNSAVED_REPORTS]

    def unsaved(self, upto: int) -> list[dict]:
        """The step reports past the newest commit, up to step `upto`."""
        return [r for r in self._reports if r["step"] <= upto]

    def save(self, step: int, save: Callable[..., None]) -> None:
        """Settle the save in flight, then begin `step`'s (`save(reports=...)`, given the step
        reports past the newest commit once that save is settled)."""
        self.settle()
        try:
            save(reports=self.unsaved(step))
        except OSError as e:  # the directory itself refused (writes fail later, in `settle`)
            self._failed(step, e)
            return
        self.saving = step

    def settle(self) -> None:
        saving, self.saving = self.saving, None
        if saving is None:
            return  # nothing in flight (already settled)
        try:
            self.store.wait()
        except Exception as e:  # noqa: BLE001 (whatever the disk raised: it is reported, and bounded)
            self._failed(saving, e)
        else:
            self.failed.clear()
            self._reports = [r for r in self._reports if r["step"] > saving]

    def _failed(self, saving: int, e: Exception) -> None:
        self.failed.append(f"{type(e).__name__}: {e}")
        newest = self.store.latest()
        self.report({"kind": "checkpoint_failed", "step": saving, "error": self.failed[-1][:2000], "newest": newest})
        if len(self.failed) >= MAX_FAILED_SAVES:
            raise CheckpointSaveError(
                f"{len(self.failed)} checkpoint saves in a row failed (the last, of step {saving}: "
                f"{self.failed[-1][:500]}); the newest committed step in {self.directory} is {newest}. "
                "Free space there or point checkpoint.dir elsewhere, then run the job again: it resumes from it"
            ) from e


def step_flops(fn, abstract_args, compiled=None, *, model_flops: float | None = None) -> dict:
    """FLOPs of one step, counted by XLA's cost analysis.

    `model_flops`: the whole step before it is partitioned (what MFU divides by: work replicated
    across devices is not counted twice), lowered for the CPU backend whatever the devices are,
    because that analysis counts every dot and convolution (GPU backends lower matrix products to
    library calls their analysis cannot see, and jax 0.11 gives no analysis of an unoptimised GPU
    program at all) and because the count should not depend on where it is made. Given as
    `model_flops`, it is not counted again (the controller counts it once for every host).
    `device_flops`: one device's compiled, partitioned program, as its backend reports it (None
    where the backend cannot count it: on GPUs, library matrix products)."""
    import jax

    from partitioner.verify import analysed_flops

    model = model_flops
    if model is None:
        with jax.default_device(jax.devices("cpu")[0]):
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_args)
            model = analysed_flops(jax.jit(fn).lower(*abstract).cost_analysis())
    device = analysed_flops(compiled.cost_analysis()) if compiled is not None else None
    return {"model_flops": model or 0.0, "device_flops": device if device and device > 0 else None}


class _Deferred:
    """Laps taken on another thread, replayed into the segment's laps in order once it is joined."""

    def __init__(self):
        self._start, self._laps = time.time(), []

    def __call__(self, kind: str, **fields) -> None:
        self._laps.append((kind, fields, time.time() - self._start))

    def replay(self, lap: _Laps) -> None:
        for kind, fields, took in self._laps:
            lap(kind, took=took, **fields)


def _restore_beside(store, program, key, target, digest_fn, spec: SegmentSpec, lap, memory, report: Report):
    _maybe_hang(spec, "restore", report)
    return _restore_or_init(store, program, key, target, digest_fn, spec, lap, memory)


def _restore_or_init(store, program, key, target, digest_fn, spec: SegmentSpec, lap: _Laps, memory=None):
    """Restore the peer snapshot the controller chose, or else the newest committed step that
    every process reads intact, or initialise.

    A step that fails its checksums (or its digest) on any process is moved aside on all of them
    and the next older one is tried; the processes agree step by step, so they all resume from
    the same one."""
    import jax

    from checkpoint import CheckpointCorruptError, CheckpointFormatError

    restored = _restore_snapshot(memory, target, digest_fn, lap)
    if restored is not None:
        return restored
    committed = store.steps()
    for step in reversed(committed):
        try:
            state = store.restore(step, target=target)
            meta = store.last_restore.meta
            event = _check_digest(digest_fn, state, meta, step, spec.checkpoint.dir)
            error = None
        except (CheckpointCorruptError, CheckpointFormatError, RestoredStateMismatchError) as e:
            error = e
        if not _all_agree(error is None):
            lap("checkpoint_corrupt", step=step, error=str(error) if error else "corrupt on another host")
            if jax.process_index() == 0:
                store.quarantine(step)
            continue
        stats = store.last_restore
        lap(
            "restore",
            step=step,
            source="disk",
            bytes_read=stats.bytes_read,
            bytes_needed=stats.bytes_needed,
            reported=_reported(meta),
            **event,
        )
        first = int(meta.get("data_position", step))
        return state, first, int(meta.get("examples_seen", first * spec.global_batch))
    if committed:
        raise CheckpointCorruptError(
            f"no checkpoint in {spec.checkpoint.dir} restores intact: steps {committed} were all damaged and moved "
            "aside as <step>.corrupt; move one back to inspect it, or start the job in a new checkpoint directory"
        )
    state = jax.jit(program.init, out_shardings=jax.tree.map(lambda t: t.sharding, target))(key)
    jax.block_until_ready(state)
    lap("init")
    return state, 0, 0


def _restore_snapshot(memory, target, digest_fn: _Digest, lap: _Laps):
    """(state, first step, first example) from the peer snapshot in `memory`, if every process
    reads its pieces intact (crc32 of each) and the state they make up has the digest taken with
    the snapshot; None, on every process alike, otherwise."""
    from checkpoint import CheckpointCorruptError, CheckpointNotFoundError, restore_step

    if memory is None:
        return None
    state = error = None
    try:
        source = memory.restore_step()
        if source is None:  # the same on every process: the controller gives all or none a snapshot
            return None
        state, stats = restore_step(source, target)
        event = _check_digest(digest_fn, state, source.meta, source.step, "a peer snapshot in host memory")
    except (CheckpointCorruptError, CheckpointNotFoundError, RestoredStateMismatchError) as e:
        error = e
    if not _all_agree(error is None):
        lap("snapshot_unusable", error=str(error) if error else "unusable on another host")
        return None
    meta = source.meta
    lap(
        "restore",
        step=source.step,
        source="memory",
        bytes_read=0,
        bytes_needed=stats.bytes_needed,
        reported=_reported(meta),
        **event,
    )
    return state, int(meta["data_position"]), int(meta["examples_seen"])


def _reported(meta: dict) -> dict:
    """What a restored step's metadata kept of the step reports up to it: the controller stores
    those that never reached it (a group lost before it polled them, a controller killed)."""
    return {"segment": meta.get("segment"), "steps": meta.get("reports", [])}


def _check_digest(digest_fn: _Digest, state, meta: dict, step: int, where: str) -> dict:
    if not digest_fn.enabled or not str(meta.get("digest", "")).startswith(DIGEST_KIND):
        return {}
    event = {"digest": digest(digest_fn.get(), state), "saved_digest": meta["digest"]}
    if event["digest"] != event["saved_digest"]:
        raise RestoredStateMismatchError(
            f"the state restored from step {step} in {where} does not match the digest saved "
            f"with it (saved {meta['digest'][:12]}, restored {event['digest'][:12]}): it is corrupt"
        )
    return event


def _all_agree(ok: bool) -> bool:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return ok
    return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))


def _save(
    store,
    state,
    plan,
    digest_fn: _Digest,
    step: int,
    examples_seen: int,
    spec: SegmentSpec,
    report: Report,
    reports: list[dict] = (),
) -> None:
    if spec.freeze_before_save == step:
        # Fault injection: the previous checkpoint is complete, this one is begun by the other
        # hosts and never finished by this one; hang here until the controller kills the host.
        store.wait()
        _hang("save", report, step)
    meta = {
        "data_position": step,
        "examples_seen": examples_seen,  # where the next step's examples begin in the data's global order
        "segment": spec.segment,
        "program": spec.program,
        "seed": spec.seed,
        "program_fingerprint": spec.fingerprint,
        "global_batch": spec.global_batch,
        "steps": spec.steps,
        "options": spec.options,
        "reports": list(reports),  # this segment's steps past the last commit
    }
    if digest_fn.enabled:
        meta["digest"] = digest(digest_fn.get(), state)
    store.save(step, state, plan=plan, meta=meta)


def _maybe_hang(spec: SegmentSpec, phase: str, report: Report) -> None:
    if spec.freeze_in == phase:
        _hang(phase, report)


def _hang(phase: str, report: Report, step: int | None = None) -> None:
    """Fault injection: say so, then hang until the controller kills this host."""
    report({"kind": "chaos_frozen", "phase": phase, "step": step})
    threading.Event().wait()


def _batches(program, position, shardings, shapes):
    """step -> that step's global batch on the devices: each process reading the rows it holds
    of `program.data`, or slicing its rows out of `program.batch`'s whole batch."""
    if program.data is not None:
        from ..job.data import HostBatches

        return HostBatches(program.data, position, shardings, shapes)
    return lambda step: _global_batch(program.batch(step, position.global_batch), shardings)


def _global_batch(host_batch: Any, shardings: Any):
    """The whole global batch, built on every process (`Program.batch`), placed on the devices:
    each process hands over only the slices its devices hold."""
    import jax
    import numpy as np

    # dtype given: a process whose devices the plan leaves out holds no shard to infer it from.
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(
            np.shape(x), s, lambda idx: np.asarray(x)[idx], dtype=np.asarray(x).dtype
        ),
        host_batch,
        shardings,
    )


def main(argv: list[str] | None = None) -> int:
    """Run one segment without Ray: `python -m orchestrator.worker SPEC.json` (prints reports)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("spec", help="SegmentSpec as JSON (a file path)")
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        spec = SegmentSpec.from_json(f.read())
    run_segment(spec, lambda r: print(json.dumps(r), flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
