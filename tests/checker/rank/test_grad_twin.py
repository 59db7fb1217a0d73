"""Parameter gradients bounded by the rounding twin (checker/rank/rounding.py `grad_bound`): a
fused bias-GeLU kernel with the tanh approximation in float32 and the exact GeLU in float64
(case_files/fused_gelu.py) makes the dense model not its own float64 twin. A TP gradient kept in
bfloat16 (1.6e-4 off) is caught at `grad:down.weight` under the twin's bound (2.5e-7); the correct
twin is equivalent. Checker mutant: gradient bounds from the float64 run alone."""

from tpcheck import check
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.rank import rounding

from paths import REPO

FILE = REPO / "tests" / "checker" / "rank" / "case_files" / "fused_gelu.py"


def run(name):
    (r,) = check([file_spec(f"{FILE}:{name}", 2, dtype="float32")])
    return r


def test_a_gradient_kept_in_bfloat16_is_caught_under_the_twins_bound():
    correct, buggy = run("fused_gelu"), run("down_grad_in_bfloat16")
    assert correct["verdict"] == "equivalent", correct["summary"]
    assert buggy["verdict"] == "not equivalent", buggy["summary"]
    assert buggy["first_divergence"]["name"] == "grad:down.weight"
    failed = next(c for c in buggy["checks"] if c["name"] == "grad:down.weight" and not c["passed"])
    assert "rounding twin" in failed["reason"], failed


def test_without_the_twin_for_gradients_their_bound_is_the_float64_runs(monkeypatch):
    monkeypatch.setattr(rounding.Twin, "grad_bound", lambda self, *args: None)
    r = run("down_grad_in_bfloat16")
    checks = [c for c in r["checks"] if c["name"] == "grad:down.weight" and c["stage"] == "grads"]
    assert checks and not any("rounding twin" in c["reason"] for c in checks)
