"""The float64 run of a case (`RunSettings.float64_run`), merged into the case's result.

Most TP bugs are structural: a norm taken over the local shard of a sharded dimension, a partial
sum off by a few percent, a bias counted twice. They act in float64 as well as in bfloat16, but in
16 bits they can hide under the rounding that the bounds must allow (a 3% partial-sum error passes
bfloat16 at tp 2). So after the run in the working dtype, the same case runs again with the dtype
set to float64: the dense model is then the truth on every rank and every calibrated bound is
`FP64_FLOOR_ULPS` ulps (about 2e-10 relative, checker/rank/tolerance.py), so a bug that acts in
float64 is caught at that resolution whatever the training dtype. The working-dtype run stays for
the bugs that are precision-specific (an all-reduce in 16 bits, a missing float32 accumulation).

The two are merged here, in the parent: "not equivalent" if either run is, the summary saying
which ("... too: structural", "only in bfloat16: precision-specific", "only in the float64 run");
the first divergence and the diagnosis from the run that failed (the working one when both did;
a working `near_bound` diagnosis is then re-said: checker/verdict/diagnose.py `structural`). A
hang in the float64 run, or the checker failing its control there, wins as it would in one run.
A case that cannot run in float64 (its build raises, a module pinned to another dtype, a fault
declared for other dtypes) has its float64 run skipped with a note naming why, never an error of
the whole case: the verdict is then the working run's. `float64_spec` says which run follows;
checker/pool/session.py runs it, the one place every front end (the API, the CLI, the pytest
plugin, torchrun) goes through. The float64 run does not depend on the working dtype, so a
bfloat16 and a float16 case of one spec in one check share theirs: it runs once, and the second
case's record names the first (`same_as`).
"""

from __future__ import annotations

import dataclasses

from tpcheck.checker.case import CaseSpec
from tpcheck.checker.rank import rounding
from tpcheck.checker.verdict import code_path
from tpcheck.checker.verdict.diagnose import structural
from tpcheck.checker.verdict.result import CaseResult

FINISHED = ("equivalent", "not equivalent")


def float64_spec(spec: CaseSpec, result: CaseResult) -> CaseSpec | None:
    """The spec of the float64 run that follows `result` (the working run of `spec`), with the
    settings the ranks ran but the dtype; None when none follows (not wanted, or the working run
    did not finish: its error or hang is the verdict)."""
    if result.verdict not in FINISHED or not result.run.wants_float64_run:
        return None
    run = dataclasses.replace(result.run, dtype="float64", float64_run="off")
    return dataclasses.replace(spec, run=run)


def merge_float64(result: CaseResult, f64: CaseResult, same_as: str | None = None) -> CaseResult:
    """`result` (the working run) with its float64 run `f64` merged in (see the module docstring);
    `result` is changed and returned. `same_as`: the case that ran `f64` (the same float64 run,
    wanted by two cases of one check; its seconds are that case's)."""
    if same_as is None:
        result.seconds += f64.seconds
    if f64.verdict == "invalid" or (f64.verdict == "error" and f64.problems):
        return _skipped(result, _why_not(f64))
    result.float64_run = record(f64)
    if same_as is not None:
        result.float64_run["same_as"] = same_as
    if f64.verdict in FINISHED and f64.run.dtype != "float64":  # the ranks' own word on it
        return _failed(
            result,
            "error",
            f"the checker failed: its float64 run ran in {f64.run.dtype}; no verdict can be "
            "trusted (a bug in tpcheck: please report it with this case)",
        )
    if f64.verdict not in FINISHED:  # a hang, or the checker failed its control in float64
        result.hang, result.crash = f64.hang, f64.crash
        return _failed(result, f64.verdict, f"{f64.verdict} in the float64 run: {f64.summary}", f64)
    dtype, working = result.run.dtype, result.verdict == "not equivalent"
    if away := code_path.only_working(result.code_paths, f64.code_paths):
        result.notes = [*(result.notes or []), code_path.note(dtype, away)]
    if f64.verdict == "not equivalent" and working:
        _both_failed(result, f64)
    elif f64.verdict == "not equivalent":
        result.verdict = "not equivalent"
        result.first_divergence, result.diagnosis = f64.first_divergence, f64.diagnosis
        result.summary = (
            f"not equivalent only in the float64 run: a structural bug below {dtype}'s resolution "
            f"(the {dtype} run passed its {len(result.checks)} checks); {f64.summary}"
        )
    elif working and (away or _off_its_path(result)):
        result.summary += (
            f"; only in {dtype}, on a path the float64 run does not take (the notes say where): "
            f"not precision-specific, the float64 run's {len(f64.checks)} passed checks say "
            "nothing of it"
        )
    elif working:
        result.summary += (
            f"; only in {dtype}: precision-specific (the float64 run passed its "
            f"{len(f64.checks)} checks)"
        )
    else:
        result.summary += f"; the float64 run too: {len(f64.checks)} checks passed"
    result.as_expected = result.verdict == result.expected
    return result


def _off_its_path(result: CaseResult) -> bool:
    """Whether the dense model is not its own float64 twin somewhere in this case (the ranks'
    notes say from where: checker/rank/rounding.py): the float64 run then takes another path
    there, as where code ran in the working dtype only (code_path.py, read by the caller), and its
    pass does not make a failure of the working run precision-specific."""
    return any(n.startswith(rounding.OFF_PATH) for n in result.notes or ())


def _failed(result: CaseResult, verdict: str, summary: str, f64: CaseResult | None = None):
    """The case ends in `verdict` ("hang" or "error") because of its float64 run: its problems
    (those of the float64 run, else one naming the failure)."""
    result.verdict, result.summary = verdict, summary
    result.as_expected = verdict == "hang" and result.spec.expected_verdict == "hang"
    problems = f64.problems if f64 is not None else None
    result.problems = problems or [{"status": "error", "rank": 0, "message": summary}]
    return result


def _both_failed(result: CaseResult, f64: CaseResult) -> None:
    """Both runs failed: the working run's first divergence and diagnosis, said to be structural
    (a `near_bound` diagnosis re-said: the float64 run shows the bug is no tolerance question)."""
    f = f64.first_divergence
    old = result.diagnosis
    result.diagnosis = structural(result.first_divergence, old, f, f64.diagnosis)
    if result.diagnosis is not old:
        result.summary = result.summary.replace(
            f"{old.signature}: {old.cause}",
            f"{result.diagnosis.signature}: {result.diagnosis.cause}",
        )
    result.summary += (
        f"; not equivalent in the float64 run too: structural (first there: {f.name} "
        f"({f.stage}, step {f.step}), {f64.diagnosis.signature})"
    )


def _skipped(result: CaseResult, why: str) -> CaseResult:
    """The float64 run could not run: said in `float64_run`, the notes and the summary."""
    note = f"the float64 run: {why}"
    result.float64_run = {"skipped": why}
    result.notes = [*(result.notes or ()), note]
    result.summary += f"; not checked: {note}"
    return result


def _why_not(f64: CaseResult) -> str:
    """Why the float64 run did not run: the first line of its primary problem's message."""
    message = f64.summary.removeprefix("invalid: ").splitlines()[0]
    return f"skipped, the case does not run in float64 ({message})"


def record(f64: CaseResult) -> dict:
    """The report's `float64_run` of a float64 run that ran (docs/report-schema.md)."""
    out = {
        "verdict": f64.verdict,
        "summary": f64.summary,
        "first_divergence": (
            f64.first_divergence.to_json() if f64.first_divergence is not None else None
        ),
        "diagnosis": f64.diagnosis.to_json() if f64.diagnosis is not None else None,
        "self_test": f64.self_test.to_json() if f64.self_test is not None else None,
        "seconds": f64.seconds,
    }
    if f64.checks is not None:
        out["checks"] = len(f64.checks)
    return out
