"""Checkpoint speed against the disk and the host copy, measured side by side in one run.

    .venv/bin/python benchmarks/checkpoint_io.py --repeats 5 [--dir DIR] [--json out.json]

A GPT-shaped state (vocab 50304, d_model 768, 24 layers of qkv/out/mlp weights, ~0.84 GB
float32) FSDP-sharded over 8 fake CPU devices. Each repeat, interleaved so that disk noise hits
baselines and measurements alike:
  - blocking time of `Store.save` vs a plain device-to-host copy of the same state (`jax.device_get`)
  - background write: bytes committed / (host copy done to commit) vs `dd conv=fdatasync` of as
    many bytes, each write on a settled disk (sync, 3 s), dd and the save alternating in order
  - restore from a cold page cache (files evicted with posix_fadvise) onto the same mesh, and onto
    a 3 x 2 mesh (rows and columns), vs cold sequential reads of the dd file and of the
    checkpoint's own files
Then, once: zstd vs raw codec, Orbax's StandardCheckpointer on the same state, peak host memory
of a restore in a fresh process, and bytes read per process by 3 processes x 2 devices restoring
onto the 3 x 2 mesh (real jax.distributed group).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from _harness import fake_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, D, FF, LAYERS = 50304, 768, 3072, 24


def shapes() -> dict:
    layer = {"qkv": (D, 3 * D), "out": (D, D), "w1": (D, FF), "w2": (FF, D), "ln": (D,)}
    return {"wte": (VOCAB, D), "layers": {str(i): layer for i in range(LAYERS)}}


def build_state(mesh):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(0)

    def make(shape):
        x = rng.standard_normal(shape, dtype=np.float32)
        return jax.device_put(x, NamedSharding(mesh, P(mesh.axis_names[0]) if len(shape) > 1 else P()))

    return jax.tree.map(make, shapes(), is_leaf=lambda s: isinstance(s, tuple))


def target(mesh, spec_2d):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, np.float32, sharding=NamedSharding(mesh, spec_2d if len(s) > 1 else P())),
        shapes(),
        is_leaf=lambda s: isinstance(s, tuple),
    )


def evict(path: str) -> None:
    """Drop a file, or every file under a directory, from the page cache (the next read goes to disk)."""
    if os.path.isfile(path):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def settle(seconds: float = 3.0) -> None:
    os.sync()
    time.sleep(seconds)


def dd_write(path: str, nbytes: int) -> float:
    mib = max(1, nbytes >> 20)
    t = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "conv=fdatasync"], check=True, capture_output=True
    )
    return (mib << 20) / (time.perf_counter() - t)


def raw_read(path: str) -> float:
    """Cold sequential read (8 MiB reads, one thread) of a file, or of every file under a directory."""
    evict(path)
    files = [path] if os.path.isfile(path) else sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs)
    t = time.perf_counter()
    n = 0
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while chunk := f.read(8 << 20):
                n += len(chunk)
    return n / (time.perf_counter() - t)


def stored_bytes(step_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(step_dir) for f in fs)


def measure(args) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from checkpoint import Store, StoreConfig

    devices = jax.devices()
    mesh8 = Mesh(np.array(devices[:8]), ("x",))
    mesh6 = Mesh(np.array(devices[:6]).reshape(3, 2), ("data", "model"))
    state = build_state(mesh8)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    base = tempfile.mkdtemp(dir=args.dir)
    store = Store(os.path.join(base, "ckpt"), config=StoreConfig(keep_last=2))
    expected = nbytes + (1 << 20)  # data plus shard indexes and metadata, near enough for dd
    rows = []
    for r in range(args.repeats):
        # dd writes as many bytes as a checkpoint holds. On a virtual disk a write is slowed by the
        # write-back of the one before it, so each write starts on a settled disk, and dd and the
        # save alternate in order.
        dd_file = os.path.join(base, "dd.bin")
        if r % 2 == 0:
            settle()
            dd = dd_write(dd_file, expected)
        # Fresh device copies each time (JAX caches an array's host value after its first transfer),
        # and the baseline copy right before the save, under the same conditions.
        fresh = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), state))
        other = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), state))
        settle()
        t = time.perf_counter()
        host = jax.device_get(other)
        d2h = time.perf_counter() - t
        del host, other
        t = time.perf_counter()
        store.save(r, fresh)
        blocking = time.perf_counter() - t
        store.wait()
        background = store.last_save_seconds  # the write, from the host copy to the commit
        del fresh
        if r % 2 == 1:
            settle()
            dd = dd_write(dd_file, expected)
        step_dir = os.path.join(store.path, str(r))
        written = stored_bytes(step_dir)
        restores = {}
        for name, tgt in (("same", target(mesh8, P("x"))), ("reshard", target(mesh6, P("data", "model")))):
            evict(store.path)
            t = time.perf_counter()
            restored, stats = store.restore_with_stats(r, target=tgt)
            jax.block_until_ready(restored)
            restores[name] = (time.perf_counter() - t, stats)
            del restored
        raw_files = raw_read(step_dir)
        raw = raw_read(dd_file)
        os.remove(dd_file)
        rows.append(
            {
                "d2h_s": d2h,
                "blocking_s": blocking,
                "write_Bps": written / background,
                "dd_Bps": dd,
                "raw_read_Bps": raw,
                "raw_read_files_Bps": raw_files,
                "restore_same_s": restores["same"][0],
                "restore_reshard_s": restores["reshard"][0],
                "restore_same_Bps": nbytes / restores["same"][0],
                "amp_same": restores["same"][1].read_amplification,
                "amp_reshard": restores["reshard"][1].read_amplification,
                "written": written,
            }
        )
        print(json.dumps({k: round(v, 4) for k, v in rows[-1].items()}), flush=True)
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    ratio = lambda a, b, invert=False: statistics.median(
        (row[b] / row[a]) if invert else (row[a] / row[b]) for row in rows
    )
    out = {
        "state_bytes": nbytes,
        "repeats": rows,
        "median": med,
        "median_of_ratios": {
            "blocking_over_d2h": ratio("blocking_s", "d2h_s"),
            "write_over_dd": ratio("write_Bps", "dd_Bps"),
            "restore_over_raw_read": ratio("restore_same_Bps", "raw_read_Bps"),
            "restore_over_raw_read_files": ratio("restore_same_Bps", "raw_read_files_Bps"),
            "reshard_over_same": ratio("restore_reshard_s", "restore_same_s"),
        },
        "blocking_over_d2h": med["blocking_s"] / med["d2h_s"],
        "write_over_dd": med["write_Bps"] / med["dd_Bps"],
        "restore_over_raw_read": med["restore_same_Bps"] / med["raw_read_Bps"],
        "restore_over_raw_read_files": med["restore_same_Bps"] / med["raw_read_files_Bps"],
        "reshard_over_same": med["restore_reshard_s"] / med["restore_same_s"],
    }
    out["codecs"] = codecs(state, base)
    out["orbax"] = orbax_baseline(state, base, mesh8)
    out["memory"] = [
        subprocess_json(["memory", store.path, str(args.repeats - 1), kind]) for kind in ("same", "reshard")
    ]
    out["processes"] = multiprocess_restore(store.path, args.repeats - 1)
    return out


def codecs(state, base: str) -> dict:
    from checkpoint import Codec, Store, StoreConfig

    out = {}
    for codec in (Codec.RAW, Codec.ZSTD):
        store = Store(os.path.join(base, f"codec-{codec.value}"), config=StoreConfig(codec=codec))
        t = time.perf_counter()
        store.save(0, state)
        store.wait()
        out[codec.value] = {"seconds": time.perf_counter() - t, "bytes": stored_bytes(os.path.join(store.path, "0"))}
    return out


def orbax_baseline(state, base: str, mesh8) -> dict:
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import PartitionSpec as P

    path = os.path.join(base, "orbax")
    ckptr = ocp.StandardCheckpointer()
    t = time.perf_counter()
    ckptr.save(path, state)
    blocking = time.perf_counter() - t
    ckptr.wait_until_finished()
    save = time.perf_counter() - t
    evict(path)
    t = time.perf_counter()
    jax.block_until_ready(ckptr.restore(path, target(mesh8, P("x"))))
    return {"blocking_s": blocking, "save_s": save, "restore_s": time.perf_counter() - t, "bytes": stored_bytes(path)}


def subprocess_json(argv: list[str], devices: int = 8, extra_env: dict | None = None) -> dict:
    env = fake_devices(devices, dict(os.environ, PYTHONPATH=ROOT, **(extra_env or {})))
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--role", *argv],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def role_memory(path: str, step: int, kind: str) -> dict:
    """Peak resident memory a restore adds to a fresh process, against the bytes its devices hold."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from checkpoint import Store

    devices = jax.devices()
    tgt = (
        target(Mesh(np.array(devices[:8]), ("x",)), P("x"))
        if kind == "same"
        else target(Mesh(np.array(devices[:6]).reshape(3, 2), ("data", "model")), P("data", "model"))
    )
    store = Store(path)
    store.metadata(step)
    rss = lambda key: int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
    before = rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS
    restored = store.restore(step, target=tgt)
    jax.block_until_ready(restored)
    held = sum(s.data.nbytes for x in jax.tree.leaves(restored) for s in x.addressable_shards)
    peak = rss("VmHWM") - before
    return {"kind": kind, "held_bytes": held, "peak_added_bytes": peak, "ratio": peak / held}


def multiprocess_restore(path: str, step: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = fake_devices(2, dict(os.environ, PYTHONPATH=ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--role", "process", path, str(step), str(p), str(port)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in range(3)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(err[-3000:])
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def role_process(path: str, step: int, pid: int, port: int) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", 3, pid, initialization_timeout=60)
    from checkpoint import Store

    store = Store(path)
    evict(os.path.join(path, str(step)))
    mesh = Mesh(np.array(jax.devices()).reshape(3, 2), ("data", "model"))
    t = time.perf_counter()
    restored, s = store.restore_with_stats(step, target=target(mesh, P("data", "model")))
    jax.block_until_ready(restored)
    return {
        "process": pid,
        "seconds": time.perf_counter() - t,
        "bytes_needed": s.bytes_needed,
        "bytes_read": s.bytes_read,
        "amplification": s.read_amplification,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=os.path.join(ROOT, "runs"), help="where to write (the disk under test)")
    parser.add_argument("--json", help="write all figures here")
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        role, *rest = args.role
        if role == "memory":
            print(json.dumps(role_memory(rest[0], int(rest[1]), rest[2])))
        else:
            print(json.dumps(role_process(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))))
        return
    os.makedirs(args.dir, exist_ok=True)
    out = measure(args)
    print(json.dumps({k: v for k, v in out.items() if k != "repeats"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    fake_devices(8, unless_set=True)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    main()
