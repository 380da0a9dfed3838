"""The straggler probe's ratios (`orchestrator.hosts.probe`): a healthy node against a healthy one,
and a node F times slow (the chaos hook `slow-step`'s probe) against a healthy one, on a local
Ray cluster of 3 nodes, optionally beside busy JAX processes on the same cores.

    .venv/bin/python benchmarks/probe.py [--probes 8] [--factor 3] [--load 0]

A probe passes at most `ProbeConfig.healthy` (1.25x): healthy probes should all pass and slow ones
all fail. Reported: each probe's ratio, and each kind's range and median, side by side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOG = "import jax, jax.numpy as j\nx = j.ones((512, 512))\nf = jax.jit(lambda a: a @ a @ a)\nwhile True: f(x).block_until_ready()"


def ratios(probe, node: str, reference: str, count: int) -> list[float]:
    from orchestrator.hosts.probe import HostProbe

    out = []
    for _ in range(count):
        probing = probe.start(node, reference)
        while (ratio := HostProbe.result(probing)) is False:
            time.sleep(0.05)
        out.append(round(ratio, 3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probes", type=int, default=8)
    parser.add_argument("--factor", type=float, default=3.0, help="how many times slow the slow node is")
    parser.add_argument("--load", type=int, default=0, help="busy JAX processes beside the cluster")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    import ray
    from ray.cluster_utils import Cluster

    from orchestrator.hosts.probe import HostProbe, ProbeConfig
    from orchestrator.protocol import HookRef

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.load)]
    try:
        node, reference = [n["NodeID"] for n in ray.nodes() if n["Alive"]][1:3]
        env = {"JAX_PLATFORMS": "cpu"}
        slow = HookRef("orchestrator.chaos.host:HostFaults", {"slow_step": (0, args.factor)})
        slowed = HostProbe(env, lambda n: slow if n == node else None)
        found = {
            "healthy": ratios(HostProbe(env), node, reference, args.probes),
            f"{args.factor:g}x slow": ratios(slowed, node, reference, args.probes),
        }
    finally:
        for hog in hogs:
            hog.kill()
        ray.shutdown()
        cluster.shutdown()
    limit = ProbeConfig().healthy
    print(f"probes: {args.probes} each, {args.load} busy processes beside; a probe passes at {limit}x or less")
    print("| node | ratios (its time over the peer's) | range | median | passed |")
    print("|---|---|---|---|---|")
    for kind, got in found.items():
        passed = sum(r <= limit for r in got)
        print(f"| {kind} | {', '.join(f'{r:.2f}' for r in got)} | {min(got):.2f} to {max(got):.2f} | "
              f"{statistics.median(got):.2f} | {passed} of {len(got)} |")  # fmt: skip


if __name__ == "__main__":
    main()
