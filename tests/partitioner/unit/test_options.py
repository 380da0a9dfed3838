"""Plan options: one dataclass for `plan`, `search` and `StepPlanner.plan`, each checked once."""

import pytest

from partitioner import PlanInputError, PlanOptions
from partitioner.tactics import TACTICS


def test_an_unknown_option_is_an_error_that_lists_the_known_ones():
    with pytest.raises(PlanInputError, match=r"unknown plan options \['levle'\]: expected some of .*'level'"):
        PlanOptions.of(None, {"levle": "fast"})
    assert PlanOptions.of(PlanOptions(level="thorough"), {"slices": 2}) == PlanOptions(level="thorough", slices=2)


@pytest.mark.parametrize(
    "options, words",
    [
        (PlanOptions(level="quick"), "level must be one of ('fast', 'thorough'), got 'quick'"),
        (PlanOptions(slices=3), "got slices=3 for 8 devices; pass a divisor of 8"),
        (PlanOptions(tactics=("dp", "zero3")), "unknown tactics ['zero3']"),
    ],
)
def test_options_that_do_not_fit_the_devices_say_which(options, words):
    with pytest.raises(PlanInputError) as e:
        options.checked(8, TACTICS)
    assert words in str(e.value)
