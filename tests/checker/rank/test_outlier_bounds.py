"""One outlier in a tensor (an LLM's "massive activation") no longer widens the bound of every
element: calibrated bounds are judged per magnitude bin (checker/rank/tolerance.py). The pre-norm
block of case_files/outlier_block.py, input holding one element of 1e3 (1e4 in float32): an
all-reduce that averages and a last-rank partial sum x1.3 in bfloat16, a 5e-4 partial-sum error in
float32, are caught at the forward output; the correct block is equivalent. With the bins removed
(the whole-tensor bound, a checker mutant) the same faults pass."""

import pytest

from tpcheck.api import check
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.rank import tolerance

from paths import REPO

CASES = "tests/checker/rank/case_files/outlier_block.py"

RUNS = [
    ("correct", 2, "bfloat16", "equivalent"),
    ("averaged", 2, "bfloat16", "not equivalent"),
    ("partial_x1_3", 2, "bfloat16", "not equivalent"),
    ("partial_x1_3", 4, "bfloat16", "not equivalent"),
    ("correct_1e4", 2, "float32", "equivalent"),
    ("partial_5e_4", 2, "float32", "not equivalent"),
]


def _verdicts(runs):
    """The working dtype's own bounds: no float64 run beside the 16-bit ones (which would catch
    these structural faults whatever the bounds)."""
    specs = [file_spec(f"{REPO / CASES}:{n}", w, dtype=d, float64_run="off") for n, w, d, _ in runs]
    return check(specs)


def _assert_as_listed(runs, results):
    for (name, world, dtype, want), r in zip(runs, results):
        assert r["verdict"] == want, (name, world, dtype, r["summary"])
        if want == "not equivalent":
            first = r["first_divergence"]
            # at the first tensor the fault touches, by twice its bound or more
            assert (first["stage"], first["name"]) == ("forward", "output"), first
            assert first["error"] > 2 * first["bound"], first
        else:
            assert r["self_test"]["failures"] == []


def test_one_outlier_does_not_blind_the_bounds():
    results = _verdicts(RUNS)
    _assert_as_listed(RUNS, results)
    # the correct bfloat16 block's output is judged by magnitude: the rows of O(1) values get an
    # O(0.1) bound, where the whole tensor's is over 1 ulp of the outlier (7.8)
    out = [c for c in results[0]["checks"] if c["name"] == "output" and c["stage"] == "forward"]
    assert len(out) >= 2 and all(c["scale"] == pytest.approx(1e3, rel=1e-2) for c in out)
    assert all(c["magnitude"] <= 8 and c["bound"] < 0.3 for c in out)


@pytest.mark.slow
def test_partial_sum_x1_3_is_caught_at_world_8_with_the_outlier():
    runs = [
        ("partial_x1_3", 8, "bfloat16", "not equivalent"),
        ("correct", 8, "bfloat16", "equivalent"),
    ]
    _assert_as_listed(runs, _verdicts(runs))


def test_whole_tensor_bounds_are_the_mutant_that_misses_them(monkeypatch):
    """The checker with every tensor judged whole (no bins): the outlier hides the faults."""
    monkeypatch.setattr(tolerance, "_by_magnitude", lambda *a, **k: None)
    faults = [r for r in RUNS if r[3] == "not equivalent"]
    results = _verdicts(faults)
    with pytest.raises(AssertionError):
        _assert_as_listed(faults, results)
    assert [r["verdict"] for r in results].count("equivalent") >= 3
