"""The one FSDP rule, which the tactics, their Megatron+FSDP variant and the shapes planner share."""

from partitioner.fsdp import fsdp_dim


def test_the_largest_dimension_the_axis_divides_the_first_of_equals_none_taken():
    assert fsdp_dim((512, 2048), 8) == 1
    assert fsdp_dim((1024, 1024), 8) == 0  # the first of equals
    assert fsdp_dim((1024, 2048), 8, taken=(False, True)) == 0  # the model axis splits the larger
    assert fsdp_dim((6, 4), 8) is None and fsdp_dim((4,), 8) is None  # too small, or not divided
    assert fsdp_dim((), 2) is None  # a scalar stays replicated
