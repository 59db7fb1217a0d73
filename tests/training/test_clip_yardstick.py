"""The optimizer stage's yardstick is the dense side's truth, not a replay of the TP side's own
gradients: a clipping that computes the right total norm but scales only the sharded parameters'
gradients (the replicated ones, a norm's weight and bias, a row-parallel bias, step unclipped),
followed by AdamW, is caught at the step where it first acts, at a clipped gradient, named
`clip_partial` with the parameters it left out; its correct twin (the same norm, every gradient
scaled) is equivalent. Under AdamW the replay alone could not see it: Adam's update is nearly
invariant to the gradient's scale, and the replay starts from the TP side's (unclipped)
gradients."""

import pytest

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.checker.rank import moments

from paths import REPO

FILE = REPO / "tests" / "training" / "case_files" / "megatron_style.py"
GRID = [(world, dtype) for world in (2, 4) for dtype in ("float32", "bfloat16")]


def spec(name, world, dtype, steps=3):
    run = RunSettings(dtype=dtype, clip_grad_norm=0.05, steps=steps)
    return CaseSpec(block=f"file:{FILE}:{name}", world_size=world, run=run)


@pytest.fixture(scope="module")
def results():
    names = ("clip_sharded_gradients_only", "clip_correct")
    specs = [spec(n, w, d) for n in names for w, d in GRID]
    return dict(zip(specs, check(specs)))


@pytest.mark.slow
@pytest.mark.parametrize("world,dtype", GRID)
def test_a_clip_of_the_sharded_gradients_only_is_caught_at_the_step_and_named(
    results, world, dtype
):
    r = results[spec("clip_sharded_gradients_only", world, dtype)]
    assert r["verdict"] == "not equivalent", r["summary"]
    first = r["first_divergence"]
    assert (first["stage"], first["step"]) == ("optimizer", 1), first
    assert first["name"].startswith("clipped:"), first
    assert r["diagnosis"]["signature"] == "clip_partial", r["summary"]
    left = r["diagnosis"]["evidence"]["left_unscaled"]
    assert set(left) == {"norm.weight", "norm.bias", "fc2.bias"}, left
    # the norm alone was right: only the gradients it scaled tell the bug
    norms = [c for c in r["checks"] if c["name"] == "clip:grad_norm"]
    assert norms and all(c["passed"] for c in norms)
    # the optimizer state is held to the dense side's too, and fails where the gradient did
    failed = {c["name"] for c in r["checks"] if not c["passed"] and c["stage"] == "optimizer"}
    assert "moment:norm.weight.exp_avg" in failed, sorted(failed)


@pytest.mark.slow
@pytest.mark.parametrize("world,dtype", GRID)
def test_its_correct_twin_is_equivalent_with_every_clipped_gradient_and_moment_checked(
    results, world, dtype
):
    r = results[spec("clip_correct", world, dtype)]
    assert r["verdict"] == "equivalent", r["summary"]
    names = {c["name"] for c in r["checks"]}
    for p in ("norm.weight", "fc1.weight", "fc2.bias"):
        assert f"clipped:{p}" in names and f"moment:{p}.exp_avg_sq" in names, sorted(names)


def test_a_checker_without_the_dense_yardstick_misses_it(monkeypatch):
    """Checker mutant: the clipped gradients and the moments not compared (the optimizer stage
    held to the replay alone, as before): the bug passes, so the new checks are what catch it."""
    from tpcheck.checker.rank import optimizer_stage, training

    monkeypatch.setattr(moments, "compare_moments", lambda *a: None)
    monkeypatch.setattr(optimizer_stage, "clip", lambda s, opts, step: training.clip_grads(s, step))
    (r,) = check([spec("clip_sharded_gradients_only", 2, "float32")])
    assert r["verdict"] == "equivalent", r["summary"]
