"""Slices on the orchestrator's side: the job file's `hosts_per_slice`, the hosts a group may run
on when slices fail whole, and hosts that say their slices inconsistently."""

import dataclasses

import pytest

from orchestrator.hosts.interface import Cluster
from orchestrator.hosts.slices import SliceLayout, SliceLayoutError, host_slices
from orchestrator.job.jobfile import JobFileError, parse_job


def job(hardware="tpu-v5p", **hosts):
    raw = {
        "name": "s",
        "program": "m:p",
        "steps": 10,
        "global_batch": 24,
        "hardware": hardware,
        "hosts": {"min": 4, "max": 6, "devices_per_host": 2, **hosts},
        "checkpoint": {"dir": "ckpt", "every": 5},
    }
    return parse_job(raw)


def test_profiles_give_the_default_layout_and_the_job_file_overrides_it():
    assert job().slice_layout() == SliceLayout(None, "slice")  # a TPU job on one slice, as before
    assert job("h100").slice_layout() == SliceLayout(1, "host")  # every GPU host its own NVLink domain
    assert job(hosts_per_slice=2).slice_layout() == SliceLayout(2, "slice")
    assert job("cpu").slice_layout() == SliceLayout(None, "host")


def test_hosts_per_slice_must_divide_the_hosts_a_job_runs_on():
    with pytest.raises(JobFileError, match=r"hosts.hosts_per_slice = 4 does not divide hosts.max = 6.*multiple of 4"):
        job(hosts_per_slice=4)
    with pytest.raises(JobFileError, match=r"hosts_per_slice = 4 does not divide hosts.min = 6"):
        job(hosts_per_slice=4, min=6, max=8)
    job("h100", hosts_per_slice=3, min=1)  # GPU hosts go one by one: only the maximum is whole slices
    with pytest.raises(JobFileError, match=r"key hosts.hosts_per_slice must be positive"):
        job(hosts_per_slice=-1)
    with pytest.raises(JobFileError, match=r"key hardware: .*unknown hardware profile 'tpu-v9'"):
        job("tpu-v9")


def test_where_slices_fail_whole_only_complete_ones_are_usable_slice_major():
    said = {"a": "0", "b": "0", "c": "1", "e": "2", "f": "2"}  # slice 1 lost host d
    assert SliceLayout(2, "slice").usable(said) == ["a", "b", "e", "f"]
    assert SliceLayout(2, "host").usable(said) == ["a", "b", "c", "e", "f"]
    assert SliceLayout(2, "slice").slices(4) == 2 and SliceLayout(2, "host").slices(5) == 5
    # Profiles that lay hosts out: a GB200 NVL72 rack of 18 trays, H100 hosts each their own.
    assert SliceLayout.of("gb200-nvl72").slices(36) == 2 and SliceLayout.of("h100").slices(4) == 4
    assert SliceLayout.of("tpu-v5p").slices(4) == 1  # no size said: one slice


def node(node_id, slice_label=None, resource=None):
    resources = {"remesh_host": 1.0, **({f"remesh_slice_{resource}": 1.0} if resource else {})}
    return {
        "NodeID": node_id,
        "Alive": True,
        "Resources": resources,
        "Labels": {"remesh.io/slice": slice_label} if slice_label else {},
    }


def test_hosts_say_their_slice_by_label_or_resource_and_all_or_none_must():
    assert host_slices([node("a", "x"), node("b", resource="y")]) == {"a": "x", "b": "y"}
    assert host_slices([node("a"), node("b")]) == {}
    with pytest.raises(SliceLayoutError, match=r"1 of 2 hosts say no slice.*remesh.io/slice=NAME.*remesh_slice_NAME"):
        host_slices([node("a", "x"), node("b")])


def test_a_share_is_kept_in_another_slice_so_a_slice_lost_whole_loses_none():
    from orchestrator.hosts.keepers import peer

    nodes = ["a", "b", "c", "d", "e", "f"]
    slices = {"a": "0", "b": "0", "c": "1", "d": "1", "e": "2", "f": "2"}
    peers = [peer(i, nodes, slices) for i in range(6)]
    assert peers == [2, 2, 4, 4, 0, 0]
    assert all(slices[nodes[i]] != slices[nodes[j]] for i, j in enumerate(peers))
    assert [peer(i, nodes, None) for i in range(6)] == [1, 2, 3, 4, 5, 0]  # one slice: the next host
    assert [peer(i, ["a", "b"], {"a": "0", "b": "0"}) for i in range(2)] == [1, 0]


def test_lose_slice_is_a_fault_of_its_own():
    from orchestrator.chaos import Fault, parse_chaos

    assert parse_chaos("lose-slice@15:1,add@20") == (Fault("lose-slice", 15, (1,)), Fault("add", 20))


def test_on_a_ray_cluster_the_slices_the_hosts_say_set_the_layout_unless_the_job_file_does():
    from orchestrator.hosts.slices import SlicedCluster, cluster_layout

    said = {"n0": "a", "n1": "a", "n2": "b", "n3": "b", "n4": "c"}  # slice c lost a host
    assert cluster_layout(SliceLayout.of("tpu-v5p"), said, explicit=False) == SliceLayout(2, "slice")
    assert cluster_layout(SliceLayout.of("h100"), said, explicit=False) == SliceLayout(2, "host")
    assert cluster_layout(SliceLayout.of("tpu-v5p", 4), said, explicit=True) == SliceLayout(4, "slice")
    assert cluster_layout(SliceLayout.of("tpu-v5p"), {}, explicit=False) == SliceLayout.of("tpu-v5p")
    with pytest.raises(SliceLayoutError, match=r"hosts_per_slice = 1, but slice 'a' of the cluster has 2 hosts"):
        cluster_layout(SliceLayout.of("tpu-v5p", 1), said, explicit=True)

    class Granted(Cluster):  # a shared cluster: this job holds n0, n1 and n4 of the cluster's hosts
        def alive_hosts(self):
            return ["n0", "n1", "n4"]

        def slice_of(self):
            return {node: name for node, name in said.items() if node in self.alive_hosts()}

    sliced = SlicedCluster(Granted(), SliceLayout(2, "slice"))
    assert sliced.slice_of() == {"n0": "a", "n1": "a", "n4": "c"}
    assert sliced.alive_hosts() == ["n0", "n1"] and sliced.live_hosts() == ["n0", "n1", "n4"]


def test_a_tpu_group_tells_libtpu_its_slices_at_every_start_and_other_profiles_nothing(monkeypatch):
    from orchestrator.job.jobfile import CheckpointSpec
    from orchestrator.protocol import SegmentSpec
    from orchestrator.worker.process import multislice_env

    spec = SegmentSpec("m:p", 10, 8, 0, CheckpointSpec("/c", 5), "{}", "10.0.0.7:4100", 4, 3,
                       hardware="tpu-v5p", slices=2, slice_id=1)  # fmt: skip
    assert multislice_env(spec) == {
        "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.7",
        "MEGASCALE_PORT": "8081",
        "MEGASCALE_NUM_SLICES": "2",
        "MEGASCALE_SLICE_ID": "1",
    }
    one = dataclasses.replace(spec, slices=1, slice_id=0)  # a slice lost: no waiting for it
    assert multislice_env(one)["MEGASCALE_NUM_SLICES"] == "1"
    assert multislice_env(dataclasses.replace(spec, hardware="h100")) == {}
