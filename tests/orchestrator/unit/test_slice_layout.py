"""Slices on the orchestrator's side: the job file's `hosts_per_slice`, the hosts a group may run
on when slices fail whole, and hosts that say their slices inconsistently."""

import pytest

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
    assert job().slices() == SliceLayout(None, "slice")  # a TPU job on one slice, as before
    assert job("h100").slices() == SliceLayout(1, "host")  # every GPU host its own NVLink domain
    assert job(hosts_per_slice=2).slices() == SliceLayout(2, "slice")
    assert job("cpu").slices() == SliceLayout(None, "host")


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
    from orchestrator.testing.chaos import Fault, parse_chaos

    assert parse_chaos("lose-slice@15:1,add@20") == (Fault("lose-slice", 15, (1,)), Fault("add", 20))
