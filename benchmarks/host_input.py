"""Per-host input: bytes read and time spent per host per step, against the number of processes.

    .venv/bin/python benchmarks/host_input.py [--tokens 50_000_000] [--batch 256] [--seq 1024]

A data-only harness stands in for hosts: 64 fake CPU devices are split into N processes of 64/N
devices each (N = 1 to 64), the global batch laid out over data x model with model = 2 within a
host where a host has 2 devices or more (as the planner keeps it), and each simulated process
reads the rows its devices hold (`orchestrator.job.data.rows_held`) of a uint16
token file through its own `Windows` (which counts the bytes it reads). Beside it, the baseline
measured in the same run: the previous path, where every host builds the whole global batch and
slices its rows out. Medians over 5 steps per process; the token file is written once to a
temporary folder (and read from the page cache after the first pass: this measures the loader's
work, not the disk).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=50_000_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from orchestrator.job.data import TokenFiles, rows_held

    devices = jax.devices()
    assert len(devices) == 64, f"needs 64 fake CPU devices, got {len(devices)}"
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "train.bin")
        np.random.default_rng(0).integers(0, 50_000, args.tokens, dtype=np.uint16).tofile(path)
        files = TokenFiles((path,), args.seq, seed=0)
        global_bytes = args.batch * (args.seq + 1) * 2
        print(f"global batch {args.batch} x {args.seq} tokens: {global_bytes / 2**20:.2f} MiB of uint16 per step")
        print(
            "| processes | rows per host | MiB read per host per step | / (global / N) | input ms per host per step | baseline: MiB per host | baseline ms |"
        )
        print("|---|---|---|---|---|---|---|")
        for n in (1, 2, 4, 8, 16, 32, 64):
            per = 64 // n
            model = 2 if per >= 2 else 1
            mesh = Mesh(np.array(devices).reshape(64 // model, model), ("data", "model"))
            sharding = {k: NamedSharding(mesh, PartitionSpec("data")) for k in ("inputs", "targets")}
            shapes = {k: jax.ShapeDtypeStruct((args.batch, args.seq), np.int32) for k in sharding}
            hosts = [set(devices[p * per : (p + 1) * per]) for p in range(n)]
            ours, base = (
                _measure(files, hosts, sharding, shapes, args.batch, rows=True),
                _measure(files, hosts, sharding, shapes, args.batch, rows=False),
            )
            rows = len(rows_held(sharding, shapes, devices=hosts[0]))
            print(
                f"| {n} | {rows} | {ours[0] / 2**20:.3f} | {ours[0] / (global_bytes / n):.3f} | {ours[1] * 1e3:.2f} "
                f"| {base[0] / 2**20:.3f} | {base[1] * 1e3:.2f} |",
                flush=True,
            )


def _measure(files, hosts, sharding, shapes, batch: int, rows: bool, steps: int = 5) -> tuple[float, float]:
    """(median bytes, median seconds) per host per step, over up to 8 of the hosts."""
    from orchestrator.job.data import rows_held

    bytes_, seconds = [], []
    for host in hosts[:8]:
        windows = files.windows()
        ds = files.dataset(windows)
        mine = rows_held(sharding, shapes, devices=host) if rows else range(batch)
        for step in range(1, steps + 1):
            before, t = windows.bytes_read, time.perf_counter()
            held = {r: ds[step * batch + r] for r in mine}
            seconds.append(time.perf_counter() - t)
            bytes_.append(windows.bytes_read - before)
            assert len(held) == len(mine)
    return statistics.median(bytes_), statistics.median(seconds)


if __name__ == "__main__":
    from _harness import fake_devices

    fake_devices(64)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    main()
