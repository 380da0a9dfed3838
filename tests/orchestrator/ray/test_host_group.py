"""A host group on a real Ray cluster whose host dies between the plan and the group's start: Ray
says the actor pinned there cannot be scheduled (not that it died), and the group must report
that as hosts unavailable, so that the controller re-plans, instead of ending the run."""

import time

import pytest
import ray

from orchestrator.hosts.cluster import LocalClusterConfig
from orchestrator.hosts.group import HostGroup, HostGroupConfig, HostsUnavailableError
from orchestrator.hosts.standby import StandbyPool

DEADLINE_S = 30.0  # bounded: Ray notices a killed node within about a second here


@pytest.fixture(scope="module")
def cluster():
    c = LocalClusterConfig(hosts=2, devices_per_host=1).create()
    yield c
    c.shutdown()


def test_a_group_pinned_to_a_host_that_died_reports_it_unavailable_and_keeps_no_actor(cluster):
    live, dead = cluster.alive_hosts()
    cluster.kill_host(dead)
    end = time.monotonic() + DEADLINE_S
    while dead in cluster.alive_hosts() and time.monotonic() < end:
        time.sleep(0.05)
    assert dead not in cluster.alive_hosts(), f"Ray did not notice the killed host within {DEADLINE_S:.0f} s"
    standby = StandbyPool()
    standby.refill([live], {})
    held = dict(standby._idle)
    with pytest.raises(HostsUnavailableError, match="ActorUnschedulableError"):
        HostGroup(2, HostGroupConfig(), standby, nodes=[live, dead])
    # The live host's standby actor, taken for the group, went down with it: no actor is left
    # holding the host that the next plan will ask for.
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(held[live].where.remote(), timeout=DEADLINE_S)
    # And the live host still takes a group.
    group = HostGroup(1, HostGroupConfig(), standby, nodes=[live])
    assert group.node_ids == [live]
    group.shutdown()
