"""A gradient norm accumulated in float32 whatever the gradients' dtype, as Megatron's
`get_grad_norm_fp32` does (float32 buffers, `.item()`, the gradients scaled by a Python float:
case_files/megatron_style.py `clip_fp32_buffer`). Correct in every dtype; the float64 run used to
call it "a structural bug below bfloat16's resolution" (the float32 buffer rounded the float64
squares: the norm 1.1e-8 off against a bound of 2.3e-10, and every clipped gradient with it). The
float64 run now follows the accumulation dtype the code chose as "at least float32"
(checker/rank/precision.py, `KeepFloat64.factories`). The same clip with the replicated
parameters' squares all-reduced too (counted once per rank) is caught at step 1, at the norm in
the float64 run (in bfloat16 the norm's own bound may pass it, a clipped gradient fails).

Checker mutant: the float64 run's factories left in float32: the correct clip is "not
equivalent only in the float64 run" again."""

import pytest

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.checker.rank import precision

from paths import REPO

FILE = REPO / "tests" / "training" / "case_files" / "megatron_style.py"
GRID = [
    (2, "bfloat16"),
    pytest.param(4, "bfloat16", marks=pytest.mark.slow),
    pytest.param(2, "float32", marks=pytest.mark.slow),
    pytest.param(4, "float32", marks=pytest.mark.slow),
]


def run(name, world=2, dtype="bfloat16"):
    spec = RunSettings(dtype=dtype, clip_grad_norm=0.05, steps=2, float64_run="on")
    (r,) = check([CaseSpec(block=f"file:{FILE}:{name}", world_size=world, run=spec)])
    return r


@pytest.mark.parametrize(("world", "dtype"), GRID)
def test_a_float32_norm_is_equivalent_and_its_float64_run_too(world, dtype):
    r = run("clip_fp32_norm", world, dtype)
    assert r["verdict"] == "equivalent", r["summary"]
    assert r["float64_run"]["verdict"] == "equivalent", r["float64_run"]["summary"]


@pytest.mark.parametrize(("world", "dtype"), GRID)
def test_the_replicated_squares_counted_per_rank_are_caught_at_step_1(world, dtype):
    r = run("clip_fp32_norm_replicated_twice", world, dtype)
    assert r["verdict"] == "not equivalent", r["summary"]
    first = r["first_divergence"]
    assert (first["stage"], first["step"]) == ("optimizer", 1), first
    assert first["name"] == "clip:grad_norm" or first["name"].startswith("clipped:"), first
    f64 = r["float64_run"]
    assert f64["verdict"] == "not equivalent", f64["summary"]  # structural: in float64 too
    assert f64["first_divergence"]["name"] == "clip:grad_norm", f64["first_divergence"]


def test_with_the_float64_runs_factories_in_float32_the_correct_norm_fails(monkeypatch):
    monkeypatch.setattr(precision, "FACTORIES", frozenset())
    r = run("clip_fp32_norm")
    assert r["verdict"] == "not equivalent", r["summary"]
    assert "only in the float64 run" in r["summary"], r["summary"]
