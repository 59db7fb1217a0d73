"""The other half of the 2,000-case sweep (tests/blocks/test_properties.py has the even cases): a
file of its own, so that the slow suite's two workers share the sweep."""

import pytest
from test_properties import _no_false_alarm, _sweep_seed


@pytest.mark.slow
def test_no_false_alarm_on_2000_random_correct_cases_odd_half():
    """Cases 1, 3, 5, ... of the 2,000 random correct cases of seed 11 (docs/tolerances.md), the
    working dtype's bounds, no float64 run."""
    _no_false_alarm(2000, _sweep_seed(11), float64_run="off", part=slice(1, None, 2))
