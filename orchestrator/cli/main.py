"""The `remesh` command line: run, submit, status, logs, stop, queue, fleet, dashboard, plan, ckpt."""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remesh", description="Elastic training orchestrator for JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_run, _add_submit, _add_submitted, _add_fleet, _add_dashboard, _add_plan, _add_ckpt):
        add(sub)
    return parser


STORE_HELP = "fleet store (SQLite; default: $REMESH_FLEET_DB or ~/.remesh/fleet.db)"
ADDRESS_HELP = "the Ray dashboard's URL, e.g. http://127.0.0.1:8265"


def _add_run(sub) -> None:
    run = sub.add_parser("run", help="run a job on an embedded local Ray cluster (or --address)")
    run.add_argument("job", help="job file (TOML)")
    run.add_argument("--summary", help="write the run summary (JSON) here")
    run.add_argument("--chaos", help="fault injection, e.g. lose@40,add@80 or lose-in-save@50:0")
    run.add_argument("--checkpoint-dir", help="override the job file's checkpoint.dir")
    run.add_argument("--hosts", type=int, help="emulated hosts to start with (default: hosts.max)")
    run.add_argument("--address", help="run on the Ray cluster at this address instead of an embedded one")
    run.add_argument("--store", help=f"the {STORE_HELP} to record the job in")
    run.add_argument("--no-store", action="store_true", help="record the job in no fleet store")
    run.add_argument(
        "--stop-file",
        help="a preemption notice: when this file appears, commit the step reached and stop, as on SIGTERM "
        "(deploy/kuberay: a preStop hook touches it)",
    )


def _add_submit(sub) -> None:
    submit = sub.add_parser("submit", help="submit a job to a running Ray cluster (Ray Jobs API)")
    submit.add_argument("job", help="job file (TOML)")
    submit.add_argument("--address", required=True, help=ADDRESS_HELP)
    submit.add_argument(
        "--working-dir",
        help="upload this directory as the job's working directory "
        "(default: none; the head node must see this directory)",
    )
    submit.add_argument(
        "--python", default=sys.executable, help="the head node's Python with remesh installed (default: this one)"
    )
    submit.add_argument("--store", help="fleet store path as the head node sees it")
    submit.add_argument("--summary", help="where the head node writes the run summary (JSON)")
    submit.add_argument("--chaos", help="fault injection that needs no control of nodes: slow@S[:H] (a straggler)")
    submit.add_argument("--hosts", type=int, help="run on at most this many hosts (default: the job file's hosts.max)")
    submit.add_argument(
        "--stop-file",
        help="a preemption notice, as the head node sees the path: when this file appears, commit the step "
        "reached and stop (as remesh run --stop-file)",
    )


def _add_submitted(sub) -> None:
    """status, logs and stop: what to ask of a submitted job."""
    for name, text in (
        ("status", "a submitted job's state (all remesh jobs without an id)"),
        ("logs", "a submitted job's output"),
        ("stop", "stop a submitted job"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("id", nargs="?" if name == "status" else None, help="submission id (from remesh submit)")
        p.add_argument("--address", required=True, help=ADDRESS_HELP)
        if name == "status":
            p.add_argument("--store", help=f"the {STORE_HELP} to read progress from")
            p.add_argument("--dashboard", help="read progress from a `remesh dashboard` at this URL instead")
            p.add_argument("--json", action="store_true")
        if name == "logs":
            p.add_argument("--follow", "-f", action="store_true")


def _add_fleet(sub) -> None:
    """queue, and fleet start: the cluster's fleet scheduler."""
    fleet_address = ADDRESS_HELP + ", or a Ray cluster address (auto, host:port) to connect to directly"
    q = sub.add_parser("queue", help="the jobs on a shared cluster: running and queued, their hosts and why each waits")
    q.add_argument("--address", required=True, help=fleet_address)
    q.add_argument("--json", action="store_true")
    f = sub.add_parser("fleet", help="start the cluster's fleet scheduler with a fleet file's queues and quotas")
    f.add_argument("action", choices=("start",))
    f.add_argument("--address", required=True, help=fleet_address)
    f.add_argument("--config", help="fleet file (TOML): [queues.NAME] hosts = N (README, 'Sharing a cluster')")
    f.add_argument("--quotas", help=argparse.SUPPRESS)  # the quotas as JSON, when it runs itself on the cluster
    f.add_argument("--json", action="store_true")


def _add_dashboard(sub) -> None:
    dash = sub.add_parser("dashboard", help="serve the fleet dashboard and its JSON API")
    dash.add_argument("--store", help=STORE_HELP)
    dash.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    dash.add_argument("--port", type=int, default=8266)


def _add_plan(sub) -> None:
    plan = sub.add_parser("plan", help="plan a job's step (JOB.toml) or a function (MODULE:ATTR returns (fn, args))")
    plan.add_argument("target", help="a job file (its program, batch, hardware and planner level) or MODULE:ATTR")
    plan.add_argument("--devices", type=int, required=True)
    plan.add_argument(
        "--slices",
        type=int,
        default=1,
        help="the devices are this many equal slices (TPU slices, NVLink domains) joined by the slower network",
    )
    plan.add_argument("--hardware", help="hardware profile (default: the job's; h100 for MODULE:ATTR)")
    plan.add_argument(
        "--level",
        default=None,
        choices=("fast", "thorough"),
        help="fast (default, or the job's planner level): tactics (dp, fsdp, Megatron, experts) on data x model "
        "meshes, model within a host; thorough: every (data, seq, model) mesh, then an exact ILP over every weight's split",
    )
    plan.add_argument(
        "--pipeline",
        type=_pipeline_arg,
        default=None,
        help="auto (default, or the job's): pipeline the step's layer scan where predicted faster; off; or N stages "
        "(the nearest count that fits the layers and devices)",
    )
    plan.add_argument("--json", action="store_true")
    plan.add_argument(
        "--planner",
        default=None,
        choices=("search", "shapes"),
        help="search (default, or the job's planner): the factor-graph search; shapes: data parallel or FSDP "
        "from shapes alone",
    )
    plan.add_argument(
        "--verify",
        action="store_true",
        help="also compile the plan (on N fake CPU devices unless N devices exist) and show what XLA does",
    )


def _pipeline_arg(text: str) -> str | int:
    if text in ("auto", "off"):
        return text
    if text.isdigit() and int(text) >= 2:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected auto, off or a number of stages of at least 2, got {text!r}")


def _add_ckpt(sub) -> None:
    ckpt = sub.add_parser("ckpt", help="list, inspect and verify checkpoints (remesh or plain Orbax)")
    ckpt.add_argument("action", choices=("ls", "inspect", "verify"))
    ckpt.add_argument("path")
    ckpt.add_argument("--step", type=int, help="one step (default: the newest; verify: all)")
    ckpt.add_argument("--devices", type=int, help="inspect: what a restore onto this many devices would read")
    ckpt.add_argument("--devices-per-host", type=int, help="inspect: devices per host (default: all on one host)")
    ckpt.add_argument("--hardware", default="cpu", help="inspect: hardware profile to plan the restore for")
    ckpt.add_argument("--json", action="store_true")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = {
        "run": _run,
        "plan": _plan,
        "ckpt": _ckpt,
        "submit": _submit,
        "queue": _queue,
        "fleet": _fleet,
        "status": _status,
        "logs": _logs,
        "stop": _stop,
        "dashboard": _dashboard,
    }[args.command]
    try:
        return command(args)
    except Exception as e:
        if not _users_error(e):
            raise
        print(f"remesh {args.command}: error: {e}", file=sys.stderr)
        return 2


def _users_error(e: Exception) -> bool:
    """Every error a user can cause is one of these, with a message that says how to fix it. An
    unknown hardware profile is a KeyError, as a missing key in a mapping is; any other KeyError
    is a bug and keeps its traceback. (The partitioner is not imported for this: `remesh plan
    --verify` must set XLA_FLAGS before jax is imported.)"""
    kinds = [ValueError, FileNotFoundError, MemoryError]
    if (hardware := sys.modules.get("partitioner.hardware")) is not None:
        kinds.append(hardware.UnknownHardwareError)
    return isinstance(e, tuple(kinds))


def _run(args) -> int:
    from ..dashboard.store import FleetStoreConfig
    from ..job.jobfile import load_job
    from ..launch import run_job

    job = load_job(args.job)
    if args.checkpoint_dir:
        job = job.with_checkpoint_dir(args.checkpoint_dir)
    store = None if args.no_store else FleetStoreConfig(path=args.store or "")
    config = None
    if args.stop_file:
        from ..control.controller import ControllerConfig

        config = ControllerConfig(stop_file=os.path.abspath(args.stop_file))
    summary = run_job(job, chaos=args.chaos, address=args.address, hosts=args.hosts, store=store, config=config)
    if args.summary:
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
        summary.write(args.summary)
    _print_summary(summary, args.summary)
    return 0 if summary.state == "finished" else 1


def _queue(args) -> int:
    from .fleet import print_queue, queue

    print_queue(queue(args.address), args.json)
    return 0


def _fleet(args) -> int:
    import json

    from .fleet import start_fleet, start_with

    if args.quotas is not None:  # on the cluster, for a `remesh fleet start --address http://...`
        answer = start_with(args.address, json.loads(args.quotas))
    else:
        answer = start_fleet(args.address, args.config)
    if args.json:
        print(json.dumps(answer))
    else:
        said = "started" if answer["started"] else "already running (its queues are kept)"
        quotas = ", ".join(
            f"{q}: {'no limit' if n is None else f'{n} hosts'}" for q, n in sorted(answer["quotas"].items())
        )
        print(f"fleet scheduler {said}; queues: {quotas}")
    return 0


def _submit(args) -> int:
    from .submit import SubmitConfig, submit

    sid = submit(
        args.job,
        SubmitConfig(
            address=args.address,
            python=args.python,
            working_dir=args.working_dir,
            store=args.store,
            summary=args.summary,
            hosts=args.hosts,
            stop_file=args.stop_file,
        ),
        chaos=args.chaos,
    )
    print(sid)
    return 0


def _status(args) -> int:
    import dataclasses
    import json

    from .submit import list_jobs, status

    where = {"store": args.store, "dashboard": args.dashboard}
    found = [status(args.address, args.id, **where)] if args.id else list_jobs(args.address, **where)
    if args.json:
        print(json.dumps([dataclasses.asdict(s) for s in found], indent=2))
    else:
        for s in found:
            print(s.line())
    return 0


def _logs(args) -> int:
    from .submit import logs

    logs(args.address, args.id, follow=args.follow)
    return 0


def _stop(args) -> int:
    from .submit import stop

    print(f"{args.id}: {'stop requested' if stop(args.address, args.id) else 'already finished'}")
    return 0


def _dashboard(args) -> int:
    from ..dashboard.server import DashboardConfig, make_server
    from ..dashboard.store import FleetStoreConfig

    server = make_server(DashboardConfig(host=args.host, port=args.port, store=FleetStoreConfig(path=args.store or "")))
    host, port = server.server_address[:2]
    print(
        f"remesh dashboard on http://{host}:{port}/ (store {server.RequestHandlerClass.store.path}); Ctrl-C stops it",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def _print_summary(summary, path) -> None:
    from partitioner import mesh_text

    d = summary.to_dict()
    losses = [leaf for leaf in d["losses"] if leaf is not None]
    print(
        f"\n{d['job']}: {d['state']} after {d['steps_completed']}/{d['steps']} steps in {d['wall_seconds']:.1f} s"
        + (f" ({d['reason']})" if d["reason"] else "")
    )
    if losses:
        print(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    for s in d["segments"]:
        mesh = mesh_text(s["mesh"], every=True)
        print(
            f"  segment: steps {s['first_step']}-{s['last_step']} on {s['hosts']} hosts, {s['devices']} devices, mesh {mesh}"
        )
    for r in d["recovery_seconds"]:
        print(f"  recovery after host loss: {r:.1f} s")
    t = d["throughput"]
    if t.get("steps_measured"):
        print(
            f"  throughput: {t['tokens_per_second']:,.0f} tokens/s, step {t['step_seconds'] * 1e3:.1f} ms, "
            f"MFU {t['mfu']:.2%} ({t['model_flops_per_step'] / 1e9:.2f} GFLOP a step, median of {t['steps_measured']} steps)"
        )
    g = d["goodput"]
    if g and g["wall_seconds"] > 0:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in g["badput_seconds"].items())
        print(
            f"  goodput: {g['goodput_ratio']:.1%} ({g['useful_seconds']:.1f} s of useful steps in {g['wall_seconds']:.1f} s); "
            f"badput: {parts}"
        )
    if path:
        print(f"  summary written to {path}")


def _plan(args) -> int:
    from . import plan

    return plan.run(args)


def _ckpt(args) -> int:
    from . import ckpt as ckpt_cmd

    return ckpt_cmd.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
