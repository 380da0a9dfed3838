"""remesh.orchestrator: elastic training jobs on Ray.

    from orchestrator import Program          # the user's program contract
    from orchestrator import TokenFiles       # token files as a program's data, each host reading its rows
    summary = orchestrator.run_job(orchestrator.load_job("job.toml"), chaos="lose@40,add@80")

Importing this package starts nothing and does not import Ray; the controller pieces load on
first use, so that a bare worker process (no Ray, e.g. on a GPU machine) can import `Program`.
"""

from .control.policies import Continue, Fail, Failure, FailurePolicy, Resize, Restart, ScalingPolicy
from .job.data import DataError, TokenFiles
from .job.jobfile import JobFileError, JobSpec, load_job, parse_job
from .job.program import Evaluation, JobSettings, Program, ProgramError, check_program, load_program
from .telemetry.summary import RunSummary
from .testing.chaos import ChaosSpecError, Fault, parse_chaos

__all__ = [
    "ChaosSpecError",
    "Continue",
    "DataError",
    "Evaluation",
    "Fail",
    "Failure",
    "FailurePolicy",
    "Fault",
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
    "parse_chaos",
    "parse_job",
    "run_job",
]


def __getattr__(name):
    if name in ("JobController", "Phase"):
        from .control import controller

        return getattr(controller, name)
    if name == "run_job":
        from .cli.run import run_job

        return run_job
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
