"""Segment specs for running the per-host worker as a plain function in a test, and a reporter
that keeps its reports as the dicts they are on the wire."""

from orchestrator.job.jobfile import CheckpointSpec
from orchestrator.protocol import SegmentSpec


def collect(out: list):
    """A `report` for `run_segment` that appends each report's dict (its wire form) to `out`."""
    return lambda r: out.append(r.to_dict())


def spec(
    tmp_path, devices, steps, planner="shapes", program_ref="examples.gpt.model:program", global_batch=24, options=None
):
    import partitioner
    from orchestrator import JobSettings, check_program, load_program
    from partitioner.search import search

    program = load_program(program_ref, JobSettings(steps, global_batch, 0, options or {}))
    state, batch = check_program(program, global_batch)
    if planner == "megatron":  # the factor-graph search, held to tensor parallelism
        plan = search(
            program.step, state, batch, devices=devices, hardware="cpu", tactics=("megatron",), compile_check=False
        )[0]
    elif planner == "tactics":
        plan = search(program.step, state, batch, devices=devices, hardware="cpu", compile_check=False)[0]
    else:
        plan = partitioner.plan_by_shapes(program.step, state, batch, devices=devices, hardware="cpu")
    return SegmentSpec(
        program=program_ref,
        steps=steps,
        global_batch=global_batch,
        seed=0,
        checkpoint=CheckpointSpec(str(tmp_path / "ckpt"), every=5, keep=2),
        plan_json=plan.to_json(),
        coordinator="",
        num_processes=1,
        process_id=0,
        options=options or {},
    )
