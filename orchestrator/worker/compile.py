"""Compiling a segment's programs: the step's FLOPs, the state digest's program, executables
compiled ahead for a smaller mesh beside training, and loading them in a later group."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from ..job.digest import compile_digest
from ..protocol import CompileAhead, SegmentSpec, plan_key
from .hooks import Hook, StepDispatched
from .laps import Reporter


def sharded(abstract, shardings):
    """`abstract`'s shapes and dtypes carrying `shardings`: a restore's or a compile's target."""
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)


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


class DigestProgram:
    """The state digest's compiled program (job/digest.py), compiled once per group when first
    needed (a restore from disk, a save) or when `start`ed after the first step is done, in a thread
    beside training: off the path from a new group's start to its first step unless that step
    restores from disk."""

    def __init__(self, target, compile, enabled: bool, executables: Executables | None = None):
        self._target, self._compile, self.enabled = target, compile, enabled
        self._executables = executables
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="remesh-digest")
        self._future: concurrent.futures.Future | None = None

    def start(self) -> None:
        if self.enabled and self._future is None:
            compile = functools.partial(compile_digest, self._target, self._compile)
            make = functools.partial(self._executables.get, "digest", compile) if self._executables else compile
            self._future = self._pool.submit(make)

    def get(self):
        self.start()
        return self._future.result() if self._future else None

    def ready(self) -> bool:
        """Compiled already: `get` returns without waiting."""
        return self._future is not None and self._future.done() and self._future.exception() is None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _ThreadCompiles(threading.local):
    """This thread's XLA compiles and persistent-cache hits, counted from JAX's monitoring events."""

    compiles = 0
    hits = 0


_compiles = _ThreadCompiles()


@functools.cache  # once per process: registered twice, both counts would still only grow together
def _listen() -> None:
    import jax

    def compiled(event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":  # jax._src.dispatch.BACKEND_COMPILE_EVENT
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


def compile_ahead(plan_json: str, program, abstract_state, abstract_batch, spec: SegmentSpec, report: Reporter):
    """Compile the step, the evaluation and the digest for a mesh this group may shrink to, and
    report them serialised (`CompileAhead.executables`): the group that runs that plan loads them
    instead of tracing, lowering and compiling.

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
        inputs = (abstract_state, abstract_batch)
        step_fn = plan.jit(plan.program(program.step), inputs, devices, carry={0: 0}, donate_argnums=(0,))
        executables = {"plan": plan_key(plan_json), "step": _fresh(step_fn.lower(abstract_state, abstract_batch))}
        if program.evaluation is not None:
            fn = plan.jit(
                plan.program(program.evaluation.step, required=False), inputs, devices, replicated_outputs=True
            )
            executables["evaluation"] = _fresh(fn.lower(abstract_state, abstract_batch))
        if spec.digest:
            shardings = plan.shardings(plan.bind(devices), abstract_state, argnum=0)
            executables["digest"] = compile_digest(sharded(abstract_state, shardings), _fresh)
        executables = {k: v for k, v in executables.items() if v is not None}
        seconds = time.perf_counter() - t
        report(CompileAhead(devices=plan.devices_used, seconds=seconds, executables=executables))
    except Exception as e:  # noqa: BLE001 (anything: the segment trains on regardless)
        report(CompileAhead(seconds=time.perf_counter() - t, error=f"{type(e).__name__}: {e}"))


class Executables:
    """Executables compiled ahead for this segment's plan (`compile_ahead`), loaded in place of
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


class AheadHook(Hook):
    """Between steps, on process 0: a plan the controller sent for a smaller mesh is compiled in a
    thread beside training (`compile_ahead`)."""

    def __init__(self, ahead: Callable[[], str | None], program, abstract_state, abstract_batch, spec, report):
        self._ahead, self._args = ahead, (program, abstract_state, abstract_batch, spec, report)

    def after_step(self, done: StepDispatched) -> None:
        import jax

        if done.ends_segment or jax.process_index() != 0:
            return
        plan_json = self._ahead()
        if plan_json is not None:
            args = (plan_json, *self._args)
            threading.Thread(target=compile_ahead, args=args, daemon=True, name="remesh-ahead").start()
