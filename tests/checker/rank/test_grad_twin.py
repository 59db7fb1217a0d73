"""Parameter gradients bounded by the rounding twin (checker/rank/rounding.py `grad_bound`): a
fused bias-GeLU kernel with the tanh approximation in float32 and the exact GeLU in float64
(case_files/fused_gelu.py) makes the dense model not its own float64 twin. A TP gradient sent in
float16 (1.8e-5 off) is caught at `grad:down.weight` under the twin's bound (2.5e-7); the correct
twin is equivalent. Checker mutant: gradient bounds from the float64 run alone (8 x its 1.5e-5
gap): the same bug is then called equivalent.

An input's gradient likewise: all-reduced in float16, caught at `grad:x`; with the twin's bounds
for outputs off (mutant), equivalent.

The optimizer stage likewise (`Twin.stand_in_grads`): with gradient clipping, a clip coefficient
rounded to float16 is caught at the first clipped gradient, `scaled`; with the truth's optimizer
stage stepping from the float64 run's gradients (mutant), it is equivalent."""

from tpcheck import check
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.rank import rounding

from paths import REPO

FILE = REPO / "tests" / "checker" / "rank" / "case_files" / "fused_gelu.py"


def run(name):
    (r,) = check([file_spec(f"{FILE}:{name}", 2, dtype="float32")])
    return r


def test_a_gradient_sent_in_float16_is_caught_under_the_twins_bound():
    correct, buggy = run("fused_gelu"), run("down_grad_in_float16")
    assert correct["verdict"] == "equivalent", correct["summary"]
    assert buggy["verdict"] == "not equivalent", buggy["summary"]
    assert buggy["first_divergence"]["name"] == "grad:down.weight"
    failed = next(c for c in buggy["checks"] if c["name"] == "grad:down.weight" and not c["passed"])
    assert "rounding twin" in failed["reason"], failed


def test_with_gradient_bounds_from_the_float64_run_the_bug_passes(monkeypatch):
    monkeypatch.setattr(rounding.Twin, "grad_bound", lambda self, *args: None)
    r = run("down_grad_in_float16")
    assert r["verdict"] == "equivalent", r["summary"]  # missed: the twin is what sees it


def test_a_clip_coefficient_in_float16_is_caught_under_the_twins_gradients():
    correct, buggy = run("clipped"), run("clip_coef_in_float16")
    assert correct["verdict"] == "equivalent", correct["summary"]
    assert "steps from the rounding twin's gradients" in correct["summary"]
    assert buggy["verdict"] == "not equivalent", buggy["summary"]
    first = buggy["first_divergence"]
    assert first["name"].startswith("clipped:") and first["step"] == 1, first
    assert "scaled" in buggy["summary"]
    failed = next(c for c in buggy["checks"] if c["name"] == first["name"] and not c["passed"])
    assert "vs the float64 step from the rounding twin's gradients" in failed["reason"], failed


def test_with_the_optimizer_stage_on_the_float64_runs_gradients_the_bug_passes(monkeypatch):
    monkeypatch.setattr(rounding.Twin, "stand_in_grads", lambda self, *args: None)
    r = run("clip_coef_in_float16")
    assert r["verdict"] == "equivalent", r["summary"]  # missed: the twin is what sees it


def test_an_input_gradient_all_reduced_in_float16_is_caught_under_the_twins_bound():
    buggy = run("input_grad_in_float16")
    assert buggy["verdict"] == "not equivalent", buggy["summary"]
    assert buggy["first_divergence"]["name"] == "grad:x"
    failed = next(c for c in buggy["checks"] if c["name"] == "grad:x" and not c["passed"])
    assert "rounding twin" in failed["reason"], failed


def test_with_the_input_gradients_bound_from_the_float64_run_the_bug_passes(monkeypatch):
    monkeypatch.setattr(rounding.Twin, "bound_for", lambda self, dense: None)
    r = run("input_grad_in_float16")
    assert r["verdict"] == "equivalent", r["summary"]  # missed: the twin is what sees it
