"""remesh.orchestrator: elastic training jobs on Ray.

    from orchestrator import Program          # the user's program contract
    from orchestrator import TokenFiles       # token files as a program's data, each host reading its rows
    summary = orchestrator.run_job(orchestrator.load_job("job.toml"), chaos="lose@40,add@80")

Importing this package starts nothing and does not import Ray; the controller pieces load on
first use, so that a bare worker process (no Ray, e.g. on a GPU machine) can import `Program`.
"""

from .chaos import ChaosSpecError, Fault, parse_chaos
from .data import DataError, TokenFiles
from .jobfile import JobFileError, JobSpec, load_job, parse_job
from .policies import Continue, Fail, Failure, FailurePolicy, Resize, Restart, ScalingPolicy
from .program import Evaluation, JobSettings, Program, ProgramError, check_program, load_program
from .summary import RunSummary

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
        from . import controller

        return getattr(controller, name)
    if name == "run_job":
        from .run import run_job

        return run_job
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
