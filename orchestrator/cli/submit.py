"""`remesh submit|status|logs|stop`: jobs on a running Ray cluster, through the Ray Jobs API.

The submitted entrypoint is `remesh run JOB --address auto`: the job controller runs as the Ray
job's driver on the head node and places its host actors on the cluster's `remesh_host` nodes.
Ray's token authentication applies as everywhere (the client reads RAY_AUTH_TOKEN_PATH or
RAY_AUTH_TOKEN). `status` joins what Ray knows (the job's lifecycle) with what remesh knows
(step, mesh, hosts, throughput, goodput) from the fleet store the job writes to: read directly
where this machine sees the file, else through the JSON API of a `remesh dashboard` serving it
(`--dashboard URL`). Never from the job's printed lines, whose wording is for people.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
import time

METADATA_KEY = "remesh_job"
# What a working directory upload leaves behind: environments, runs, VCS data.
UPLOAD_EXCLUDES = [".venv", "venv", ".git", "runs", "__pycache__", "*.pyc", ".pytest_cache"]


class SubmitError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class SubmitConfig:
    address: str  # the Ray dashboard's HTTP address, e.g. http://127.0.0.1:8265
    # The Python on the head node that has remesh installed. The default (this one) suits a head
    # on this machine or a shared filesystem; a container image has its own (`python`).
    python: str = sys.executable
    working_dir: str | None = None  # upload this directory as the job's working directory
    store: str | None = None  # fleet store path as the head node sees it (default: the head's default)
    summary: str | None = None  # where the head node writes the run summary
    hosts: int | None = None  # at most this many hosts (default: the job file's hosts.max)
    stop_file: str | None = None  # a preemption notice, as the head node sees the path (`remesh run --stop-file`)


def client(address: str):
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    if not re.match(r"^https?://", address):
        raise SubmitError(
            f"--address must be the Ray dashboard's HTTP URL, like http://127.0.0.1:8265; got {address!r}"
        )
    try:
        return JobSubmissionClient(address)
    except AuthenticationError as e:
        raise SubmitError(f"the Ray cluster at {address} refused this client's token: {e}") from None
    except ConnectionError as e:
        raise SubmitError(
            f"no Ray dashboard answers at {address} ({e}); is the head running, and is this its --dashboard-port?"
        ) from None


def submission_env(submission_id: str) -> dict[str, str]:
    """The environment a submitted run (and its job supervisor) gets. The run records itself
    under its submission id, so status finds this submission, not the latest run of the job's
    name. `remesh stop` (Ray's job stop) sends SIGTERM, then SIGKILL after the supervisor's
    RAY_JOB_STOP_WAIT_TIME_S (3 s by default), read from this environment: the run gets the grace
    a stop promises (commit the step reached, write its summary; `stop_grace_s`), and 10 s more."""
    from ..control.controller import ControllerConfig

    wait = int(ControllerConfig().stop_grace_s) + 10
    return {"REMESH_RUN_ID": submission_id, "RAY_JOB_STOP_WAIT_TIME_S": str(wait)}


def submit(job_path: str, config: SubmitConfig, *, chaos: str | None = None) -> str:
    """Submit the job file at `job_path`; returns the submission id. The job file is checked here
    first, so a broken one is refused before anything reaches the cluster."""
    from ..chaos import ANY_CLUSTER, parse_chaos
    from ..job.jobfile import load_job

    job = load_job(job_path)
    if chaos and any(f.kind not in ANY_CLUSTER for f in parse_chaos(chaos)):
        raise SubmitError(
            f"--chaos {chaos!r}: on a running cluster only {', '.join(ANY_CLUSTER)} faults apply; losing "
            "and adding hosts needs the embedded cluster (remesh run), or stop a node yourself"
        )
    runtime_env = {}
    if config.working_dir:
        wd = os.path.abspath(config.working_dir)
        rel = os.path.relpath(os.path.abspath(job_path), wd)
        if rel.startswith(".."):
            raise SubmitError(
                f"the job file {job_path} must lie inside --working-dir {config.working_dir} to be uploaded with it"
            )
        runtime_env = {"working_dir": wd, "excludes": UPLOAD_EXCLUDES}
        cd, job_arg = "", rel
    else:
        # No upload: the head node sees this directory (same machine or a shared filesystem).
        cd, job_arg = f"cd {shlex.quote(os.getcwd())} && ", os.path.abspath(job_path)
    args = [config.python, "-m", "orchestrator.cli", "run", job_arg, "--address", "auto"]
    if config.store:
        args += ["--store", config.store]
    if config.summary:
        args += ["--summary", config.summary]
    if chaos:
        args += ["--chaos", chaos]
    if config.hosts:
        args += ["--hosts", str(config.hosts)]
    if config.stop_file:
        args += ["--stop-file", config.stop_file]
    submission_id = f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(2).hex()}"
    runtime_env["env_vars"] = submission_env(submission_id)
    return client(config.address).submit_job(
        entrypoint=cd + shlex.join(args),
        submission_id=submission_id,
        runtime_env=runtime_env,
        metadata={METADATA_KEY: job.name},
    )


@dataclasses.dataclass(frozen=True)
class JobStatus:
    submission_id: str
    job: str
    ray_status: str  # PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED
    message: str
    remesh: dict  # from the fleet store (state, steps_completed, mesh, hosts, ...) or the logs

    def line(self) -> str:
        """One line for people (`remesh status` without --json)."""
        r = self.remesh
        parts = [f"{self.submission_id}: {self.ray_status}"]
        if not r:
            parts.append(f"(remesh's own state is in the fleet store: {NO_STORE})")
        if r.get("state"):
            parts.append(f"remesh {r['state']}")
        if r.get("steps_completed") is not None and r.get("steps"):
            parts.append(f"step {r['steps_completed']}/{r['steps']}")
        if r.get("mesh"):
            from partitioner import mesh_text

            parts.append("mesh " + mesh_text(r["mesh"], every=True))
        if r.get("hosts"):
            parts.append(f"hosts {r['hosts']}")
        if r.get("tokens_per_second"):
            parts.append(f"{r['tokens_per_second']:,.0f} tok/s")
        if r.get("mfu") is not None:
            parts.append(f"MFU {r['mfu']:.2%}")
        if r.get("goodput_ratio") is not None:
            parts.append(f"goodput {r['goodput_ratio']:.1%}")
        if r.get("reason"):
            parts.append(f"({r['reason']})")
        return "  ".join(parts)


NO_STORE = "pass --store PATH where this machine sees the file, or --dashboard URL of a `remesh dashboard` serving it"


def _job(c, submission_id: str, call: str):
    """`c.<call>(submission_id)` on a JobSubmissionClient, with an unknown id said plainly."""
    try:
        return getattr(c, call)(submission_id)
    except RuntimeError as e:
        if "404" in str(e) or "does not exist" in str(e):
            raise SubmitError(
                f"no job {submission_id!r} on the cluster at {c.get_address()}; `remesh status "
                f"--address ...` lists the remesh jobs there"
            ) from None
        raise


def status(address: str, submission_id: str, *, store: str | None = None, dashboard: str | None = None) -> JobStatus:
    c = client(address)
    info = _job(c, submission_id, "get_job_info")
    name = (info.metadata or {}).get(METADATA_KEY) or submission_id
    return JobStatus(
        submission_id, name, str(info.status.value), info.message or "",
        remesh_state(name, store, dashboard, submission_id),
    )  # fmt: skip


def list_jobs(address: str, *, store: str | None = None, dashboard: str | None = None) -> list[JobStatus]:
    c = client(address)
    out = []
    for info in c.list_jobs():
        name = (info.metadata or {}).get(METADATA_KEY)
        if name and info.submission_id:
            remesh = remesh_state(name, store, dashboard, info.submission_id)
            out.append(JobStatus(info.submission_id, name, str(info.status.value), info.message or "", remesh))
    return out


def remesh_state(name: str, store: str | None = None, dashboard: str | None = None, submission: str = "") -> dict:
    """The run submitted as `submission` as the fleet store holds it (without one, job `name`'s
    latest run; {} where it holds none): from the dashboard at `dashboard` when given, else from
    the store file (default: `default_path()`)."""
    return _from_dashboard(name, dashboard, submission) if dashboard else _from_store(name, store, submission)


def _from_store(name: str, store: str | None, submission: str = "") -> dict:
    from ..dashboard.store import FleetStore, default_path

    path = store or default_path()
    if not os.path.exists(path):
        return {}
    s = FleetStore(path)
    try:
        return (s.submitted(submission) if submission else s.job(name)) or {}
    finally:
        s.close()


def _from_dashboard(name: str, url: str, submission: str = "") -> dict:
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    query = f"&submission={urllib.parse.quote(submission, safe='')}" if submission else ""
    address = f"{url.rstrip('/')}/api/jobs/{urllib.parse.quote(name, safe='')}?points=1{query}"
    try:
        with urllib.request.urlopen(address, timeout=10) as r:
            return json.load(r)["job"]
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return {}
        raise SubmitError(f"the dashboard at {url} answered {e.code} for {address}: {e.read()[:200]!r}") from None
    except (urllib.error.URLError, OSError) as e:
        raise SubmitError(
            f"no remesh dashboard answered at {url} ({e}); start one beside the fleet store with "
            "`remesh dashboard --store PATH`, or pass --store PATH"
        ) from None


def logs(address: str, submission_id: str, *, follow: bool = False, out=sys.stdout) -> None:
    c = client(address)
    if not follow:
        out.write(_job(c, submission_id, "get_job_logs"))
        return
    import asyncio

    async def tail():
        async for chunk in c.tail_job_logs(submission_id):
            out.write(chunk)
            out.flush()

    asyncio.run(tail())


def stop(address: str, submission_id: str) -> bool:
    return _job(client(address), submission_id, "stop_job")
