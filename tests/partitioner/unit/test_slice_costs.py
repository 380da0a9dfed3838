"""Slices in the cost model: three levels of links, what fails together, and collectives whose
groups span slices priced level by level."""

import pytest

from partitioner import PROFILES, profile
from partitioner.cost import Split
from partitioner.explain import crossing


def test_profiles_have_three_levels_of_links_and_a_unit_of_failure():
    for name in ("tpu-v5e", "tpu-v5p", "tpu-v6e", "h100", "h200", "b200", "gb200-nvl72"):
        hw = PROFILES[name]
        slow = hw.dcn.bandwidth
        assert hw.intra.bandwidth >= hw.inter.bandwidth >= slow, name
        assert hw.fails_by == ("slice" if name.startswith("tpu") else "host"), name
    for name, ratio in (("h100", 9), ("b200", 18), ("gb200-nvl72", 18)):  # NVLink against 400 Gb/s InfiniBand
        hw = PROFILES[name]
        assert hw.intra.bandwidth / hw.dcn.bandwidth == ratio
    assert PROFILES["tpu-v5p"].dcn.bandwidth == 50e9 / 8  # 50 Gb/s per chip (data sheet)
    assert PROFILES["gb200-nvl72"].hosts_per_slice == 18  # 18 trays of 4 GPUs per rack
    assert PROFILES["h100"].hosts_per_slice == 1 and PROFILES["tpu-v5p"].hosts_per_slice is None


def test_a_group_pays_the_slowest_level_it_crosses():
    hw = profile("tpu-v5p").sliced(devices=16, slices=2)  # 8 devices a slice, 4 a host
    assert [hw.level(span) for span in (4, 8, 16)] == ["host", "slice", "dcn"]
    assert hw.link(16) == hw.dcn and hw.link(8) == hw.inter
    assert profile("tpu-v5p").sliced(16, 1).link(16) == hw.inter  # one slice: nothing slower than ICI


def test_a_group_across_slices_is_priced_level_by_level():
    hw = profile("h100").sliced(devices=16, slices=2)
    mesh = {"replica": 2, "data": 8}
    assert crossing(mesh, hw) == ("replica",)
    both = Split.of(("replica", "data"), mesh, hw)
    assert (both.inside, both.across, both.inner_level) == (8, 2, "host")
    # One axis over both slices splits the same way: data=16 on two slices of 8 is 8 x 2.
    assert Split.of(("data",), {"data": 16}, hw) == both
    n = 1e9
    sent = both.bytes("all-reduce", n)
    assert sent == pytest.approx({"host": 2 * 7 / 8 * n, "dcn": 2 * 1 / 2 * n / 8})
    seconds = sum(both.seconds("all-reduce", n, hw))
    flat = 2 * 15 / 16 * n / hw.dcn.bandwidth  # the whole buffer over the slow link
    assert seconds < flat / 4
    gather = both.bytes("all-gather", n)  # shards of n bytes
    assert gather == pytest.approx({"dcn": 1 * n, "host": 7 * 2 * n})


def test_a_compiled_group_is_priced_by_its_own_extent_whatever_form_xla_writes_it_in():
    from partitioner.verify import Collective, _first_group, _seconds

    line = "%ar = f32[1024]{0} all-reduce(f32[1024]{0} %g), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add"
    assert _first_group(line) == (0, 4)  # devices 0 and 4: one in each slice of 4
    hw = profile("tpu-v5p").sliced(devices=8, slices=2)
    c = Collective("all-reduce", 4096, 2, line, span=2, group=(0, 4))
    assert _seconds(c, hw, {}) == pytest.approx(4096 / hw.dcn.bandwidth + 2 * hw.dcn.latency)
