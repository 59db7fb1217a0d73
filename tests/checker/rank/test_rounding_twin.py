"""A dense model that is not its own float64 twin (checker/rank/rounding.py): an inference norm
written in place, which in float32 writes into the residual stream and in float64 into a copy, and a
norm kernel chosen by dtype whose bfloat16 fast path does the same (case_files/not_its_own_twin.py).
The float64 run then computes another function; its gap (2.6 on values of about 2) is no rounding,
and bounds made from it let a reversed LM-head gather pass. The rounding twin (the dense model rerun
with every op's result moved by up to an ulp) says what rounding explains; past it, the bounds are
made from the twin and the report says from where.

Checker mutants: the twin never consulted lets the reversed gather pass ("equivalent"); the twin
made the yardstick of every tensor of every case (no gate, no ratio) still passes correct cases and
catches catalogue faults: its bounds are never narrower than rounding."""

import pytest
import torch

from tpcheck import CaseSpec, check
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.rank import rounding

from paths import REPO

FILE = REPO / "tests" / "checker" / "rank" / "case_files" / "not_its_own_twin.py"
NOTE = "against the float64 run from act:layers.0 (step 1) on: the dense model is not its own"


def run(name, world=2, dtype="float32"):
    (r,) = check([file_spec(f"{FILE}:{name}", world, dtype=dtype)])
    return r


def _notes(r):
    return [n for n in r.get("notes") or () if n.startswith(rounding.OFF_PATH)]


def test_an_in_place_norm_is_named_and_a_reversed_head_gather_caught_in_float32():
    correct, buggy = run("in_place_norm"), run("head_gather_reversed")
    assert correct["verdict"] == "equivalent", correct["summary"]
    for r in (correct, buggy):
        (note,) = _notes(r)
        assert note.startswith(NOTE), note
    assert buggy["verdict"] == "not equivalent", buggy["summary"]
    assert buggy["first_divergence"]["name"] == "output"
    out = next(c for c in buggy["checks"] if c["name"] == "output" and not c["passed"])
    assert "rounding twin" in out["reason"] and out["bound"] < 1e-3, out


def test_without_the_twin_the_reversed_gather_passes(monkeypatch):
    """The gap this fixes: bounds made from the float64 run's other path (8 x 2.6) hide an error
    of about 5 in the logits."""
    monkeypatch.setattr(rounding.Twin, "looks", lambda self, *args: False)
    r = run("head_gather_reversed")
    assert r["verdict"] == "equivalent" and not _notes(r), r["summary"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_reversed_gather_is_caught_at_every_world_and_dtype(world, dtype):
    correct, buggy = run("in_place_norm", world, dtype), run("head_gather_reversed", world, dtype)
    assert correct["verdict"] == "equivalent", correct["summary"]
    assert buggy["verdict"] == "not equivalent", buggy["summary"]
    assert buggy["first_divergence"]["name"] == "output"
    # in bfloat16 `x.float()` copies: the norm writes into a copy, the model is its own twin
    assert bool(_notes(correct)) == (dtype == "float32"), correct.get("notes")


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_bug_on_a_16_bit_only_path_is_not_called_precision_specific(world):
    correct = run("fast_path", world, "bfloat16")
    buggy = run("fast_path_forgets_weight", world, "bfloat16")
    assert correct["verdict"] == "equivalent" and _notes(correct), correct["summary"]
    assert correct["float64_run"]["verdict"] == "equivalent"
    assert buggy["verdict"] == "not equivalent", buggy["summary"]
    assert buggy["first_divergence"]["name"] == "act:layers.0.norm"
    assert "precision-specific" not in buggy["summary"].replace("not precision-specific", "")
    assert "on a path the float64 run does not take" in buggy["summary"], buggy["summary"]


def test_rounding_moves_each_result_by_at_most_an_ulp_and_the_same_each_time():
    x = torch.linspace(-3, 3, 1000, dtype=torch.float32)
    with rounding.Rounding():
        a = torch.exp(x)
    with rounding.Rounding():
        b = torch.exp(x)
    exact = torch.exp(x.double())
    assert torch.equal(a, b)
    rel = ((a.double() - exact) / exact).abs().max().item()
    assert 0 < rel <= 2 * torch.finfo(torch.float32).eps
    assert (a != torch.exp(x)).any()  # it moved some


@pytest.mark.slow
def test_the_twin_as_every_tensors_yardstick_passes_correct_cases_and_catches_faults(monkeypatch):
    monkeypatch.setattr(rounding, "RATIO", 0.0)
    monkeypatch.setattr(rounding, "GATE_ULPS", 0.0)
    correct = [
        CaseSpec(block=b, preset="tiny", world_size=w).with_run(dtype=d)
        for b in ("mlp", "layer", "lm")
        for w in (2, 4)
        for d in ("float32", "bfloat16", "float16")
    ]
    faults = ("missing_backward_reduce", "embedding_without_mask", "reduced_twice")
    buggy = [
        CaseSpec(block="lm", preset="tiny", world_size=2, fault=f).with_run(dtype="bfloat16")
        for f in faults
    ]
    results = check(correct + buggy)
    for r in results:
        assert r["verdict"] == r["expected"], r["summary"]
        assert _notes(r), r["summary"]  # the twin was the yardstick
