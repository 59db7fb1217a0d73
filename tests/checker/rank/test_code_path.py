"""Code the float64 run never ran (checker/verdict/code_path.py): a norm that branches on the dtype,
the same function on both paths (case_files/dtype_branch.py), so the dense model is its own
float64 twin and no value says the float64 run took another path. A TP bug on the 16-bit path
alone (the shard's own mean square) is caught in bfloat16 and passes the float64 run: it is
structural, not a tolerance question, and the summary says so by the lines that ran.

Checker mutant: the lines not compared (`only_working` finding none) turns the same failure back
into "precision-specific"."""

import pytest

from tpcheck import check
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.verdict import code_path

from paths import REPO

FILE = REPO / "tests" / "checker" / "rank" / "case_files" / "dtype_branch.py"
# the branch's first line in 16 bits, on both sides
FIRST = "tests/checker/rank/case_files/dtype_branch.py:80 (to, in `norm`"


def run(name, world=2, dtype="bfloat16"):
    (r,) = check([file_spec(f"{FILE}:{name}", world, dtype=dtype)])
    return r


def _note(r):
    (note,) = [n for n in r.get("notes") or () if n.startswith(code_path.NOTE)]
    return note


def _precision_specific(summary: str) -> bool:
    return "precision-specific" in summary.replace("not precision-specific", "")


@pytest.mark.parametrize(
    ("world", "dtype"),
    [(2, "bfloat16"), pytest.param(4, "float16", marks=pytest.mark.slow)],
)
def test_a_bug_on_a_16_bit_branch_is_structural_and_its_correct_twin_equivalent(world, dtype):
    correct, buggy = run("branch", world, dtype), run("local_rms_in_16_bits", world, dtype)
    assert correct["verdict"] == "equivalent", correct["summary"]
    assert correct["float64_run"]["verdict"] == "equivalent"
    for r in (correct, buggy):
        note = _note(r)
        assert f"the dense model's {FIRST}" in note and f"the TP model's {FIRST}" in note, note
        assert f"ran in {dtype} and not in float64" in note, note
    assert buggy["verdict"] == "not equivalent", buggy["summary"]
    assert buggy["first_divergence"]["name"] == "act:norm"
    assert buggy["float64_run"]["verdict"] == "equivalent"
    assert not _precision_specific(buggy["summary"]), buggy["summary"]
    assert "on a path the float64 run does not take" in buggy["summary"], buggy["summary"]


def test_without_the_lines_compared_the_same_bug_is_called_precision_specific(monkeypatch):
    monkeypatch.setattr(code_path, "only_working", lambda working, f64: [])
    r = run("local_rms_in_16_bits")
    assert r["verdict"] == "not equivalent", r["summary"]
    assert _precision_specific(r["summary"]), r["summary"]


def test_float32_runs_no_float64_run_and_says_nothing_of_lines():
    r = run("branch", dtype="float32")
    assert r["verdict"] == "equivalent", r["summary"]
    assert not any(n.startswith(code_path.NOTE) for n in r.get("notes") or ())


def _site(path, line, op="mul", module="m"):
    return [path, line, op, module]


def test_lines_are_compared_not_modules_and_a_record_cut_short_is_not_compared():
    f64 = {"dense": [_site("a.py", 1), _site("a.py", 2, module="experts.0")]}
    # the same lines in another module (an expert that got the tokens in one run only): no note
    same = {"dense": [_site("a.py", 1), _site("a.py", 2, module="experts.3")]}
    assert code_path.only_working(same, f64) == []
    other = {"dense": [_site("a.py", 1), _site("a.py", 7, "rsqrt", "norm"), _site("a.py", 8)]}
    (away,) = code_path.only_working(other, f64)
    assert (away["side"], away["line"], away["op"], away["module"], away["count"]) == (
        "dense",
        7,
        "rsqrt",
        "norm",
        2,
    )
    # a side one run did not note, or noted to the cap, says nothing
    assert code_path.only_working(other, {"tp": f64["dense"]}) == []
    full = {"dense": [_site("b.py", i) for i in range(code_path.MAX_SITES)]}
    assert code_path.only_working(full, f64) == []
    assert code_path.only_working(other, full) == []
