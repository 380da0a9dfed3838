"""The job file (TOML), parsed and validated once into small frozen dataclasses.

    name = "gpt-demo"
    program = "examples.gpt.model:program"
    steps = 120
    global_batch = 24
    seed = 0                       # optional
    hardware = "cpu"               # optional: the profile plans are priced with (h100, tpu-v5p, ...)
    planner = "fast"               # optional: the search's level, "fast" or "thorough"; or "shapes" (dp/fsdp from shapes)
    pipeline = "auto"              # optional: pipeline the layer scan where predicted faster, "off", or N stages
    priority = 0                   # optional: on a shared cluster, higher runs first and may shrink lower ones
    queue = "default"              # optional: the fleet queue whose quota of hosts the job counts against
    [hosts]
    min = 2
    max = 4
    devices_per_host = 2
    hosts_per_slice = 2            # optional: hosts per slice (TPU slice, NVLink domain); default: the profile's
    [checkpoint]
    dir = "checkpoints"            # relative to the job file
    every = 10
    keep = 3                       # optional: the newest committed checkpoints kept
    keep_every = 1000              # optional: also keep every step divisible by this, forever
    snapshot_time_share = 0.05     # optional: share of step time for peer snapshots in host memory; 0: none
    snapshot_every = 0             # optional: a peer snapshot every so many steps, whatever it costs; 0: by budget
    [health]                       # optional: the health loop (orchestrator/control/health.py)
    stragglers = "act"             # "act": go on without a slow host where predicted faster; "warn"; "off"
    digest_every = 0               # steps between comparisons of the state's copies; 0: as often as costs 1%; -1: never
    [options]                      # optional, free: handed to a program factory (`JobSettings.options`)
    train_tokens = ["data/train.bin"]

Unknown keys and wrong types are errors that name the key.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from typing import Any


class JobFileError(ValueError):
    """The job file is missing a key, has an unknown key, or a value of the wrong type."""


@dataclasses.dataclass(frozen=True)
class HostsSpec:
    min: int
    max: int
    devices_per_host: int
    # Hosts per slice (a TPU slice, a GPU NVLink domain) on the embedded cluster; 0: the hardware
    # profile's (every GPU host its own slice, one slice of every host on TPU profiles).
    hosts_per_slice: int = 0


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    dir: str
    every: int
    keep: int = 3
    keep_every: int = 0  # 0: none kept beyond the newest `keep`
    # Peer snapshots in host memory (orchestrator/worker/snapshots.py): the share of step time copying the
    # state to the host may take; the interval in steps follows from it. 0 turns them off.
    snapshot_time_share: float = 0.05
    # A fixed interval of peer snapshots in steps, whatever they cost (a job that wants every step
    # covered, or a test that must not depend on the machine's load); 0: as `snapshot_time_share` allows.
    snapshot_every: int = 0


@dataclasses.dataclass(frozen=True)
class HealthSpec:
    """The `[health]` table: what the health loop does of a slow host (`stragglers`), and how
    often the state's copies are compared (`digest_every` steps; 0: as often as costs 1% of a
    step; -1: never, and checkpoints are saved uncompared)."""

    stragglers: str = "act"
    digest_every: int = 0


@dataclasses.dataclass(frozen=True)
class JobSpec:
    name: str
    program: str
    steps: int
    global_batch: int
    hosts: HostsSpec
    checkpoint: CheckpointSpec
    seed: int = 0
    hardware: str = "cpu"
    planner: str = "fast"
    priority: int = 0  # among jobs sharing a cluster (fleet.policy): higher first
    queue: str = "default"  # the fleet queue whose host quota the job counts against
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # "auto": the planner pipelines the step's layer scan where predicted faster; "off"; or a
    # number of stages (re-planned at each resize to the nearest count that fits).
    pipeline: str | int = "auto"
    health: HealthSpec = HealthSpec()

    def settings(self):
        """What a program factory is given (`program.JobSettings`)."""
        from .program import JobSettings

        return JobSettings(self.steps, self.global_batch, self.seed, self.options)

    @property
    def search_level(self) -> str | None:
        """The partitioner's search level ("fast", "thorough"), or None where the job plans by
        shapes alone (`planner = "shapes"`)."""
        return None if self.planner == "shapes" else self.planner

    def slice_layout(self):
        """The job's slice layout (`hosts.slices.SliceLayout`): hosts per slice, and what fails together."""
        from .slices import SliceLayout

        return SliceLayout.of(self.hardware, self.hosts.hosts_per_slice)

    def with_checkpoint_dir(self, path: str) -> JobSpec:
        return dataclasses.replace(self, checkpoint=dataclasses.replace(self.checkpoint, dir=os.path.abspath(path)))


PLANNERS = ("fast", "thorough", "shapes")
STRAGGLER_MODES = ("act", "warn", "off")
_HEALTH: dict[str, Any] = {"stragglers": (str, "act"), "digest_every": (int, 0)}

_SCHEMA: dict[str, Any] = {
    "name": str,
    "program": str,
    "steps": int,
    "global_batch": int,
    "seed": (int, 0),
    "hardware": (str, "cpu"),
    "planner": (str, "fast"),
    "priority": (int, 0),
    "queue": (str, "default"),
    "hosts": {"min": int, "max": int, "devices_per_host": int, "hosts_per_slice": (int, 0)},
    "checkpoint": {
        "dir": str,
        "every": int,
        "keep": (int, 3),
        "keep_every": (int, 0),
        "snapshot_time_share": (float, 0.05),
        "snapshot_every": (int, 0),
    },
}


def load_job(path: str | os.PathLike) -> JobSpec:
    path = os.fspath(path)
    raw = read_toml(path, "job file", JobFileError)
    return parse_job(raw, base_dir=os.path.dirname(os.path.abspath(path)), source=path)


def read_toml(path: str, what: str, error: type[ValueError]) -> dict:
    """The TOML file at `path`, or `error` saying it is missing or not TOML (`what`: "job file")."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise error(f"{what} {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{what} {path!r} is not valid TOML: {e}") from None


# Keys renamed, read under their old names too: old -> new, per table.
RENAMED = {"checkpoint": {"memory_budget": "snapshot_time_share"}}


def _renamed(raw: dict, source: str) -> dict:
    """`raw` with keys renamed since (`RENAMED`) under their new names; both given is an error."""
    for table, names in RENAMED.items():
        section = raw.get(table)
        if not isinstance(section, Mapping):
            continue
        section = dict(section)
        for old, new in names.items():
            if old in section and new in section:
                raise JobFileError(f"{source}: [{table}] sets both {old} and {new}: keep {new} ({old} is its old name)")
            if old in section:
                section[new] = section.pop(old)
        raw[table] = section
    return raw


def parse_job(raw: Mapping[str, Any], *, base_dir: str = ".", source: str = "<job>") -> JobSpec:
    raw = _renamed(dict(raw), source)
    options = _options(raw.pop("options", {}), source)
    pipeline = _pipeline(raw.pop("pipeline", "auto"), source)
    health = _health(raw.pop("health", {}), source)
    values = _check(raw, _SCHEMA, prefix="", source=source)
    hosts = HostsSpec(**values["hosts"])
    ckpt = values["checkpoint"]
    ckpt["dir"] = os.path.normpath(os.path.join(base_dir, ckpt["dir"]))
    job = JobSpec(
        name=values["name"],
        program=values["program"],
        steps=values["steps"],
        global_batch=values["global_batch"],
        seed=values["seed"],
        hardware=values["hardware"],
        planner=values["planner"],
        priority=values["priority"],
        queue=values["queue"],
        hosts=hosts,
        checkpoint=CheckpointSpec(**ckpt),
        options=options,
        pipeline=pipeline,
        health=health,
    )
    _check_values(job, source)
    return job


def _health(raw: Any, source: str) -> HealthSpec:
    """The optional `[health]` table."""
    if not isinstance(raw, dict):
        raise JobFileError(f"{source}: health must be a table ([health]), got {type(raw).__name__} {raw!r}")
    spec = HealthSpec(**_check(raw, _HEALTH, prefix="health.", source=source))
    if spec.stragglers not in STRAGGLER_MODES:
        raise JobFileError(
            f"{source}: key health.stragglers must be one of {', '.join(STRAGGLER_MODES)}, got {spec.stragglers!r}; "
            '"act" goes on without a slow host where that is predicted faster, "warn" only says so'
        )
    if spec.digest_every < -1:
        raise JobFileError(
            f"{source}: key health.digest_every must be a number of steps, 0 (as often as costs 1% of a step) or "
            f"-1 (never), got {spec.digest_every}"
        )
    return spec


def _pipeline(value: Any, source: str) -> str | int:
    """The `pipeline` key: "auto", "off" or a number of stages of at least 2."""
    if value in ("auto", "off") or (isinstance(value, int) and not isinstance(value, bool) and value >= 2):
        return value
    raise JobFileError(
        f'{source}: key pipeline must be "auto", "off" or a number of stages of at least 2, got {value!r}; '
        'write pipeline = "auto" to let the planner choose'
    )


def _options(raw: Any, source: str) -> dict:
    """The free `[options]` table: anything JSON can carry to every host (TOML dates cannot)."""
    import json

    if not isinstance(raw, dict):
        raise JobFileError(f"{source}: options must be a table ([options]), got {type(raw).__name__} {raw!r}")
    try:
        return json.loads(json.dumps(raw))
    except TypeError as e:
        raise JobFileError(
            f"{source}: [options] holds a value hosts cannot be sent ({e}): use strings or numbers"
        ) from None


def _check(raw: Mapping[str, Any], schema: Mapping[str, Any], *, prefix: str, source: str) -> dict:
    unknown = sorted(set(raw) - set(schema))
    if unknown:
        raise JobFileError(
            f"{source}: unknown key {prefix}{unknown[0]!s}; allowed keys here: {', '.join(prefix + k for k in schema)}"
        )
    out = {}
    for key, kind in schema.items():
        name = prefix + key
        if isinstance(kind, dict):
            if key not in raw or not isinstance(raw[key], dict):
                raise JobFileError(f"{source}: missing table [{name}] with keys {', '.join(kind)}")
            out[key] = _check(raw[key], kind, prefix=name + ".", source=source)
            continue
        kind, default = kind if isinstance(kind, tuple) else (kind, _REQUIRED)
        if key not in raw:
            if default is _REQUIRED:
                raise JobFileError(f"{source}: missing key {name} (expected {kind.__name__})")
            out[key] = default
            continue
        value = raw[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)  # `snapshot_time_share = 0` is a float to anyone who writes it
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise JobFileError(f"{source}: key {name} must be {kind.__name__}, got {type(value).__name__} {value!r}")
        out[key] = value
    return out


_REQUIRED = object()


def _check_values(job: JobSpec, source: str) -> None:
    def need(ok: bool, msg: str):
        if not ok:
            raise JobFileError(f"{source}: {msg}")

    need(
        ":" in job.program and all(job.program.split(":", 1)),
        f"key program must look like 'module:attribute', got {job.program!r}",
    )
    need(job.steps > 0, f"key steps must be positive, got {job.steps}")
    need(job.planner in PLANNERS, f"key planner must be one of {PLANNERS}, got {job.planner!r}")
    need(job.global_batch > 0, f"key global_batch must be positive, got {job.global_batch}")
    need(bool(job.queue.strip()), f"key queue must name a fleet queue, got {job.queue!r}")
    need(
        1 <= job.hosts.min <= job.hosts.max,
        f"keys hosts.min and hosts.max need 1 <= min <= max, got min={job.hosts.min} max={job.hosts.max}",
    )
    need(
        job.hosts.devices_per_host > 0, f"key hosts.devices_per_host must be positive, got {job.hosts.devices_per_host}"
    )
    need(
        job.hosts.hosts_per_slice >= 0,
        f"key hosts.hosts_per_slice must be positive (or left out: the profile's), got {job.hosts.hosts_per_slice}",
    )
    _check_slices(job, need)
    need(job.checkpoint.every > 0, f"key checkpoint.every must be positive, got {job.checkpoint.every}")
    need(job.checkpoint.keep > 0, f"key checkpoint.keep must be positive, got {job.checkpoint.keep}")
    need(
        job.checkpoint.keep_every >= 0,
        f"key checkpoint.keep_every must be 0 (none) or positive, got {job.checkpoint.keep_every}",
    )
    need(
        0.0 <= job.checkpoint.snapshot_time_share < 1.0,
        "key checkpoint.snapshot_time_share must be a share of step time in [0, 1) (0: no snapshots in host memory), "
        f"got {job.checkpoint.snapshot_time_share}",
    )
    need(
        job.checkpoint.snapshot_every >= 0,
        f"key checkpoint.snapshot_every must be 0 (as snapshot_time_share allows) or positive, got {job.checkpoint.snapshot_every}",
    )
    need(
        job.checkpoint.snapshot_every == 0 or job.checkpoint.snapshot_time_share > 0,
        "key checkpoint.snapshot_every needs peer snapshots on: snapshot_time_share = 0 turns them off",
    )


def _check_slices(job: JobSpec, need) -> None:
    """Whole slices: hosts.max (and hosts.min, where a lost host takes its slice) a multiple of
    the hosts per slice."""
    from partitioner import UnknownHardwareError

    try:
        layout = job.slice_layout()
    except UnknownHardwareError as e:
        need(False, f"key hardware: {e.args[0]}")
        return
    per = layout.hosts_per_slice
    if per is None or per == 1:
        return
    for key in ("max", "min") if layout.fails_by == "slice" else ("max",):
        n = getattr(job.hosts, key)
        need(
            n % per == 0,
            f"key hosts.hosts_per_slice = {per} does not divide hosts.{key} = {n}: a job runs on whole slices "
            f"(on {job.hardware} a lost host takes its slice); set hosts.{key} to a multiple of {per}, or "
            "hosts_per_slice to a divisor of it",
        )
