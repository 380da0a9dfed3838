"""Recovery after a host loss: remesh against Ray Train's elastic JaxTrainer, side by side.

    .venv/bin/pip install -e ".[bench]"   # Ray Train and its dependencies
    .venv/bin/python benchmarks/recovery_vs_raytrain.py --runs 3

Both train examples/gpt's GPT (global batch 24) for 60 steps on an embedded Ray cluster of 4
emulated hosts x 2 fake CPU devices (`LocalCluster`: the same health-check settings for both),
and lose the last host once step 40 is reported. Runs alternate, remesh first. Measured for both:
from the kill to the first step completed after it by the group that replaced the one hit (remesh:
its loss detection latency plus its `recovery_seconds`; Ray Train: rank 0's first step from a new
process), and the steps computed again.

Ray Train, with its own settings tuned for fast recovery (Ray 2.60, Train v2):
  - elastic: `ScalingConfig(num_workers=(2, 4))`, one worker per host (`remesh_host: 1`), and
    `elastic_resize_monitor_interval_s=1`; `FailureConfig(max_failures=3)`;
  - `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.1` (default 2 s);
  - JAX's persistent compilation cache on, as in remesh;
  - a checkpoint every 10 steps, as the demo: rank 0 writes the replicated state (`np.savez`, no
    pickle) and reports it; a restart restores `ray.train.get_checkpoint()`;
  - data parallel over every device with the state replicated: the plan a JaxTrainer user writes
    by hand, since JaxTrainer does not plan (remesh's demo plan is data x model on 8 devices).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

STEPS, LOSE_AT, EVERY, GLOBAL_BATCH = 60, 40, 10, 24


def train_loop(config: dict) -> None:
    """One Ray Train worker: the JAX training loop a JaxTrainer user writes."""
    import jax
    import numpy as np
    import ray.train
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from examples.gpt.model import program

    jax.config.update("jax_compilation_cache_dir", config["cache"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    # JaxConfig joins a jax.distributed group on TPUs and GPUs only; on CPUs the user does it.
    from ray.train.collective import broadcast_from_rank_zero

    coordinator = None
    if rank == 0:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            coordinator = f"{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"
    coordinator = broadcast_from_rank_zero(coordinator)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, ctx.get_world_size(), rank)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    abstract = jax.eval_shape(program.init, jax.random.key(0))
    state_sh = jax.tree.map(lambda _: replicated, abstract)
    step = jax.jit(program.step, out_shardings=(state_sh, replicated), donate_argnums=(0,))
    start, state = 0, None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            saved = np.load(os.path.join(d, "state.npz"))
            leaves = [saved[f"leaf{i}"] for i in range(len(saved.files) - 1)]
            start = int(saved["step"])
        treedef = jax.tree.structure(abstract)
        keys = [jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) for x in jax.tree.leaves(abstract)]
        leaves = [jax.random.wrap_key_data(x) if k else x for x, k in zip(leaves, keys)]
        state = jax.device_put(jax.tree.unflatten(treedef, leaves), state_sh)
    else:
        state = jax.jit(program.init, out_shardings=state_sh)(jax.random.key(0))
    for i in range(start, config["steps"]):
        host = program.batch(i, GLOBAL_BATCH)
        batch = jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, rows, lambda idx, x=x: x[idx]), host)
        state, metrics = step(state, batch)
        loss = float(metrics["loss"])
        if rank == 0:
            with open(config["progress"], "a") as f:
                line = {
                    "step": i + 1,
                    "t": time.time(),
                    "workers": ctx.get_world_size(),
                    "loss": loss,
                    "pid": os.getpid(),
                }
                f.write(json.dumps(line))
                f.write("\n")
        saved = None
        if (i + 1) % EVERY == 0 and rank == 0:
            saved = tempfile.mkdtemp()
            leaves = [
                jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
                for x in jax.tree.leaves(state)
            ]
            arrays = {f"leaf{n}": np.asarray(jax.device_get(x)) for n, x in enumerate(leaves)}
            np.savez(os.path.join(saved, "state.npz"), step=np.int64(i + 1), **arrays)
        report = {"step": i + 1, "loss": loss}
        if saved is not None:
            ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(saved))
        else:
            ray.train.report(report)


def ray_train_run(workdir: str) -> dict:
    """One JaxTrainer run with a host killed after step 40; times from its progress file."""
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.1"
    import ray

    from orchestrator.hosts.cluster import LocalClusterConfig

    cluster = LocalClusterConfig(hosts=4, devices_per_host=2).create()
    try:
        ray.shutdown()  # again, with the hosts' environment for every worker of this job
        env = {
            **cluster.host_env(),
            "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "benchmarks")]),
            "RAY_TRAIN_V2_ENABLED": "1",
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
        }
        ray.init(address=cluster.address, runtime_env={"env_vars": env}, log_to_driver=False)
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.v2.jax import JaxTrainer

        progress = os.path.join(workdir, "progress.jsonl")
        open(progress, "w").close()
        killed = {}
        watcher = threading.Thread(target=_kill_after, args=(cluster, progress, killed), daemon=True)
        watcher.start()
        trainer = JaxTrainer(
            train_loop,
            train_loop_config={"steps": STEPS, "progress": progress, "cache": os.path.join(workdir, "xla-cache")},
            scaling_config=ScalingConfig(
                num_workers=(2, 4), resources_per_worker={"remesh_host": 1}, elastic_resize_monitor_interval_s=1
            ),
            run_config=RunConfig(
                storage_path=os.path.join(workdir, "storage"), failure_config=FailureConfig(max_failures=3)
            ),
        )
        trainer.fit()
        watcher.join(timeout=5)
    finally:
        cluster.shutdown()
    lines = [json.loads(x) for x in open(progress)]
    before = [x for x in lines if x["t"] <= killed["at"]]
    # The first step of a new worker group: the old one may still finish a step it had in flight
    # after the kill, before it sees the loss.
    after = [x for x in lines if x["t"] > killed["at"] and x["pid"] != before[-1]["pid"]]
    reached = max(x["step"] for x in before)
    return {
        "kill_to_first_step_s": after[0]["t"] - killed["at"],
        "recomputed_steps": reached - (after[0]["step"] - 1),
        "workers_after": after[0]["workers"],
        "steps_completed": lines[-1]["step"],
    }


def _kill_after(cluster, progress: str, killed: dict, timeout_s: float = 600) -> None:
    """Kill the last worker host once step 40 is in the progress file."""
    import ray

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        with open(progress) as f:
            steps = [json.loads(x)["step"] for x in f if x.strip()]
        if steps and max(steps) >= LOSE_AT:
            break
        time.sleep(0.02)
    hosts = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("remesh_host"))
    killed["at"] = time.time()
    cluster.kill_host(hosts[-1])


def remesh_run() -> dict:
    from recovery import one_run

    s = one_run(STEPS, f"lose@{LOSE_AT}")
    lost = next(e for e in s["events"] if e["kind"] == "host_lost")
    return {
        "kill_to_first_step_s": lost["seconds"] + s["recovery_seconds"][0],
        "recomputed_steps": s["recomputed_steps"][0],
        "devices_after": s["segments"][1]["devices"],
        "steps_completed": s["steps_completed"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rows = {"remesh": [], "ray_train": []}
    for i in range(args.runs):
        rows["remesh"].append(remesh_run())
        print(json.dumps({"run": i, "system": "remesh", **rows["remesh"][-1]}), flush=True)
        with tempfile.TemporaryDirectory(prefix="raytrain-bench-") as d:
            rows["ray_train"].append(ray_train_run(d))
        print(json.dumps({"run": i, "system": "ray_train", **rows["ray_train"][-1]}), flush=True)
    med = {k: statistics.median(r["kill_to_first_step_s"] for r in v) for k, v in rows.items()}
    print(
        json.dumps({"median_kill_to_first_step_s": med, "ratio_remesh_to_ray_train": med["remesh"] / med["ray_train"]})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
