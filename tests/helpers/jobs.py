"""Job files the end-to-end tests run: the example GPT on emulated hosts of 2 fake CPU devices."""


def gpt_job(
    name: str,
    steps: int,
    *,
    max_hosts: int,
    checkpoint_dir: str,
    program="examples.gpt.model:program",
    options="",
    min_hosts: int = 2,
    priority: int = 0,
    pipeline: str | int = "auto",
    keep: int = 3,
) -> str:
    """A job file's text: batch 24 (divides every mesh the hosts give), a checkpoint every 10 steps;
    `options`: the lines of an `[options]` table; `keep`: how many commits are kept."""
    pipeline = f'"{pipeline}"' if isinstance(pipeline, str) else pipeline
    return f"""
name = "{name}"
program = "{program}"
steps = {steps}
global_batch = 24
priority = {priority}
pipeline = {pipeline}
[hosts]
min = {min_hosts}
max = {max_hosts}
devices_per_host = 2
[checkpoint]
dir = "{checkpoint_dir}"
every = 10
keep = {keep}
[options]
{options}
"""
