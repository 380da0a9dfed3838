"""What remesh keeps beside a state: with a checkpoint, and with a peer snapshot."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .reports import Step


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """What remesh writes beside a state: with a checkpoint (JSON in its metadata) and with a peer
    snapshot. `from_dict` reads both, and checkpoints that remesh did not write (plain Orbax, an
    older remesh), with the defaults said once here."""

    data_position: int  # the step whose data comes next
    examples_seen: int  # where the next step's examples begin in the data's global order
    segment: int | None = None  # the segment that ran the steps in `step_records` (counted from 0)
    # The records of the steps past the newest commit before this one (`STEP_RECORD` fields); kept
    # on disk under "reports", the key older checkpoints have.
    step_records: tuple = ()
    digest: str | None = None  # of the state (job/digest.py); None: none was taken
    step: int | None = None  # a snapshot's step (a checkpoint's is its directory's)
    # Who wrote a checkpoint (None in a snapshot): the program, and the job settings it ran with.
    program: str | None = None
    seed: int | None = None
    program_fingerprint: str | None = None
    global_batch: int | None = None
    steps: int | None = None
    options: dict | None = None

    def to_dict(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None and k != "step_records"}
        out["reports"] = list(self.step_records)
        return out

    @classmethod
    def from_dict(cls, meta: Mapping[str, Any], *, step: int, global_batch: int) -> CheckpointMeta:
        """`meta` as saved with `step`; where it lacks remesh's fields, the data resumes at the
        step's own position, `global_batch` examples a step."""
        position = int(meta.get("data_position", step))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(
            **{
                k: v
                for k, v in meta.items()
                if k in known and k not in ("data_position", "examples_seen", "step_records")
            },
            data_position=position,
            examples_seen=int(meta.get("examples_seen", position * global_batch)),
            step_records=tuple(meta.get("reports", ())),
        )

    def reported(self) -> dict:
        """What a restore report carries of it: the step reports kept, and the segment that ran them."""
        return {"segment": self.segment, "steps": list(self.step_records)}


# What a step report keeps in checkpoint metadata and in the fleet store's step rows.
STEP_RECORD = ("step", "at", "loss", "seconds", "tokens_per_second", "mfu", "input_seconds", "wait_seconds", "metrics")


def step_record(step: Step) -> dict:
    return {k: getattr(step, k) for k in STEP_RECORD}
