"""Plans on slices: hybrid meshes, the slow link named in the notes, slices recorded and bound."""

import jax
import pytest

import partitioner
from orchestrator import check_program


@pytest.fixture(scope="module")
def gpt():
    from examples.gpt.model import program

    state, batch = check_program(program, 24)
    return program, state, batch


@pytest.mark.parametrize("hardware", ["tpu-v5p", "h100"])
def test_a_plan_on_two_slices_keeps_tensor_parallelism_inside_one_and_says_what_crosses(gpt, hardware):
    program, state, batch = gpt
    plan = partitioner.plan(program.step, state, batch, devices=8, slices=2, hardware=hardware, compile_check=False)
    assert plan.slices == 2 and "in 2 slices" in plan.describe()
    assert plan.mesh.get("model", 1) * plan.mesh.get("seq", 1) <= 4
    said = [n for n in plan.notes if n.startswith("across slices")]
    assert len(said) == 1 and "slower than within one" in said[0]
    again = partitioner.Plan.from_json(plan.to_json())
    assert again.slices == 2 and again.mesh == plan.mesh
    mesh = plan.bind(jax.devices())
    assert mesh.devices.size == plan.devices_used


def test_slices_that_do_not_divide_the_devices_are_refused_with_the_fix(gpt):
    program, state, batch = gpt
    with pytest.raises(partitioner.PlanInputError, match=r"slices=3 for 8 devices; pass a divisor of 8"):
        partitioner.plan(program.step, state, batch, devices=8, slices=3, hardware="tpu-v5p")


def test_a_plan_bound_to_devices_in_other_slices_than_it_was_made_for_is_refused_with_the_fix(gpt):
    program, state, batch = gpt
    plan = partitioner.plan(program.step, state, batch, devices=8, slices=2, hardware="tpu-v5p", compile_check=False)

    class TpuDevice:  # TPU devices say their slice; these are 8 chips in slices of 3, 3 and 2
        def __init__(self, i):
            self.id, self.slice_index = i, (0, 0, 0, 1, 1, 1, 2, 2)[i]

    with pytest.raises(ValueError, match=r"plan is for 2 equal slices, but the devices given are in 3"):
        plan.bind([TpuDevice(i) for i in range(8)])


def test_one_slice_plans_as_before(gpt):
    program, state, batch = gpt
    flat = partitioner.plan(program.step, state, batch, devices=8, hardware="tpu-v5p", compile_check=False)
    one = partitioner.plan(program.step, state, batch, devices=8, slices=1, hardware="tpu-v5p", compile_check=False)
    assert one.mesh == flat.mesh and one.slices == 1 and one.cost.total_seconds == flat.cost.total_seconds


def test_compiled_collectives_are_charged_at_the_levels_their_groups_cross(gpt):
    # A memory limit that forces sharding: HSDP (FSDP inside a slice, data parallel across).
    program, state, batch = gpt
    free = partitioner.plan(program.step, state, batch, devices=8, slices=2, hardware="tpu-v5p", compile_check=False)
    limit = int(0.6 * free.cost.peak_bytes_per_device)
    plan = partitioner.plan(program.step, state, batch, devices=8, slices=2, hardware="tpu-v5p", memory_limit=limit,
                            compile_check=False)  # fmt: skip
    assert plan.mesh.get("replica") == 2 and "fsdp" in plan.tactic
    assert any("replica=2 (data parallel, FSDP over data inside each slice (HSDP))" in n for n in plan.notes)
    v = partitioner.verify(plan, program.step, state, batch, hardware="tpu-v5p")
    assert set(v.level_bytes) == set(plan.cost.level_bytes) == {"host", "dcn"}
    assert 0 < v.level_bytes["dcn"] < v.level_bytes["host"]  # only the shards' reduction crosses slices
    assert v.level_bytes["dcn"] == pytest.approx(plan.cost.level_bytes["dcn"], rel=0.25)


def test_experts_are_spread_across_slices_where_that_is_cheaper_than_data_parallelism():
    """DeepSeek-style MoE (sort dispatch, 8 experts of its corpus size) on 4 slices of 2 H100s: the
    experts across slices (tokens sent to them over the slow link) in place of their gradients
    reduced over it, chosen, said, and cheaper compiled than data parallelism across slices with
    the experts inside each (DeepSeek's own expert parallelism) or everywhere."""
    from tests.corpus import common, deepseek

    fn, args = deepseek.build(layers=2, form="sort")
    plan = partitioner.plan(fn, *args, devices=8, slices=4, hardware="h100")
    assert plan.tactic == "expert" and plan.mesh == {"expert": 4}, plan.describe()
    assert any(n.startswith("across slices") and "expert=4 (expert parallel)" in n for n in plan.notes), plan.notes
    inside = common.Expert("dp x experts inside", {"replica": 4, "model": 2}, deepseek.expert_parallel)
    everywhere = common.Expert("dp everywhere", {"data": 8}, lambda path, shape: None)
    hand = [common.expert_plan(e, fn, args, slices=4) for e in (inside, everywhere)]
    mine, *theirs = partitioner.verify_many([(p, fn, args) for p in (plan, *hand)], hardware="h100")
    seconds = lambda v: v.compute_seconds + v.communication_seconds  # noqa: E731
    assert seconds(mine) < min(seconds(v) for v in theirs), [seconds(v) for v in (mine, *theirs)]
    assert mine.level_bytes["dcn"] > 0  # the tokens' all-to-all crosses slices
