"""Threads a case starts on its ranks (checker/rank/case_threads.py). A loader thread drawing from
torch's default generator beside the dense pass: the case is refused naming that thread (at its
line) and the fix, not the model ("drew random numbers other than through the calls tpcheck
replays"). A thread that draws nothing: the case is checked, and the report says the thread still
ran at its end. Either way the next case runs in new rank processes: a dropout case after the
loader thread is equivalent."""

import pytest

from tpcheck import check, exit_code
from tpcheck.checker.casefile import file_spec

from paths import REPO

FILE = REPO / "tests" / "checker" / "rank" / "case_files" / "user_threads.py"


@pytest.fixture(scope="module")
def results():
    names = ("loader_thread", "dropout", "watchdog_thread")
    return dict(zip(names, check([file_spec(f"{FILE}:{n}", 2) for n in names])))


def test_a_thread_drawing_from_the_global_rng_is_named_not_the_model(results):
    r = results["loader_thread"]
    assert r["verdict"] == "invalid", r["summary"]
    assert "thread(s) your code started ran beside it: 'prefetch' (prefetch, " in r["summary"]
    assert "user_threads.py:" in r["summary"] and "generator=g" in r["summary"], r["summary"]
    assert exit_code([r]) == 2


def test_the_next_case_does_not_run_beside_the_thread(results):
    r = results["dropout"]
    assert r["verdict"] == "equivalent", r["summary"]
    assert "thread" not in r["summary"], r["summary"]


def test_a_thread_that_draws_nothing_is_said_in_the_notes(results):
    r = results["watchdog_thread"]
    assert r["verdict"] == "equivalent", r["summary"]
    assert "'watchdog' (watchdog, " in r["summary"] and "still ran at the end" in r["summary"]
