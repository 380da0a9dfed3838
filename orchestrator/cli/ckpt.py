"""`remesh ckpt ls|inspect|verify PATH`: what is stored, under which plan, whether it is intact,
and what a restore onto a given device count would read."""

from __future__ import annotations

import dataclasses
import json
import os
import time


def run(args) -> int:
    from checkpoint import Store

    store = Store(args.path)
    if not store.steps():
        raise FileNotFoundError(
            f"no committed checkpoint in {store.path}: expected step directories (remesh or Orbax) there"
        )
    return {"ls": _ls, "inspect": _inspect, "verify": _verify}[args.action](store, args)


def _ls(store, args) -> int:
    rows = []
    for step in store.steps():
        m = store.metadata(step)
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(m["dir"])))
        rows.append({"step": step, "format": m["kind"], "bytes": _size(m), "leaves": len(m["leaves"]),
                     "saved_under": _mesh(m), "data_position": m["meta"].get("data_position"), "written": written})  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'step':>8}  {'format':<7} {'size':>10}  {'leaves':>6}  {'saved under':<24} data position  written")
    for r in rows:
        position = "-" if r["data_position"] is None else r["data_position"]
        print(f"{r['step']:>8}  {r['format']:<7} {_human(r['bytes']):>10}  {r['leaves']:>6}  {r['saved_under']:<24} "
              f"{position!s:>13}  {r['written']}")  # fmt: skip
    return 0


def _inspect(store, args) -> int:
    m = store.metadata(args.step)
    doc = {
        "step": m["step"],
        "format": m["kind"],
        "dir": m["dir"],
        "bytes": _size(m),
        "saved_under": _mesh(m),
        "meta": m["meta"],
        "leaves": m["leaves"],
    }
    if args.devices:
        doc["restore"] = _restore_estimate(store, m, args)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(
        f"step {m['step']} ({m['kind']} format) in {m['dir']}: {_human(doc['bytes'])}, saved under {doc['saved_under']}"
    )
    print("meta: " + ", ".join(f"{k}={v}" for k, v in m["meta"].items() if k != "digest"))
    estimates = {e["path"]: e for e in doc.get("restore", {}).get("leaves", [])}
    print(
        f"{'leaf':<36} {'shape':<16} {'dtype':<9} {'saved spec':<14} {'chunk':<14}"
        + ("  restore spec   needs/host  reads/host" if estimates else "")
    )
    for leaf in m["leaves"]:
        saved = (leaf.get("sharding") or {}).get("spec")
        line = f"{leaf['path']:<36} {str(leaf['shape']):<16} {leaf['dtype']:<9} {str(saved if saved is not None else '-'):<14} {str(leaf['chunk_shape']):<14}"
        if leaf["path"] in estimates:
            e = estimates[leaf["path"]]
            line += f"  {str(e['spec']):<14} {_human(e['bytes_needed']):>10}  {_human(e['bytes_read']):>10}"
        print(line)
    if "restore" in doc:
        r = doc["restore"]
        print(
            f"restore onto {args.devices} devices ({r['hosts']} hosts x {r['devices_per_host']}), {r['plan']}: each host needs "
            f"at most {_human(r['bytes_needed'])} and reads {_human(r['bytes_read'])} (x{r['amplification']:.3f})"
        )
    return 0


def _restore_estimate(store, m: dict, args) -> dict:
    from checkpoint.estimate import default_targets, estimate

    src = store.open_step(m["step"])
    per_host = args.devices_per_host or args.devices
    if args.devices % per_host:
        raise ValueError(f"--devices {args.devices} is not a whole number of hosts of --devices-per-host {per_host}")
    targets, how = _planned_targets(m, args)
    if targets is None:
        targets = default_targets(src.leaves, args.devices)
    targets = {p: t for p, t in targets.items() if p in src.leaves}
    rows = estimate(src.leaves, targets, per_host)
    needed, read = sum(r.bytes_needed for r in rows), sum(r.bytes_read for r in rows)
    return {
        "plan": how,
        "hosts": args.devices // per_host,
        "devices_per_host": per_host,
        "bytes_needed": needed,
        "bytes_read": read,
        "amplification": read / needed if needed else 1.0,
        "leaves": [
            {
                "path": r.path,
                "spec": targets[r.path]["spec"],
                "bytes_needed": r.bytes_needed,
                "bytes_read": r.bytes_read,
            }
            for r in rows
        ],
    }


def _planned_targets(m: dict, args):
    """The partitioner's plan for the program the checkpoint records, if it can be loaded."""
    from ..protocol import CheckpointMeta

    meta = CheckpointMeta.from_dict(m["meta"], step=m["step"], global_batch=0)
    program_ref, batch = meta.program, meta.global_batch
    if not program_ref or not batch:
        return None, f"FSDP over {args.devices} devices on each leaf's first divisible dimension (no program recorded)"
    import jax

    import partitioner
    from checkpoint import leaf_path

    from ..job.program import JobSettings, ProgramError, check_program, importable_from_here, load_program

    importable_from_here()  # programs are named relative to the directory the job ran in
    settings = JobSettings(meta.steps or 0, batch, meta.seed or 0, meta.options or {})
    try:
        program = load_program(program_ref, settings)
    except ProgramError as e:
        return None, f"FSDP over {args.devices} devices on each leaf's first divisible dimension ({e})"
    state, batch_tree = check_program(program, batch)
    plan = partitioner.plan(program.step, state, batch_tree, devices=args.devices, hardware=args.hardware)

    specs = plan.specs_like(state, argnum=0)
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
    targets = {
        leaf_path(k): {"mesh": dict(plan.mesh), "spec": [list(e) if isinstance(e, tuple) else e for e in s]}
        for k, s in flat
    }
    return targets, f"the partitioner's plan for {program_ref}, {plan.describe()}"


def _verify(store, args) -> int:
    steps = [args.step] if args.step is not None else store.steps()
    reports = [store.verify(step) for step in steps]
    bad = sum(not r.ok for r in reports)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in reports], indent=1))
        return 1 if bad else 0
    for r in reports:
        rate = r.bytes_checked / r.seconds / 1e6 if r.seconds else 0.0
        status = "ok" if r.ok else "DAMAGED"
        note = " (Orbax stores no data checksums: read only)" if r.kind == "orbax" else ""
        print(f"step {r.step:>8}  {status:<7}  {_human(r.bytes_checked)} checked in {r.seconds:.2f} s "
              f"({rate:,.0f} MB/s){note}")  # fmt: skip
        for p in r.problems:
            print(f"    {p}")
    if bad:
        print(f"{bad} of {len(steps)} steps are damaged; a job resumes from the newest intact one")
    return 1 if bad else 0


def _size(m: dict) -> int:
    if m["files"]:
        return sum(f["size"] for f in m["files"].values())
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(m["dir"]) for f in fs)


def _mesh(m: dict) -> str:
    mesh = (m.get("plan") or {}).get("mesh")  # a plan's JSON keeps axis order as [[name, size], ...]
    mesh = dict(mesh) if mesh else None
    if not mesh:
        shardings = [leaf["sharding"]["mesh"] for leaf in m["leaves"] if (leaf.get("sharding") or {}).get("mesh")]
        mesh = shardings[0] if shardings else None
    from partitioner import mesh_text

    return mesh_text(mesh, every=True) if mesh else "-"


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
