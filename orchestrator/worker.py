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

import dataclasses
import hashlib
import json
import threading
import time
from typing import Any, Callable

from .jobfile import CheckpointSpec

Report = Callable[[dict], None]


class RestoredStateMismatchError(ValueError):
    """A restored state differs from the state that was saved."""


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
    digest: bool = True  # record a digest of the state at every save and restore (bitwise checks)
    freeze_before_save: int | None = None  # fault injection: hang instead of saving this step
    compilation_cache: str | None = None
    fingerprint: str = ""  # of the program and its abstract inputs; saved with every checkpoint

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "SegmentSpec":
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
        jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id, initialization_timeout=60)


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


def _compile_once(lowered, spec: "SegmentSpec"):
    """One process compiles the step and hands the executable to the others via the coordinator,
    instead of every host compiling the same SPMD program (hosts that share cores, as emulated
    hosts do, would each take n times as long). Scoped to this compile: Orbax compiles helpers on
    some processes only, and those must never wait for a peer."""
    from jax._src import config as jax_config

    if not spec.compilation_cache or spec.num_processes == 1:
        return lowered.compile()
    with jax_config.share_binary_between_hosts(True):
        return lowered.compile()


def run_segment(spec: SegmentSpec, report: Report, should_stop: Callable[[], bool] = lambda: False) -> dict:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from checkpoint import StoreConfig
    from partitioner import Plan

    from .program import abstract_inputs, load_program

    t0 = time.perf_counter()
    start_group(spec)
    report({"kind": "group_start", "seconds": time.perf_counter() - t0, "devices": jax.device_count()})

    program = load_program(spec.program)
    plan = Plan.from_json(spec.plan_json)
    mesh = plan.bind(jax.devices())
    key = jax.random.key(spec.seed)
    abstract_state, abstract_batch = abstract_inputs(program, spec.global_batch, spec.seed)
    state_sh = plan.shardings(mesh, abstract_state, argnum=0)
    batch_sh = plan.shardings(mesh, abstract_batch, argnum=1)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    store = StoreConfig(keep_last=spec.checkpoint.keep, keep_every=spec.checkpoint.keep_every or None).create(spec.checkpoint.dir)
    state, first = _restore_or_init(store, program, key, abstract_state, state_sh, spec, report)

    t = time.perf_counter()
    step_fn = jax.jit(program.step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated),
                      donate_argnums=(0,))
    compiled = _compile_once(step_fn.lower(abstract_state, abstract_batch), spec)
    report({"kind": "compile", "seconds": time.perf_counter() - t})

    tokens = spec.global_batch * program.tokens_per_example
    done = first
    for index in range(first, spec.steps):
        t = time.perf_counter()
        batch = _global_batch(program.batch(index, spec.global_batch), batch_sh)
        state, metrics = compiled(state, batch)
        loss = float(metrics["loss"])  # also the step's sync point
        seconds = time.perf_counter() - t
        done = index + 1
        report({"kind": "step", "step": done, "loss": loss, "seconds": seconds, "tokens_per_second": tokens / seconds})
        if done % spec.checkpoint.every == 0 or done == spec.steps:
            _save(store, state, plan, done, spec, report)
            stop = multihost_utils.broadcast_one_to_all(np.int32(should_stop()))
            if done < spec.steps and int(stop):
                break
    t = time.perf_counter()
    store.wait()
    report({"kind": "checkpoint_flush", "step": done, "seconds": time.perf_counter() - t})
    store.close()
    return {"last_step": done}


def _restore_or_init(store, program, key, abstract_state, state_sh, spec: SegmentSpec, report: Report):
    """Restore the newest committed step that every process reads intact, or initialise.

    A step that fails its checksums (or its digest) on any process is moved aside on all of them
    and the next older one is tried; the processes agree step by step, so they all resume from
    the same one."""
    import jax

    from checkpoint import CheckpointCorruptError, CheckpointFormatError

    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, state_sh)
    committed = store.steps()
    for step in reversed(committed):
        t = time.perf_counter()
        try:
            state = store.restore(step, target=target)
            meta = store.last_restore.meta
            event = _check_digest(state, meta, step, spec)
            error = None
        except (CheckpointCorruptError, CheckpointFormatError, RestoredStateMismatchError) as e:
            error = e
        if not _all_agree(error is None):
            report({"kind": "checkpoint_corrupt", "step": step, "error": str(error) if error else "corrupt on another host"})
            if jax.process_index() == 0:
                store.quarantine(step)
            continue
        stats = store.last_restore
        report({"kind": "restore", "step": step, "seconds": time.perf_counter() - t, "bytes_read": stats.bytes_read,
                "bytes_needed": stats.bytes_needed, **event})
        return state, int(meta.get("data_position", step))
    if committed:
        raise CheckpointCorruptError(
            f"no checkpoint in {spec.checkpoint.dir} restores intact: steps {committed} were all damaged and moved "
            "aside as <step>.corrupt; move one back to inspect it, or start the job in a new checkpoint directory")
    return jax.jit(program.init, out_shardings=state_sh)(key), 0


def _check_digest(state, meta: dict, step: int, spec: SegmentSpec) -> dict:
    if not (spec.digest and meta.get("digest")):
        return {}
    event = {"digest": state_digest(state), "saved_digest": meta["digest"]}
    if event["digest"] != event["saved_digest"]:
        raise RestoredStateMismatchError(
            f"the state restored from step {step} in {spec.checkpoint.dir} does not match the digest saved "
            f"with it (saved {meta['digest'][:12]}, restored {event['digest'][:12]}): the checkpoint is corrupt")
    return event


def _all_agree(ok: bool) -> bool:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return ok
    return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))


def _save(store, state, plan, step: int, spec: SegmentSpec, report: Report) -> None:
    if spec.freeze_before_save == step:
        # Fault injection: the previous checkpoint is complete, this one is begun by the other
        # hosts and never finished by this one; hang here until the controller kills the host.
        store.wait()
        report({"kind": "chaos_frozen", "step": step})
        threading.Event().wait()
    t = time.perf_counter()
    meta = {"data_position": step, "segment": spec.segment, "program": spec.program, "seed": spec.seed,
            "program_fingerprint": spec.fingerprint, "global_batch": spec.global_batch}
    if spec.digest:
        meta["digest"] = state_digest(state)
    store.save(step, state, plan=plan, meta=meta)
    report({"kind": "checkpoint", "step": step, "seconds": time.perf_counter() - t})


def _global_batch(host_batch: Any, shardings: Any):
    """Each process supplies only the slices of the global batch its devices hold."""
    import jax
    import numpy as np

    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda idx: np.asarray(x)[idx]), host_batch, shardings)


def state_digest(state: Any) -> str:
    """SHA-256 over every leaf's global value (gathered), independent of mesh and sharding."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if leaf.is_fully_replicated:  # every process holds it whole: nothing to gather
            value = np.asarray(leaf.addressable_data(0))
        else:
            value = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(str(value.dtype).encode() + str(value.shape).encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


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
