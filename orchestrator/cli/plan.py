"""`remesh plan`: plan a job's step (JOB.toml) or a function (MODULE:ATTR returns (fn, args))."""

from __future__ import annotations

import os


def run(args) -> int:

    if args.verify and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Before jax is imported: lets a machine without N accelerators compile the plan on CPU.
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
        )
    import partitioner

    from ..job.program import importable_from_here

    importable_from_here()
    fn, fargs, hardware, level, planner, pipeline = _target(args)
    if planner == "shapes" and args.slices != 1:
        raise SystemExit(
            "remesh plan: --slices needs the search planner (--planner search): plans by shapes see no slices"
        )
    if planner == "shapes":
        p = partitioner.plan_by_shapes(fn, *fargs, devices=args.devices, hardware=hardware)
    else:
        p = partitioner.plan(
            fn, *fargs, devices=args.devices, hardware=hardware, level=level, slices=args.slices, pipeline=pipeline
        )
    if args.json:
        print(p.to_json())
        return 0
    print(p.describe())
    c = p.cost
    print(
        f"  predicted step: {c.total_seconds * 1e3:.3f} ms (compute {c.compute_seconds * 1e3:.3f} ms, "
        f"communication {c.communication_seconds * 1e3:.3f} ms); peak {c.peak_bytes_per_device / 2**20:.1f} MiB/device"
    )
    for kind, n in c.collective_bytes.items():
        print(f"  {kind}: {n / 2**20:.2f} MiB per device")
    for level, n in sorted((c.level_bytes or {}).items()):
        print(f"  over {level} links: {n / 2**20:.2f} MiB per device")
    for n in p.notes:
        print(f"  note: {n}")
    print(f"  searched in {p.search_seconds:.3f} s")
    if args.verify:
        v = partitioner.verify(p, fn, *fargs, hardware=hardware)
        print("compiled by XLA:")
        print("\n".join("  " + line for line in v.table().splitlines()))
    return 0


def _target(args):
    """(fn, args, hardware, level, planner, pipeline) for `remesh plan`: from a job file, its step on its
    abstract state and batch, planned as the job plans it (its hardware, its planner and level) unless
    the options say otherwise; from MODULE:ATTR, what ATTR() returns, priced with --hardware (default
    h100)."""
    import importlib

    if args.target.endswith(".toml"):
        from ..job.jobfile import load_job
        from ..job.program import check_program, load_program

        job = load_job(args.target)
        program = load_program(job.program, job.settings())
        state, batch = check_program(program, job.global_batch, job.seed)
        planner = args.planner or ("search" if job.search_level else "shapes")
        level = args.level or job.search_level or "fast"
        pipeline = args.pipeline or job.pipeline
        return program.step, (state, batch), args.hardware or job.hardware, level, planner, pipeline
    module, _, attr = args.target.partition(":")
    fn, fargs = getattr(importlib.import_module(module), attr)()
    return fn, fargs, args.hardware or "h100", args.level or "fast", args.planner or "search", args.pipeline or "auto"
