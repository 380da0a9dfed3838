"""The partitioner on training steps as people write them (`tests/corpus`): on 8 fake devices
with the h100 profile, the fast plan compiles to at most 1.05x the cost of the best plan an
engineer would write, and the thorough plan to no more than the fast one, every cost read by
`partitioner.verify` from what XLA compiled. Slow tier: each model is planned twice and compiled
five to eight times (`make test-slow`)."""

import pytest

from tests.corpus import CORPUS, common, load

pytestmark = pytest.mark.slow

FAST_OVER_EXPERT = 1.05


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_searched_plans_compile_no_worse_than_the_experts(name, devices8):
    module, options = load(name)
    rows = {r.label: r for r in common.compare(module, **options)}
    experts = [rows[e.name] for e in module.EXPERTS]
    best = min(experts, key=lambda r: r.compiled_seconds)
    table = common.table(list(rows.values()))
    fast, thorough = rows["fast"], rows["thorough"]
    assert fast.compiled_seconds <= FAST_OVER_EXPERT * best.compiled_seconds, (
        f"{name}: fast plan compiles to {fast.compiled_seconds / best.compiled_seconds:.3f}x the best expert's "
        f"({best.label}):\n{table}"
    )
    assert thorough.compiled_seconds <= fast.compiled_seconds * (1 + 1e-9), (
        f"{name}: thorough worse than fast:\n{table}"
    )
