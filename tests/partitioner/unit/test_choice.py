"""The choice among close candidates: the roofline's best stands unless the predicted FLOPs and
collectives (what a compile shows) put another more than AGREE ahead; plans on fewer devices
are left to the roofline."""

from partitioner.candidates import Candidate, Tactic
from partitioner.guard import AGREE, CLOSE, by_compiled_view, pick
from partitioner.plan import Cost


def candidate(tactic, mesh, total, flops_and_collectives):
    comm = flops_and_collectives / 2
    cost = Cost(total - comm, comm, {}, 0, flop_seconds=flops_and_collectives - comm)
    return Candidate(Tactic(tactic), mesh, {}, cost, None)


def test_the_view_overrules_the_roofline_only_by_more_than_agree():
    roofline = candidate("dp", {"data": 8, "model": 1}, 1.00, 1.00)
    near = candidate("megatron", {"data": 4, "model": 2}, 1.02, 1.00 / AGREE * 1.001)
    far = candidate("megatron", {"data": 4, "model": 2}, 1.02, 0.80)
    assert pick(roofline, by_compiled_view([roofline, near])) is roofline
    assert pick(roofline, by_compiled_view([roofline, far])) is far


def test_plans_on_fewer_devices_or_beyond_close_are_not_weighed_by_the_view():
    roofline = candidate("dp", {"data": 8, "model": 1}, 1.00, 1.00)
    fewer = candidate("dp", {"data": 4, "model": 1}, 1.05, 0.50)
    beyond = candidate("fsdp", {"data": 8, "model": 1}, CLOSE * 1.01, 0.50)
    view = by_compiled_view([roofline, fewer, beyond])
    assert view == [roofline]
    assert pick(roofline, view) is roofline


def test_on_slices_the_best_plan_that_puts_another_axis_across_them_is_compiled_beside_it():
    from partitioner import profile
    from partitioner.guard import across_rival

    hw = profile("tpu-v5p").sliced(8, 4)  # 4 slices of 2 devices
    hsdp = candidate("fsdp", {"replica": 2, "data": 2, "seq": 1, "model": 1}, 1.00, 1.00)  # replica across
    wider = candidate("fsdp", {"replica": 4, "data": 2, "seq": 1, "model": 1}, 1.10, 1.10)  # replica across too
    megatron = candidate("megatron", {"data": 2, "seq": 1, "model": 2}, 1.15, 1.15)  # data across
    far = candidate("dp", {"data": 4, "seq": 1, "model": 1}, CLOSE * 1.01, 1.0)
    assert across_rival(hsdp, [hsdp, wider, megatron, far], hw) is megatron
    assert across_rival(hsdp, [hsdp, wider, far], hw) is None  # beyond CLOSE: the roofline decides
    assert across_rival(hsdp, [hsdp, megatron], profile("tpu-v5p")) is None  # one slice: nothing crosses
