"""The fleet scheduler on a real Ray cluster of 3 slices of 2 emulated hosts: a job that runs
whole slices (a TPU job) is granted, shrunk and grown a whole slice at a time, pinned to hosts
the scheduler chooses; a job whose hosts go one by one is packed into slices already broken
into; a host lost drops its reservation, and its slice is not granted whole until it is back."""

import collections

import pytest
import ray

from orchestrator.fleet.scheduler import FleetSchedulerConfig, Grant, start
from orchestrator.hosts.cluster import LocalClusterConfig
from tests.helpers.fleet import until


@pytest.fixture(scope="module")
def cluster():
    c = LocalClusterConfig(hosts=6, devices_per_host=1, hosts_per_slice=2).create()
    yield c
    c.shutdown()


@pytest.fixture
def fleet(cluster):
    actor = start(FleetSchedulerConfig())
    yield actor
    ray.kill(actor)


def registration(run, priority=0, min_hosts=2, max_hosts=6, slice_hosts=2):
    return dict(run=run, job=run.split("-")[0], priority=priority, queue="default", min_hosts=min_hosts,
                max_hosts=max_hosts, checkpoint_dir=f"/ckpt/{run}", slice_hosts=slice_hosts)  # fmt: skip


def slices_of(cluster, grant):
    """The job's hosts per slice: {slice: count}."""
    said = cluster.slice_of()
    return dict(collections.Counter(said[node] for node, _ in grant.hosts))


def test_a_job_that_runs_whole_slices_gets_and_gives_them_whole(cluster, fleet):
    tpu = Grant.from_dict(ray.get(fleet.register.remote(registration("tpu-1", max_hosts=6))))
    assert tpu.target == 6
    tpu = until(fleet, "tpu-1", 6, "every slice")
    # A job of higher priority needing one host: the TPU job gives up a whole slice.
    gpu = Grant.from_dict(ray.get(fleet.register.remote(registration("gpu-1", 5, 1, 1, slice_hosts=0))))
    tpu = Grant.from_dict(ray.get(fleet.report.remote("tpu-1")))
    assert tpu.target == 4 and tpu.reason == "shrunk to 4 of 6 hosts for a job of higher priority"
    said = cluster.slice_of()
    given = sorted(n for n, _ in tpu.hosts if said[n] == "2")  # the job chooses: the last slice
    ray.get(fleet.release.remote("tpu-1", given))
    gpu = until(fleet, "gpu-1", 1, "the high job gets a host of the slice given back")
    assert said[gpu.hosts[0][0]] == "2"
    tpu = until(fleet, "tpu-1", 4, "the TPU job keeps two whole slices")
    assert slices_of(cluster, tpu) == {"0": 2, "1": 2}
    # The other host of the broken slice is idle, but no use to a job that needs whole slices.
    queue = {q["run"]: q for q in ray.get(fleet.queue.remote())}
    assert queue["tpu-1"]["target"] == 4
    # A second one-by-one job is packed into the slice already broken into.
    other = Grant.from_dict(ray.get(fleet.register.remote(registration("gpu-2", 5, 1, 1, slice_hosts=0))))
    other = until(fleet, "gpu-2", 1, "packed beside the first")
    assert said[other.hosts[0][0]] == "2"
    ray.get(fleet.finish.remote("gpu-1"))
    ray.get(fleet.finish.remote("gpu-2"))
    tpu = until(fleet, "tpu-1", 6, "the TPU job grows back by the freed slice")
    assert slices_of(cluster, tpu) == {"0": 2, "1": 2, "2": 2}
    ray.get(fleet.finish.remote("tpu-1"))


def test_a_host_lost_drops_its_reservation_and_its_slice_until_it_is_back(cluster, fleet):
    tpu = Grant.from_dict(ray.get(fleet.register.remote(registration("tpu-2", max_hosts=4))))
    tpu = until(fleet, "tpu-2", 4, "two whole slices")
    said = cluster.slice_of()
    mine = slices_of(cluster, tpu)
    lost = tpu.hosts[0][0]
    cluster.kill_host(lost)
    # Two whole slices are still whole: the one the job had left, and the one it did not have.
    tpu = until(fleet, "tpu-2", 3, "the dead host's reservation dropped, its slice-mate kept until given back")
    assert {said[n] for n, _ in tpu.hosts} == set(mine)
    mate = next(n for n, _ in tpu.hosts if said[n] == said[lost])
    ray.get(fleet.release.remote("tpu-2", [mate]))  # the job gives back its broken slice's survivor
    tpu = until(fleet, "tpu-2", 4, "a whole free slice in place of the broken one")
    assert said[lost] not in slices_of(cluster, tpu) and len(slices_of(cluster, tpu)) == 2
    cluster.add_host()  # into the slice the loss left short
    assert collections.Counter(cluster.slice_of().values()) == {"0": 2, "1": 2, "2": 2}
    ray.get(fleet.finish.remote("tpu-2"))


def test_a_job_that_runs_whole_slices_on_a_cluster_whose_slices_do_not_fit_it_is_refused(fleet):
    with pytest.raises(
        ValueError, match=r"slices of 1 hosts, but slice '\d' of this cluster has 2: set \[hosts\] hosts_per_slice = 2"
    ):
        ray.get(fleet.register.remote(registration("tpu-3", slice_hosts=1, min_hosts=1)))
