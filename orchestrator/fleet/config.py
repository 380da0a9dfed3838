"""The fleet configuration file (TOML): the queues jobs name, and each queue's quota of hosts.

    [queues.default]     # jobs that name no queue; present even when the file omits it
    [queues.research]
    hosts = 2            # the most hosts this queue's jobs hold at once (no key: no limit)
    [queues.prod]
    hosts = 4

Unknown keys, wrong types and quotas below one host are errors that name the key; a job naming a
queue the file does not have is refused when it registers (`check_queue`).
"""

from __future__ import annotations

import os

from ..job.jobfile import read_toml
from .policy import FleetPolicyConfig, Quota


class FleetConfigError(ValueError):
    """The fleet file is unreadable or holds a wrong key or value, or a job names an unknown queue."""


def load_fleet(path: str | os.PathLike | None) -> FleetPolicyConfig:
    """The fleet's queues from the file at `path`; None: one queue, "default", with no quota."""
    if path is None:
        return FleetPolicyConfig()
    path = os.fspath(path)
    return parse_fleet(read_toml(path, "fleet file", FleetConfigError), source=path)


def parse_fleet(raw: dict, *, source: str = "<fleet>") -> FleetPolicyConfig:
    unknown = sorted(set(raw) - {"queues"})
    if unknown:
        raise FleetConfigError(f"{source}: unknown key {unknown[0]}; allowed: queues (tables [queues.NAME])")
    queues = raw.get("queues", {})
    if not isinstance(queues, dict):
        raise FleetConfigError(f"{source}: queues must be tables [queues.NAME], got {type(queues).__name__}")
    quotas = {"default": Quota()}
    for name, table in queues.items():
        quotas[name] = _quota(name, table, source)
    return FleetPolicyConfig(quotas)


def _quota(name: str, table, source: str) -> Quota:
    if not isinstance(table, dict):
        raise FleetConfigError(f"{source}: queues.{name} must be a table [queues.{name}], got {table!r}")
    unknown = sorted(set(table) - {"hosts"})
    if unknown:
        raise FleetConfigError(f"{source}: unknown key queues.{name}.{unknown[0]}; allowed: queues.{name}.hosts")
    hosts = table.get("hosts")
    if hosts is not None and (not isinstance(hosts, int) or isinstance(hosts, bool) or hosts < 1):
        raise FleetConfigError(
            f"{source}: queues.{name}.hosts must be a whole number of hosts of at least 1 (or left out: no limit), "
            f"got {hosts!r}"
        )
    return Quota(hosts)


def check_queue(config: FleetPolicyConfig, queue: str, min_hosts: int, job: str) -> None:
    """Refuse a job the fleet can never run: an unknown queue, or a minimum beyond its quota."""
    if queue not in config.quotas:
        raise FleetConfigError(
            f"job {job!r} names queue {queue!r}, which the fleet does not have; its queues: "
            f"{', '.join(sorted(config.quotas))} (set `queue = ...` in the job file, or add [queues.{queue}] to the fleet file)"
        )
    limit = config.quotas[queue].hosts
    if limit is not None and min_hosts > limit:
        raise FleetConfigError(
            f"job {job!r} needs at least {min_hosts} hosts (hosts.min) but queue {queue!r} may hold at most {limit}: "
            "lower hosts.min, or raise the queue's quota in the fleet file"
        )
