"""Process set-up for a segment: joining the `jax.distributed` group, and compiling once per group.

Process set-up that must precede `import jax` (`XLA_FLAGS` for fake devices, `JAX_PLATFORMS`)
belongs to whoever starts the process, never to this module.
"""

from __future__ import annotations

import os
import time

from ..protocol import SegmentSpec


def start_group(spec: SegmentSpec) -> None:
    """Join this process to its `jax.distributed` group (Gloo on CPU; NCCL on GPUs)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    os.environ.update(multislice_env(spec))
    if spec.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", spec.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        _process_invariant_cpu_cache_keys()
    if spec.num_processes > 1:
        if spec.process_id != 0:
            _wait_for_coordinator(spec.coordinator, timeout_s=60)
        jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id, initialization_timeout=60)


MEGASCALE_PORT = "8081"  # libtpu's default, as Ray's TPU utilities use it


def multislice_env(spec: SegmentSpec) -> dict[str, str]:
    """What libtpu reads to join a group's TPU slices over the data-center network: the group's
    slices, this host's, and where their coordinator listens (process 0's host). Set at every
    group, before the TPU backend starts, over whatever the pod's environment or an earlier group
    set: stale values (a slice since lost) make libtpu wait for slices that are gone. Nothing on
    profiles whose hosts are not TPU slices'."""
    from partitioner import profile

    if profile(spec.hardware).fails_by != "slice":
        return {}
    return {
        "MEGASCALE_COORDINATOR_ADDRESS": spec.coordinator.rsplit(":", 1)[0],
        "MEGASCALE_PORT": MEGASCALE_PORT,
        "MEGASCALE_NUM_SLICES": str(spec.slices),
        "MEGASCALE_SLICE_ID": str(spec.slice_id),
    }


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
    JAX's own key. Idempotent; installed at process set-up, never at import.

    JAX has no public hook for the cache key: this patches `jax._src.cache_key`, and falls back
    to JAX's own key (each process compiles for itself) where that function is gone."""
    from jax._src import cache_key

    if not hasattr(cache_key, "_hash_accelerator_config"):
        return
    original = getattr(cache_key._hash_accelerator_config, "__wrapped__", cache_key._hash_accelerator_config)

    def hash_accelerator_config(hash_obj, accelerators):
        if all(d.platform == "cpu" for d in accelerators.flat):
            for d in accelerators.flat:
                hash_obj.update(f"{d.device_kind}/{d.id}/{d.process_index};".encode())
        else:
            original(hash_obj, accelerators)

    hash_accelerator_config.__wrapped__ = original
    cache_key._hash_accelerator_config = hash_accelerator_config


def compile_once(lowered, spec: SegmentSpec):
    """One process compiles the step and hands the executable to the others via the coordinator,
    instead of every host compiling the same SPMD program (hosts that share cores, as emulated
    hosts do, would each take n times as long). Scoped to this compile: Orbax compiles helpers on
    some processes only, and those must never wait for a peer. (`share_binary_between_hosts` is
    not public JAX API; without it each process compiles for itself.)"""
    if not spec.compilation_cache or spec.num_processes == 1:
        return lowered.compile()
    try:
        from jax._src.config import share_binary_between_hosts
    except ImportError:
        return lowered.compile()
    with share_binary_between_hosts(True):
        return lowered.compile()
