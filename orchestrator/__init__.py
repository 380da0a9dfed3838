"""remesh.orchestrator: elastic training jobs on Ray.

    from orchestrator import Program          # the user's program contract
    from orchestrator import TokenFiles       # token files as a program's data, each host reading its rows
    summary = orchestrator.run_job(orchestrator.load_job("job.toml"))

Its parts, and what each may import (tests/project/unit/test_imports.py keeps to `ALLOWED`):

    job/        the job file, the program contract, its data, the state digest
    protocol/   what crosses a process: controller <-> hosts (SegmentSpec, Stop, reports,
                CheckpointMeta), controller -> observers (Event, ControllerCallback), and
                job <-> fleet scheduler (Registration, Grant, FleetProgress)
    metrics     remesh's Prometheus metrics
    worker/     one process of one jax.distributed group: a segment's loop and its hooks
    hosts/      host actors and their groups, standby actors, the clusters (`Cluster`), slices,
                peer-snapshot keepers
    control/    the job controller (states, transitions), its policies (scaling, failure,
                following a fleet's grant), its plan cache; callbacks read it through a view
    fleet/      the shared cluster's scheduler, its policy and the job's link to it; beside
                control/, neither importing the other
    telemetry/  goodput ledger, run summary, fleet recorder, terminal: controller callbacks
    dashboard/  the run store (SQLite) and the web dashboard over it
    chaos       fault injection (`--chaos`, the demo, the fault storm): a controller callback
                and a worker hook, imported only where faults are given
    launch      `run_job`, which wires a job to all of the above
    cli/        `remesh`

Importing this package starts nothing and does not import Ray; the controller pieces load on
first use, so that a bare worker process (no Ray, e.g. on a GPU machine) can import `Program`.
"""

from .control.policies import Continue, Fail, Failure, FailurePolicy, Resize, Restart, ScalingPolicy
from .job.data import DataError, TokenFiles
from .job.jobfile import JobFileError, JobSpec, load_job, parse_job
from .job.program import Evaluation, JobSettings, Program, ProgramError, check_program, load_program
from .protocol import ControllerCallback
from .telemetry.summary import RunSummary

__all__ = [
    "Continue",
    "ControllerCallback",
    "DataError",
    "Evaluation",
    "Fail",
    "Failure",
    "FailurePolicy",
    "JobController",
    "JobFileError",
    "JobSettings",
    "JobSpec",
    "Phase",
    "Program",
    "ProgramError",
    "Resize",
    "Restart",
    "RunSummary",
    "ScalingPolicy",
    "TokenFiles",
    "check_program",
    "load_job",
    "load_program",
    "parse_job",
    "run_job",
]


def __getattr__(name):
    if name == "JobController":
        from .control.controller import JobController

        return JobController
    if name == "Phase":
        from .control.state import Phase

        return Phase
    if name == "run_job":
        from .launch import run_job

        return run_job
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
