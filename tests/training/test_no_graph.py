"""A TP forward that runs without autograd (`@torch.inference_mode()` on it) is checked forward
only, said in the report, never refused; its missing all-reduce is caught at the output as a
partial sum. A dense forward without a graph is still refused: without it nothing holds the TP
side's training to anything (case_files/inference_forward.py)."""

import pytest

from tpcheck import check
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.pool import session

from paths import REPO

FILE = REPO / "tests" / "training" / "case_files" / "inference_forward.py"
SAID = "not checked: training: the TP module's output has no grad_fn"


def run(name, world=2, dtype="float32"):
    (r,) = check([file_spec(f"{FILE}:{name}", world, dtype=dtype)])
    return r


@pytest.mark.parametrize(
    "world, dtype", [(2, "float32"), pytest.param(4, "bfloat16", marks=pytest.mark.slow)]
)
def test_a_tp_forward_without_a_graph_is_checked_forward_only_and_said(world, dtype):
    correct, buggy = run("correct", world, dtype), run("missing_reduce", world, dtype)
    assert correct["verdict"] == "equivalent", correct["summary"]
    assert SAID in correct["summary"] and correct["forward_only"] is not None
    assert buggy["verdict"] == "not equivalent", buggy["summary"]
    assert buggy["first_divergence"]["name"] == "output"
    assert buggy["diagnosis"]["signature"] == "partial_sum"


def test_a_dense_forward_without_a_graph_is_still_refused():
    r = run("dense_without_graph")
    assert r["verdict"] == "invalid", r["summary"]
    assert "the dense module's output has no grad_fn" in r["summary"]


def test_without_the_rerun_the_tp_forward_is_refused(monkeypatch):
    monkeypatch.setattr(session, "_untrainable", lambda result: None)
    r = run("correct")
    assert r["verdict"] == "invalid" and "the TP module's output has no grad_fn" in r["summary"]
