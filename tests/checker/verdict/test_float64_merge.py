"""`merge_float64` on made-up results, without processes: which run's verdict wins, what is said,
and when the float64 run is skipped (checker/verdict/float64_run.py)."""

import dataclasses

from tpcheck.checker.case import CaseSpec
from tpcheck.checker.settings import RunSettings
from tpcheck.checker.verdict.divergence import SelfTest
from tpcheck.checker.verdict.float64_run import float64_spec, merge_float64
from tpcheck.checker.verdict.result import CaseResult

BF16 = RunSettings(dtype="bfloat16")
F64 = dataclasses.replace(BF16, dtype="float64", float64_run="off")
SPEC = CaseSpec(block="mlp", world_size=2, run=BF16)


def result(verdict="equivalent", run=BF16, **kw) -> CaseResult:
    finished = verdict in ("equivalent", "not equivalent")
    fields = dict(
        spec=SPEC,
        run=run,
        verdict=verdict,
        as_expected=verdict == "equivalent",
        summary=f"{verdict}: something",
        seconds=1.0,
        checks=[] if finished else None,
        self_test=SelfTest(controls=2, flagged=2) if finished else None,
    )
    return CaseResult(**{**fields, **kw})


def test_the_float64_spec_keeps_every_setting_but_the_dtype():
    follow = float64_spec(SPEC, result())
    assert follow.run == F64 and dataclasses.replace(follow, run=BF16) == SPEC
    assert float64_spec(SPEC, result(run=RunSettings(dtype="float32"))) is None
    assert float64_spec(SPEC, result("hang", problems=[{}])) is None  # the hang is the verdict


def test_a_float64_run_that_cannot_run_is_a_note_not_the_verdict():
    for f64 in (
        result("invalid", run=F64, summary="invalid: fault 'x' applies to ['float32']"),
        result("error", run=F64, summary="error: rank 0: RuntimeError: dtype", problems=[{}]),
    ):
        r = merge_float64(result(), f64)
        assert r.verdict == "equivalent" and r.as_expected, r.summary
        assert r.float64_run["skipped"].startswith("skipped, the case does not run in float64 (")
        assert r.notes == [f"the float64 run: {r.float64_run['skipped']}"]
        assert r.seconds == 2.0


def test_a_hang_or_a_failed_control_in_the_float64_run_wins():
    hang = result("hang", run=F64, problems=[{"status": "hang", "rank": 1, "message": "m"}])
    r = merge_float64(result(), hang)
    assert (r.verdict, r.as_expected) == ("hang", False) and r.problems == hang.problems
    assert r.summary.startswith("hang in the float64 run: ")
    control = result("error", run=F64, checks=[], summary="the checker failed its control")
    r = merge_float64(result(), control)
    assert r.verdict == "error" and r.problems and "float64 run" in r.summary


def test_a_float64_run_that_ran_in_another_dtype_is_an_error():
    r = merge_float64(result(), result(run=BF16))
    assert r.verdict == "error" and "its float64 run ran in bfloat16" in r.summary
