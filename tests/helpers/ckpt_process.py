"""One process of a multi-process checkpoint test: `python -m tests.helpers.ckpt_process ROLE ...`.

save:    every process of a group saves its shards of a deterministic state (`expected_state`)
restore: every process restores onto a new mesh and checks its shards bitwise; prints JSON stats
loop:    saves steps start, start+1, ... forever (a crash test kills it at a random moment)
"""

import json
import sys

import numpy as np


def expected_state(step: int = 0) -> dict:
    rng = np.random.default_rng(step)
    return {
        "params": {
            "w": rng.standard_normal((960, 384)).astype(np.float32),
            "b": rng.standard_normal(384).astype(np.float32),
            "odd": rng.standard_normal((5, 7)).astype(np.float32),
        },
        "step": np.int32(step),
    }


def specs(kind: str, mesh) -> dict:
    from jax.sharding import PartitionSpec as P

    axes = mesh.axis_names
    if kind == "fsdp":
        return {"params": {"w": P(axes), "b": P(axes), "odd": P()}, "step": P()}
    return {"params": {"w": P(axes[0], axes[1]), "b": P(axes[1]), "odd": P()}, "step": P()}  # 2-D: data x model


def main(role: str, process_id: int, processes: int, port: int, path: str, kind: str, step: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if processes > 1:
        jax.distributed.initialize(f"127.0.0.1:{port}", processes, process_id, initialization_timeout=60)
    from jax.sharding import Mesh, NamedSharding

    from checkpoint import Store, StoreConfig

    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("x",)) if kind == "fsdp" else Mesh(devices.reshape(-1, 2), ("data", "model"))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs(kind, mesh))
    store = Store(path, config=StoreConfig(chunk_bytes=64 << 10, keep_last=2))
    if role == "save":
        state = jax.tree.map(
            lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda i: np.asarray(x)[i]),
            expected_state(step),
            shardings,
        )
        store.save(step, state, meta={"data_position": step})
        store.wait()
        print(json.dumps({"process": process_id, "saved": step}), flush=True)
    elif role == "restore":
        want = expected_state(step)
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), want, shardings)
        got, s = store.restore_with_stats(step, target=target)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            for shard in g.addressable_shards:
                a, b = np.asarray(shard.data), np.asarray(w)[shard.index]
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (
                    shard.index,
                    shard.device,
                )
        print(
            json.dumps(
                {"process": process_id, "restored": step, "bytes_needed": s.bytes_needed, "bytes_read": s.bytes_read}
            ),
            flush=True,
        )
    else:
        while True:
            state = jax.tree.map(lambda x, s: jax.device_put(x, s), expected_state(step), shardings)
            print(json.dumps({"saving": step}), flush=True)
            store.save(step, state, meta={"data_position": step})
            step += 1
    if processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    role, pid, n, port, path, kind, step = sys.argv[1:8]
    main(role, int(pid), int(n), int(port), path, kind, int(step))
