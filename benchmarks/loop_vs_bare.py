"""The step loop through remesh against a bare jitted loop: same program, same plan, same devices.

    .venv/bin/python benchmarks/loop_vs_bare.py [--steps 40] [--rounds 3] [--devices 8]

The example GPT (`examples/gpt/model.py`, scaled up so a step takes tens of milliseconds) trained
on a uint16 token file through `TokenFiles`, planned once for the devices. remesh: the per-host
worker as a plain function (`orchestrator.worker.segment.run_segment`, as a host actor runs it), with
checkpoints only at the end; its steps/s is from its own step reports, the steps before the
final save. Bare: the loop a user writes by hand: the plan's jitted step, each step's batch from
the same `HostBatches`, the loss read back every step. Rounds alternate in one process; medians.
On a GPU machine (no Ray there), `--devices 1 --scale h100` runs the same comparison with a
bfloat16 model of about 350M parameters and records MFU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config(scale: str):
    from examples.gpt.model import GPTConfig

    if scale == "h100":  # ~350M parameters, computed in bfloat16
        return GPTConfig(vocab=32768, seq_len=1024, d_model=1024, n_heads=16, n_layers=24, d_ff=4096, dropout=0.0)
    return GPTConfig(vocab=512, seq_len=64, d_model=128, n_heads=4, n_layers=2, d_ff=512, dropout=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--scale", choices=("cpu", "h100"), default="cpu")
    args = parser.parse_args()

    import jax

    from examples.gpt.model import write_tokens

    cfg = config(args.scale)
    with tempfile.TemporaryDirectory() as folder:
        tokens = os.path.join(folder, "train.bin")
        write_tokens(tokens, (args.steps + 2) * args.batch * (cfg.seq_len + 1) + 1, dataclasses.replace(cfg))
        os.environ["REMESH_BENCH_TOKENS"], os.environ["REMESH_BENCH_SCALE"] = tokens, args.scale
        plan_json = _plan(args.devices, args.batch)
        print(
            f"{jax.device_count()} {jax.devices()[0].platform} devices; plan: {json.loads(plan_json)['mesh']}",
            flush=True,
        )
        remesh, bare = [], []
        for r in range(args.rounds):
            remesh.append(_remesh(plan_json, args, os.path.join(folder, f"ckpt{r}")))
            bare.append(_bare(plan_json, args))
            print(f"round {r}: remesh {remesh[-1]:.2f} steps/s, bare {bare[-1]:.2f} steps/s", flush=True)
    m_remesh, m_bare = statistics.median(remesh), statistics.median(bare)
    print(f"median: remesh {m_remesh:.2f} steps/s, bare {m_bare:.2f} steps/s, ratio {m_remesh / m_bare:.3f}")


PROGRAM = "benchmarks.loop_vs_bare:program"


def _program():
    from examples.gpt.model import make_token_program

    return make_token_program([os.environ["REMESH_BENCH_TOKENS"]], config(os.environ["REMESH_BENCH_SCALE"]))


def __getattr__(name):  # `program`, built on first use (the token file's path is set at run time)
    if name == "program":
        return _program()
    raise AttributeError(name)


def _plan(devices: int, batch: int) -> str:
    from orchestrator import check_program, load_program
    from partitioner import plan

    program = load_program(PROGRAM)
    state, abstract_batch = check_program(program, batch)
    return plan(program.step, state, abstract_batch, devices=devices, hardware="cpu", compile_check=False).to_json()


def _remesh(plan_json: str, args, folder: str) -> float:
    from orchestrator.job.jobfile import CheckpointSpec
    from orchestrator.protocol import SegmentSpec
    from orchestrator.worker import run_segment

    spec = SegmentSpec(
        program=PROGRAM,
        steps=args.steps,
        global_batch=args.batch,
        seed=0,
        checkpoint=CheckpointSpec(folder, every=10**9, keep=1),
        plan_json=plan_json,
        coordinator="",
        num_processes=1,
        process_id=0,
        digest=False,
    )
    reports = []
    run_segment(spec, lambda r: reports.append(r.to_dict()))
    times = [r["at"] for r in reports if r["kind"] == "step"][:-1]  # (the last step's report waits on its save)
    # Steady state: from the third step (the first two include warm-up) to the last before the save.
    return (len(times) - 3) / (times[-1] - times[2])


def _bare(plan_json: str, args) -> float:
    import jax

    from orchestrator import load_program
    from orchestrator.job.data import DataPosition, HostBatches
    from orchestrator.job.program import abstract_inputs
    from partitioner import Plan

    program = load_program(PROGRAM)
    plan = Plan.from_json(plan_json)
    mesh = plan.bind(jax.devices())
    abstract_state, abstract_batch = abstract_inputs(program, args.batch)
    state_sh = plan.shardings(mesh, abstract_state, argnum=0)
    batch_sh = plan.shardings(mesh, abstract_batch, argnum=1)
    batches = HostBatches(program.data, DataPosition(args.batch), batch_sh, abstract_batch)
    step = plan.jit(program.step, (abstract_state, abstract_batch), jax.devices(), carry={0: 0}, donate_argnums=(0,))
    state = jax.jit(program.init, out_shardings=state_sh)(jax.random.key(0))
    times = []
    for index in range(args.steps - 1):
        state, metrics = step(state, batches(index))
        float(metrics["loss"])
        times.append(time.perf_counter())
    return (len(times) - 3) / (times[-1] - times[2])


if __name__ == "__main__":
    from _harness import fake_devices

    fake_devices(8)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    main()
