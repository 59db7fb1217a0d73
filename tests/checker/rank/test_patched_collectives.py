"""A user's replacement of `torch.distributed.all_reduce` acts on the TP code that calls it, never
on tpcheck's own checks (checker/rank/torch_collectives.py): a wrapper that drops `op` (always a
sum) made tpcheck's replica check, a MAX all-reduce, blind to its own control ("a bug in
tpcheck", exit 3); now the case is equivalent and the report names the replacement at its line.
An averaging wrapper is caught as the TP bug it is. A replacement made by one case does not
outlive it: the next case in the same rank processes runs torch's all_reduce."""

import pytest

from tpcheck import check, exit_code
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.rank import torch_collectives

from paths import REPO

FILE = REPO / "tests" / "checker" / "rank" / "case_files" / "patched_collectives.py"
NOTE = "your replacement of torch.distributed.all_reduce (_install.<locals>.setup.<locals>"


def spec(name, world=2):
    return file_spec(f"{FILE}:{name}", world)


@pytest.fixture(scope="module")
def results():
    names = ("sum_wrapper", "mean_wrapper", "plain")
    return dict(zip(names, check([spec(n) for n in names])))


def test_a_wrapper_that_drops_op_does_not_blind_the_checker_and_is_named(results):
    r = results["sum_wrapper"]
    assert r["verdict"] == "equivalent", r["summary"]
    assert r["self_test"]["failures"] == [], r["self_test"]
    assert NOTE in r["summary"] and "patched_collectives.py:" in r["summary"], r["summary"]


def test_an_averaging_wrapper_is_caught_as_the_tp_bug_it_is(results):
    r = results["mean_wrapper"]
    assert r["verdict"] == "not equivalent", r["summary"]
    assert r["first_divergence"]["stage"] == "forward", r["first_divergence"]
    assert exit_code([r]) == 1


def test_a_replacement_does_not_outlive_its_case(results):
    r = results["plain"]
    assert r["verdict"] == "equivalent", r["summary"]
    assert "replacement" not in r["summary"], r["summary"]


def test_checker_mutant_through_the_users_all_reduce_ends_in_error(monkeypatch):
    """The mutant: tpcheck's own all-reduce looked up on torch.distributed at each call (the
    user's wrapper): the replica check's control is not flagged, verdict "error"."""
    import torch.distributed as dist

    monkeypatch.setattr(torch_collectives, "all_reduce", lambda *a, **k: dist.all_reduce(*a, **k))
    (r,) = check([spec("sum_wrapper")])
    assert r["verdict"] == "error", r["summary"]
    assert exit_code([r]) == 3


def test_checker_mutant_a_replacement_kept_leaks_into_the_next_case(monkeypatch):
    """The mutant: the collectives not put back after a case (`kept` a no-op). The averaging
    wrapper then acts on the next, correct case in the same rank processes: not equivalent."""
    import contextlib

    monkeypatch.setattr(torch_collectives, "kept", contextlib.nullcontext)
    _, after = check([spec("mean_wrapper"), spec("plain")])
    assert after["verdict"] == "not equivalent", after["summary"]
