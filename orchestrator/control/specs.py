"""What each process of a new group is told (`SegmentSpec`): the job, the plan, where the group
meets, which process and which slice it is. Pure: the controller hands in what it knows."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ..job.jobfile import JobSpec
from ..protocol import HookRef, SegmentSpec


def slice_ids(slice_of: Mapping[str, str], node_ids: Sequence[str]) -> list[int]:
    """Each process's slice among the group's, numbered in process order (slice-major)."""
    names = list(dict.fromkeys(slice_of.get(node, "") for node in node_ids))
    return [names.index(slice_of.get(node, "")) for node in node_ids]


@dataclasses.dataclass(frozen=True)
class GroupSpecs:
    """The specs of one group's processes: `for_process(i, coordinator)` is process i's."""

    job: JobSpec
    plan_json: str
    segment: int  # the segment's index (the worker counts its saves' metadata by it)
    slices: list[int]  # each process's slice (`slice_ids`), one per process of the group
    fingerprint: str
    compilation_cache: str | None
    model_flops: float | None
    hooks: Mapping[int, HookRef]  # fault injection: process -> its hook
    restore_at_most: int | None = None  # the newest step to restore (after a corruption)

    def for_process(self, process_id: int, coordinator: str) -> SegmentSpec:
        job = self.job
        return SegmentSpec(
            program=job.program,
            steps=job.steps,
            global_batch=job.global_batch,
            seed=job.seed,
            checkpoint=job.checkpoint,
            plan_json=self.plan_json,
            coordinator=coordinator,
            num_processes=len(self.slices),
            process_id=process_id,
            segment=self.segment,
            compilation_cache=self.compilation_cache,
            fingerprint=self.fingerprint,
            hardware=job.hardware,
            job=job.name,
            model_flops=self.model_flops,
            options=dict(job.options),
            test_hook=self.hooks.get(process_id),
            slices=len(set(self.slices)),
            slice_id=self.slices[process_id],
            digest_every=job.health.digest_every,
            restore_at_most=self.restore_at_most,
        )
