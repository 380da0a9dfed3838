"""The one FSDP rule, which the tactics, their Megatron+FSDP variant and the shapes planner share."""

from partitioner.fsdp import fsdp_dim


def test_the_largest_dimension_the_axis_divides_the_first_of_equals_none_taken():
    assert fsdp_dim((512, 2048), 8) == 1
    assert fsdp_dim((1024, 1024), 8) == 0  # the first of equals
    assert fsdp_dim((1024, 2048), 8, taken=(False, True)) == 0  # the model axis splits the larger
    assert fsdp_dim((6, 4), 8) is None and fsdp_dim((4,), 8) is None  # too small, or not divided
    assert fsdp_dim((), 2) is None  # a scalar stays replicated


def test_megatron_fsdp_splits_optimizer_state_as_its_parameter():
    """Adam's moments are split as their parameter is, Megatron's axis included: with FSDP's
    dimension chosen for them alone, a moment lost its parameter's model split (twice its bytes,
    and moved into its parameter's layout at every update)."""
    from partitioner.analysis import read_inputs
    from partitioner.tactics import tactic_plans
    from tests.corpus import llama_scan

    fn, args = llama_scan.small()
    inputs = read_inputs(fn, args, None)
    (plan,) = [p for p in tactic_plans(inputs, {"data": 4, "seq": 1, "model": 2}) if str(p.tactic) == "megatron+fsdp"]
    by_key = {"/".join(k): v for k, v in zip(inputs.keys, inputs.ids)}
    checked = 0
    for key, v in by_key.items():
        split = plan.annotations.get(v, ())
        if not key.startswith("params/") or not any("model" in axes for axes in split):
            continue
        for moment in ("mu", "nu"):
            mirrored = by_key[f"opt_state/0/{moment}/{key.removeprefix('params/')}"]
            assert plan.annotations.get(mirrored) == plan.annotations[v], (key, moment)
            checked += 1
    assert checked >= 14  # (every Megatron-split weight of the layer stack, both moments)
