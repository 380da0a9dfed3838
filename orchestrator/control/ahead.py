"""What the next group will need, made while this one trains, so that a resize or a recovery only
joins, loads and restores: a standby actor on every live host, and plans for the meshes a resize
would likely go to (a host fewer, a host more; a slice, where slices fail whole), whose programs
the training group compiles beside its steps."""

from __future__ import annotations

from collections.abc import Callable

from ..hosts.interface import Cluster
from ..job.jobfile import JobSpec
from .planning import PlanCache


class Ahead:
    """`standby`: a `hosts.standby.StandbyPool`, or None (each group spawns its actors);
    `host_env()`: the environment host processes need."""

    def __init__(self, job: JobSpec, cluster: Cluster, plans: PlanCache, standby, host_env: Callable[[], dict]):
        self.job, self.cluster, self.plans, self.standby, self.host_env = job, cluster, plans, standby, host_env

    def refill(self, alive: list[str] | None = None) -> None:
        """A standby actor on each of the live hosts (`alive`, else the cluster's) that has none."""
        if self.standby is not None:
            self.standby.refill(self.cluster.alive_hosts() if alive is None else alive, self.host_env())

    def prepare(self, hosts: int) -> None:
        """Standby actors, and plans for a group a loss unit smaller and larger than `hosts`."""
        self.refill()
        unit = self.cluster.loss_unit(hosts)
        for n in (hosts - unit, hosts + unit):
            if self.job.hosts.min <= n <= self.job.hosts.max:
                self.plans.plan_ahead(n * self.job.hosts.devices_per_host)

    def made(self, devices: int) -> tuple[list[str], list[str]]:
        """The plans made ahead since last asked for fewer than `devices` devices, as JSON for the
        training group to compile; and a warning for each planning ahead that failed."""
        plans, failed = [], []
        for count, plan in self.plans.made_ahead():
            if isinstance(plan, Exception):
                failed.append(f"planning ahead for {count} devices failed: {plan}")
            elif plan.devices_used < devices:
                plans.append(plan.to_json())
        return plans, failed
