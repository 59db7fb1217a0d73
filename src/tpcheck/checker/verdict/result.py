"""Typed results, from a rank to the report: a `RankPayload` per rank and case, merged into one
`CaseResult` with a verdict, its checks `Check` records to the end; `CaseResult.to_json()` is what
the report and the Python API see, made at their edge (api.py, the CLI, the pytest plugin), and
`CaseResult.from_json` reads a report's case back (`tpcheck report`, the tests).

Verdicts: "equivalent" (every check on every rank passed), "not equivalent" (some check failed),
"hang" (a collective wait timed out: some ranks issued a collective the others did not),
"error" (a rank raised or died), "invalid" (the input was wrong: a usage error).

Expectation: a case with an injected fault is expected to be "not equivalent" (or a hang, for a
fault whose signature is one: `CaseSpec.expected`), any other case "equivalent". `as_expected` says
whether it was; the process exit code follows from it (`exit_code`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tpcheck.checker.case import CaseSpec
from tpcheck.checker.checkid import CheckId
from tpcheck.checker.payload import Check, RankPayload
from tpcheck.checker.rank import tolerance
from tpcheck.checker.settings import RunSettings
from tpcheck.checker.verdict.collectives import check_ledger
from tpcheck.checker.verdict.diagnose import diagnose
from tpcheck.checker.verdict.divergence import (
    Diagnosis,
    FirstDivergence,
    SelfTest,
    first_divergence,
)
from tpcheck.checker.verdict.failures import failure_fields
from tpcheck.checker.verdict.selftest import (
    failing,
    missing_warmup,
    read_failures,
    self_test,
)
from tpcheck.checker.vocabulary import Verdict
from tpcheck.errors import ExitCode
from tpcheck.findings import finding_for


@dataclass
class CaseResult:
    """One case, merged over its ranks. `to_json()` gives
    the report's case object (report-schema.md)."""

    spec: CaseSpec
    run: RunSettings  # the settings the ranks ran (the spec's when no rank built the case)
    verdict: Verdict
    as_expected: bool
    summary: str
    seconds: float
    checks: list[Check] | None = None  # every rank's, judged (`passed`), the controls apart
    ledger: dict | None = None
    self_test: SelfTest | None = None
    first_divergence: FirstDivergence | None = None
    diagnosis: Diagnosis | None = None
    problems: list[dict] | None = None
    hang: dict | None = None
    crash: dict | None = None
    inferred_plan: str | None = None
    notes: list[str] | None = None  # what was not checked, and why (every rank's, once each)
    forward_only: dict | None = None  # checked forward only: why, decode passes, notes
    activations: dict | None = None  # written / inferred / not_checked / no_placement (discover.py)
    # the case's float64 run, merged into this one (float64_run.py): its verdict, summary, ... or
    # {"skipped": why}; None when none was wanted
    float64_run: dict | None = None
    # rank 0's lines of code each side's first forward ran (RankPayload.code_paths); not reported:
    # the float64 run's merge reads them (checker/verdict/code_path.py)
    code_paths: dict | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def expected(self) -> Verdict:
        return "equivalent" if self.spec.expected_verdict == "equivalent" else "not equivalent"

    def to_json(self) -> dict:
        held_to_float64_run(self)
        out = {
            "name": self.name,
            "spec": spec_json(self.spec, self.run),
            "world_size": self.spec.world_size,
            "dtype": self.run.dtype,
            "expected": self.expected,
            "seconds": self.seconds,
            "verdict": self.verdict,
            "as_expected": self.as_expected,
            "summary": self.summary,
            "first_divergence": (
                self.first_divergence.to_json() if self.first_divergence is not None else None
            ),
        }
        if self.checks is not None:
            out["checks"] = [check_json(c) for c in self.checks]
        for key in (
            "ledger",
            "diagnosis",
            "problems",
            "hang",
            "crash",
            "inferred_plan",
            "forward_only",
            "notes",
            "activations",
            "float64_run",
        ):
            if getattr(self, key) is not None:
                out[key] = _json(getattr(self, key))
        if self.checks is not None:
            out["self_test"] = _json(self.self_test)
            out["diagnosis"] = _json(self.diagnosis)
        if finding := finding_for(out.get("diagnosis")):
            out["finding"] = finding
        return out

    @classmethod
    def from_json(cls, case: dict) -> CaseResult:
        """A report's case object read back (`to_json`'s inverse, for `tpcheck report` and the
        tests). Keys a report may carry besides (an HF sweep's `checks_omitted`) are not kept."""
        spec_fields = {f.name for f in dataclasses.fields(CaseSpec)} - {"run"}
        given = case["spec"]
        run = RunSettings(
            **{k: given[k] for k in (f.name for f in dataclasses.fields(RunSettings)) if k in given}
        )
        spec = CaseSpec(
            run=run,
            **{k: _frozen(v) for k, v in given.items() if k in spec_fields and k != "overrides"},
            overrides=tuple((k, _frozen(v)) for k, v in (given.get("overrides") or {}).items()),
        )
        checks = None if "checks" not in case else [check_from_json(c) for c in case["checks"]]
        first = case.get("first_divergence")
        return cls(
            spec=spec,
            run=run,
            verdict=case["verdict"],
            as_expected=case["as_expected"],
            summary=case["summary"],
            seconds=case["seconds"],
            checks=checks,
            first_divergence=FirstDivergence.from_json(first) if first is not None else None,
            self_test=SelfTest.from_json(case["self_test"]) if case.get("self_test") else None,
            diagnosis=Diagnosis.from_json(case["diagnosis"]) if case.get("diagnosis") else None,
            **{
                k: case.get(k)
                for k in (
                    "ledger",
                    "problems",
                    "hang",
                    "crash",
                    "inferred_plan",
                    "notes",
                    "forward_only",
                    "activations",
                    "float64_run",
                )
            },
        )


def held_to_float64_run(result: CaseResult) -> CaseResult:
    """A case held, where every front end reads it (`to_json`), to the float64 run its settings
    want, apart from the merge that brings it in (float64_run.py): "equivalent" only with that run
    recorded and passed, or skipped with why; else the case ends in "error" (`control_failed`)."""
    wanted = result.verdict == "equivalent" and result.run.wants_float64_run
    if not wanted or result.self_test is None:
        return result
    record = result.float64_run
    if record is not None and ("skipped" in record or record.get("verdict") == "equivalent"):
        return result
    said = "none was recorded" if record is None else f"it ended in {record.get('verdict')!r}"
    result.self_test.failures.append(
        f"the case reads equivalent but the float64 run its {result.run.dtype} settings want did "
        f"not pass: {said}"
    )
    return control_failed(result)


def _frozen(value):
    """A JSON value as the CaseSpec held it: lists back to tuples (a spec is hashable)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def check_json(check: Check) -> dict:
    """A check as the report holds it: every field but `control` (the report lists no control) and
    `loaded_by` where nothing but tpcheck loaded the tensor."""
    # flat (asdict's deep copy is slow); the identity rendered as the report's name, in its place
    out = {("name" if k == "id" else k): v for k, v in vars(check).items()}
    out["name"] = str(check.id)
    del out["planted"], out["blind"]
    del out["bin_errors"], out["bins"]  # judged: the worst bin's figures are kept
    for key in ("magnitude", "scale"):
        if out[key] is None:
            del out[key]
    if out["loaded_by"] is None:
        del out["loaded_by"]
    return out


SPEC_KEYS = (
    "block",
    "preset",
    "world_size",
    "dtype",
    "steps",
    "optimizer",
    "lr",
    "micro_batches",
    "sequence_parallel",
    "fault",
    "seed",
    "overrides",
    "capture",
    "master_weights",
    "train",
    "warmup",
    "float64_run",
    "label",
    "expected",
    "device",
)


def _json(value):
    """A record's JSON object (its `to_json()`); a plain value as it is."""
    return value.to_json() if hasattr(value, "to_json") else value


def check_from_json(c: dict) -> Check:
    """A report's check read back (`check_json`'s inverse): its name parsed to the identity."""
    given = {k: v for k, v in c.items() if k in CHECK_FIELDS}
    return Check(id=CheckId.parse(c["name"]), **given)


CHECK_FIELDS = {f.name for f in dataclasses.fields(Check)} - {"id"}


def spec_json(spec: CaseSpec, run: RunSettings) -> dict:
    """The report's "spec": the CaseSpec with the run settings that ran, flat (report-schema.md)."""
    d = {**asdict(spec), **asdict(run), "overrides": dict(spec.overrides)}
    return {k: d[k] for k in SPEC_KEYS}


def merge(spec: CaseSpec, payloads: list[RankPayload]) -> CaseResult:
    """One CaseResult from every rank's payload: bounds filled in, every check judged here (one
    rule, `judge`), the controls (the self-test) held to having failed, then the verdict."""
    seconds = max((p.seconds for p in payloads), default=0.0)
    run = next((p.run for p in payloads if p.run is not None), spec.settings)
    if any(p.status != "ok" for p in payloads):  # a hang, a crash or bad input: see failures.py
        return CaseResult(spec=spec, run=run, seconds=seconds, **failure_fields(spec, payloads))
    every = [copy.copy(c) for p in payloads for c in p.checks]  # the ranks' records stay as sent
    if unbounded := _fill_bounds(every):
        return _no_bound(spec, run, seconds, unbounded)
    # what each control was judged by, read before `judge` keeps one bin of it (the self-test's)
    read = {id(c): judged_error(c) for c in every if c.control}
    for c in every:
        c.passed = judge(c)
    checks = [c for c in every if not c.control]
    reading = read_failures(failing(every))  # the verdict's, and the self-test's: one reading
    failed = reading.failed
    entries = [asdict(e) for p in payloads for e in p.ledger]
    evidence = [p.evidence for p in payloads]
    forward_only = payloads[0].forward_only
    # per step, as the ledger counts micro-batches: the forward passes, no backward or optimizer
    expected, per_step = payloads[0].expected_collectives, run.micro_batches
    if forward_only is not None:
        per_step = 1 + forward_only["decode_steps"]
        expected = expected and tuple(e for e in expected if e[0] == "forward")
    result = CaseResult(
        spec=spec,
        run=run,
        verdict=reading.verdict,
        as_expected=False,
        summary="",
        seconds=seconds,
        checks=checks,
        ledger=check_ledger(entries, expected, spec.world_size, run.steps, per_step),
        self_test=self_test(
            checks,
            [c for c in every if c.control],
            evidence,
            reading,
            [(p.rank, p.manifest) for p in payloads],
            read,
        ),
        inferred_plan=payloads[0].inferred_plan,
        notes=list(dict.fromkeys(n for p in payloads for n in p.notes)) or None,
        forward_only=forward_only,
        activations=payloads[0].activations,
        code_paths=payloads[0].code_paths,
    )
    result.self_test.failures += missing_warmup(payloads, run.warmup)
    result.as_expected = result.verdict == result.expected
    if result.self_test.failures:
        return control_failed(result)
    if failed:
        result.first_divergence = first_divergence(failed, checks)
        micro = 1 if forward_only is not None else run.micro_batches  # forward only: one pass
        ops = payloads[0].shard_ops  # the reductions and splits that ran on a shard
        result.diagnosis = diagnose(result.first_divergence, evidence, spec.world_size, micro, ops)
    result.summary = _summary(result, failed)
    return result


def _no_bound(spec: CaseSpec, run: RunSettings, seconds: float, unbounded: list[Check]):
    """A case whose checks on some rank got no bound from rank 0: the checker failed, no verdict."""
    c = unbounded[0]
    return CaseResult(
        spec=spec,
        run=run,
        verdict="error",
        as_expected=False,
        seconds=seconds,
        summary=f"the checker failed: no bound from rank 0 for {c.name} ({c.stage}, step "
        f"{c.step}) on rank {c.rank}, {len(unbounded)} check(s) in all; no verdict can "
        "be trusted (a bug in tpcheck: please report it with this case)",
    )


def judged_error(check: Check) -> float:
    """The error `judge` reads of `check`, over every bin where it is judged by magnitude."""
    if check.bins is not None and check.bin_errors is not None:
        return max(check.bin_errors)
    return check.error


def judge(check: Check) -> bool:
    """A check passes when its error is within its bound (a NaN error never passes); one judged by
    magnitude (tolerance.py) when every bin's error is within that bin's bound: its error and bound
    are then the worst bin's."""
    if check.bins is not None and check.bin_errors is not None:
        _worst_bin(check)
    return check.error <= check.bound


def _worst_bin(check: Check) -> None:
    """The figures of the bin whose error is the largest share of its bound become the check's
    (the bins are dropped: judged once); `magnitude` names the bin where it is not the top one."""
    k = tolerance.worst_bin(check.bin_errors, check.bins)
    bound, ref_error, floor, magnitude = check.bins[k]
    check.error, check.bound, check.ref_error, check.floor = (
        check.bin_errors[k],
        bound,
        ref_error,
        floor,
    )
    if k > 0:
        check.magnitude = magnitude
        check.reason = (
            f"{tolerance.MAX_FACTOR:g} x the dense error vs float64 ({ref_error:.3g}) over the "
            f"rows whose largest |dense| is at most {magnitude:.3g} + {tolerance.FLOOR_ULPS} "
            f"ulp(s) of it: judged by magnitude, the tensor's largest row being wider "
            f"({check.reason})"
        )
    check.bin_errors = check.bins = None


def control_failed(result: CaseResult) -> CaseResult:
    """`result` ends in "error": the checker failed its control (`self_test.failures`)."""
    result.verdict, result.as_expected = "error", False
    result.summary = (
        f"the checker failed its control: {result.self_test.failures[0]}; no verdict can be "
        "trusted (a bug in tpcheck: please report it with this case)"
    )
    return result


def _fill_bounds(checks: list[Check]) -> list[Check]:
    """Calibrated checks on ranks > 0 take the bound rank 0 computed for the same tensor: the same
    (stage, step, name, control), the same occurrence of it (a name recurs once per micro-batch), a
    calibrated one (never an exact check rank 0 made of the same name: AppliedOnRank's zero
    gradient). Keyed by tensor, not by position, so a rank that compares fewer tensors
    (AppliedOnRank) still matches. Returns the checks left without a bound (none, unless the
    checker is broken)."""

    def keyed(rank_checks):
        seen: dict[tuple, int] = {}
        for c in rank_checks:
            key = (c.stage, c.step, c.id)
            seen[key] = seen.get(key, -1) + 1
            yield (*key, seen[key]), c

    rank0 = dict(keyed(c for c in checks if c.rank == 0 and c.stage != "replicas"))
    by_rank: dict[int, list[Check]] = {}
    for c in checks:
        if c.stage != "replicas":
            by_rank.setdefault(c.rank, []).append(c)
    missing = []
    for rank_checks in by_rank.values():
        for key, c in keyed(rank_checks):
            if c.bound is None:
                ref = rank0.get(key)
                if ref is None or ref.bound is None or ref.kind == "exact":
                    missing.append(c)
                    continue
                c.bound, c.reason, c.kind, c.ref_error, c.floor, c.bins, c.scale = (
                    ref.bound,
                    ref.reason,
                    ref.kind,
                    ref.ref_error,
                    ref.floor,
                    ref.bins,
                    ref.scale,
                )
                c.blind = c.blind or ref.blind  # a control: rank 0 measured the dense error
    return missing


def forward_only_note(forward_only: dict | None) -> str:
    """The summary's word on a case checked forward only ("" for one that trained)."""
    if forward_only is None:
        return ""
    decode = forward_only["decode_steps"]
    passes = f", a prefill and {decode} decode step(s) per step" if decode else ""
    notes = "".join(f"; {n}" for n in forward_only["notes"])
    return f"; forward only: {forward_only['reason']}{passes}{notes}"


def _summary(result: CaseResult, failed: list[Check]) -> str:
    notes = "".join(f"; not checked: {n}" for n in result.notes or ())
    return _verdict_summary(result, failed) + forward_only_note(result.forward_only) + notes


def _verdict_summary(result: CaseResult, failed: list[Check]) -> str:
    if not failed:
        return f"equivalent: {len(result.checks)} checks passed on {result.spec.world_size} rank(s)"
    f, d = result.first_divergence, result.diagnosis
    loaded_by = f" (as loaded by {failed[0].loaded_by})" if failed[0].loaded_by else ""
    if f.kind == "layout":  # no numbers to say: the output is not comparable
        return (
            f"not equivalent: {len(failed)} of {len(result.checks)} checks failed; first: "
            f"{f.name} ({f.stage}, step {f.step}) on rank(s) {f.ranks}: "
            f"{d.signature}: {d.cause}"
        )
    return (
        f"not equivalent: {len(failed)} of {len(result.checks)} checks failed; first: {f.name} "
        f"({f.stage}, step {f.step}) on rank(s) {f.ranks}: error {f.error:.3g} > bound "
        f"{f.bound:.3g}; {d.signature}: {d.cause}{loaded_by}"
    )


def exit_code(results: Sequence[dict]) -> int:
    """The one exit-code rule: 2 if any case was invalid (bad input: the user's to fix first), else
    3 if any errored (a rank raised or died, or the checker failed its control), else 1 if any case
    did not go as expected, else 0."""
    if any(r["verdict"] == "invalid" for r in results):
        return ExitCode.USAGE
    if any(r["verdict"] == "error" for r in results):
        return ExitCode.ERROR
    if not all(r["as_expected"] for r in results):
        return ExitCode.NOT_EQUIVALENT
    return ExitCode.EQUIVALENT
