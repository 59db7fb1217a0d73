"""Warm-up forwards (`RunSettings(warmup=N)`, `--warmup N`): TP code that takes another path after
N calls (case_files/call_count.py: a fused path from the 8th call on, its bias added before the
all-reduce) passes a default check, which makes 3 steps x 2 micro-batches = 6 forwards and the
last step's eval-mode forward (the documented limit), and is caught at step 1 after 7 warm-up
forwards; its correct twin passes. The
warm-up's collectives are recorded in the ledger's phase "warmup", outside the per-step counts."""

from pathlib import Path

import pytest

from tpcheck import CaseSpec, RunSettings
from tpcheck.api import check
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.rank import engine
from tpcheck.checker.verdict.collectives import check_ledger
from tpcheck.checker.vocabulary import WARMUP
from tpcheck.errors import UsageError

CASES = Path(__file__).parent / "case_files" / "call_count.py"
RUNS = [
    ("fused_bias_early", 0),
    ("fused_bias_early", 7),
    ("fused_correct", 7),
    ("fused_bias_early_forward_only", 7),
    ("fused_correct_forward_only", 7),
]


def _specs(runs):
    return [file_spec(f"{CASES}:{name}", 2, warmup=n) for name, n in runs]


@pytest.fixture(scope="module")
def results():
    mlp = CaseSpec(block="mlp", world_size=2, run=RunSettings(warmup=2, steps=2))
    *files, built_in = check([*_specs(RUNS), mlp])
    return {**dict(zip(RUNS, files)), "mlp": built_in}


def _first(r):
    f = r["first_divergence"]
    return f["stage"], f["step"], f["name"]


def test_a_path_taken_from_the_8th_call_passes_the_default_check(results):
    """The documented limit: 3 steps x 2 micro-batches are 6 forwards, and the eval-mode forward of
    the last step a 7th."""
    r = results[("fused_bias_early", 0)]
    assert r["verdict"] == "equivalent", r["summary"]
    assert r["spec"]["warmup"] == 0


@pytest.mark.parametrize("name", ["fused_bias_early", "fused_bias_early_forward_only"])
def test_after_7_warm_up_forwards_the_8th_call_is_checked_at_step_1(results, name):
    r = results[(name, 7)]
    assert r["verdict"] == "not equivalent", r["summary"]
    assert _first(r) == ("forward", 1, "output"), r["summary"]
    assert r["diagnosis"]["signature"] == "offset", r["summary"]
    assert r["spec"]["warmup"] == 7


@pytest.mark.parametrize("name", ["fused_correct", "fused_correct_forward_only"])
def test_the_correct_fused_path_after_warm_up_is_equivalent(results, name):
    r = results[(name, 7)]
    assert r["verdict"] == "equivalent", r["summary"]
    assert {c["step"] for c in r["checks"] if c["stage"] == "forward"} == {1, 2, 3}


def test_the_warm_up_collectives_are_their_own_phase_and_the_ledger_check_passes(results):
    for key in [("fused_correct", 7), ("fused_bias_early", 0), "mlp"]:
        assert results[key]["ledger"]["problems"] == [], key
    correct = results[("fused_correct", 7)]["ledger"]["per_rank"]
    for rank in ("0", "1"):  # 7 warm-up forwards, one all-reduce each; the steps' counts unchanged
        assert correct[rank][WARMUP] == {"all_reduce": {"count": 7, "bytes": 1792}}
        assert correct[rank]["forward"]["all_reduce"]["count"] == 6
    mlp = results["mlp"]
    assert mlp["verdict"] == "equivalent", mlp["summary"]
    assert mlp["ledger"]["per_rank"]["0"][WARMUP]["all_reduce"]["count"] == 2
    assert all(e["phase"] != WARMUP for e in mlp["ledger"]["expected"])
    assert mlp["name"].endswith("/warmup2")


def test_the_ledger_check_holds_warm_up_collectives_to_symmetry_only():
    expected = (("forward", "all_reduce", "down"),)

    def entry(rank, phase):
        return {"rank": rank, "phase": phase, "op": "all_reduce", "site": "down", "nbytes": 4}

    steps = [entry(r, "forward") for r in (0, 1)]
    same = check_ledger([*steps, entry(0, WARMUP), entry(1, WARMUP)], expected, 2, 1, 1)
    assert same["problems"] == []
    one_rank = check_ledger([*steps, entry(0, WARMUP)], expected, 2, 1, 1)
    assert [p["kind"] for p in one_rank["problems"]] == ["asymmetric"]
    counted_as_forward = check_ledger(
        [*steps, entry(0, "forward"), entry(1, "forward")], expected, 2, 1, 1
    )
    assert [p["kind"] for p in counted_as_forward["problems"]] == ["extra"]


def test_a_warm_up_that_runs_nothing_ends_in_error(monkeypatch):
    """Checker mutant: the warm-up runs no forward (the bug after 6 calls would be out of reach
    again): the self-test's manifest of the warm-up fails it, never "equivalent"."""
    monkeypatch.setattr(engine, "warm_up", lambda s, train: 0)
    (r,) = check(_specs([("fused_bias_early", 6)]))
    assert r["verdict"] == "error", r["summary"]
    assert "ran 0 of the 6 warm-up forward(s)" in r["summary"]


@pytest.mark.parametrize("value", [-1, True, 1.5, "6"])
def test_warmup_must_be_a_count(value):
    with pytest.raises(UsageError, match=f"warmup must be an integer in 0..10000.*got {value!r}"):
        RunSettings(warmup=value)
