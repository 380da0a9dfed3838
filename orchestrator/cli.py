"""The `remesh` command line: run, plan, ckpt."""
from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="remesh", description="Elastic training orchestrator for JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a job on an embedded local Ray cluster (or --address)")
    run.add_argument("job", help="job file (TOML)")
    run.add_argument("--summary", help="write the run summary (JSON) here")
    run.add_argument("--chaos", help="fault injection, e.g. lose@40,add@80 or lose-in-save@50:0")
    run.add_argument("--checkpoint-dir", help="override the job file's checkpoint.dir")
    run.add_argument("--hosts", type=int, help="emulated hosts to start with (default: hosts.max)")
    run.add_argument("--address", help="run on the Ray cluster at this address instead of an embedded one")

    plan = sub.add_parser("plan", help="plan a function: MODULE:ATTR returns (fn, args)")
    plan.add_argument("target")
    plan.add_argument("--devices", type=int, required=True)
    plan.add_argument("--hardware", default="h100")
    plan.add_argument("--level", default="fast", choices=("fast", "thorough"),
                      help="fast: tactics (dp, fsdp, Megatron, experts) on data x model meshes, model within a host; "
                           "thorough: every (data, seq, model) mesh, then an exact ILP over every weight's split")
    plan.add_argument("--json", action="store_true")
    plan.add_argument("--planner", default="search", choices=("search", "shapes"),
                      help="search: the factor-graph search (what jobs use); shapes: data parallel or FSDP from shapes alone")
    plan.add_argument("--verify", action="store_true",
                      help="also compile the plan (on N fake CPU devices unless N devices exist) and show what XLA does")

    ckpt = sub.add_parser("ckpt", help="list, inspect and verify checkpoints (remesh or plain Orbax)")
    ckpt.add_argument("action", choices=("ls", "inspect", "verify"))
    ckpt.add_argument("path")
    ckpt.add_argument("--step", type=int, help="one step (default: the newest; verify: all)")
    ckpt.add_argument("--devices", type=int, help="inspect: what a restore onto this many devices would read")
    ckpt.add_argument("--devices-per-host", type=int, help="inspect: devices per host (default: all on one host)")
    ckpt.add_argument("--hardware", default="cpu", help="inspect: hardware profile to plan the restore for")
    ckpt.add_argument("--json", action="store_true")

    args = parser.parse_args(argv)
    try:
        return {"run": _run, "plan": _plan, "ckpt": _ckpt}[args.command](args)
    except (ValueError, KeyError, FileNotFoundError, MemoryError) as e:
        # Every error a user can cause is one of these, with a message that says how to fix it.
        print(f"remesh {args.command}: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from .jobfile import load_job
    from .run import run_job

    job = load_job(args.job)
    if args.checkpoint_dir:
        job = job.with_checkpoint_dir(args.checkpoint_dir)
    summary = run_job(job, chaos=args.chaos, address=args.address, hosts=args.hosts)
    if args.summary:
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
        summary.write(args.summary)
    _print_summary(summary, args.summary)
    return 0 if summary.state == "finished" else 1


def _print_summary(summary, path) -> None:
    d = summary.to_dict()
    losses = [l for l in d["losses"] if l is not None]
    print(f"\n{d['job']}: {d['state']} after {d['steps_completed']}/{d['steps']} steps in {d['wall_seconds']:.1f} s"
          + (f" ({d['reason']})" if d["reason"] else ""))
    if losses:
        print(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    for s in d["segments"]:
        mesh = " x ".join(f"{k}={v}" for k, v in s["mesh"].items())
        print(f"  segment: steps {s['first_step']}-{s['last_step']} on {s['hosts']} hosts, {s['devices']} devices, mesh {mesh}")
    for r in d["recovery_seconds"]:
        print(f"  recovery after host loss: {r:.1f} s")
    if path:
        print(f"  summary written to {path}")


def _plan(args) -> int:
    import importlib

    if args.verify and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Before jax is imported: lets a machine without N accelerators compile the plan on CPU.
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    import partitioner

    sys.path.insert(0, os.getcwd())
    module, _, attr = args.target.partition(":")
    fn, fargs = getattr(importlib.import_module(module), attr)()
    if args.planner == "shapes":
        p = partitioner.plan_by_shapes(fn, *fargs, devices=args.devices, hardware=args.hardware)
    else:
        p = partitioner.plan(fn, *fargs, devices=args.devices, hardware=args.hardware, level=args.level)
    if args.json:
        print(p.to_json())
        return 0
    print(p.describe())
    c = p.cost
    print(f"  predicted step: {c.total_seconds * 1e3:.3f} ms (compute {c.compute_seconds * 1e3:.3f} ms, "
          f"communication {c.communication_seconds * 1e3:.3f} ms); peak {c.peak_bytes_per_device / 2**20:.1f} MiB/device")
    for kind, n in c.collective_bytes.items():
        print(f"  {kind}: {n / 2**20:.2f} MiB per device")
    for n in p.notes:
        print(f"  note: {n}")
    print(f"  searched in {p.search_seconds:.3f} s")
    if args.verify:
        v = partitioner.verify(p, fn, *fargs, hardware=args.hardware)
        print("compiled by XLA:")
        print("\n".join("  " + line for line in v.table().splitlines()))
    return 0


def _ckpt(args) -> int:
    from . import ckpt_cmd

    return ckpt_cmd.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
