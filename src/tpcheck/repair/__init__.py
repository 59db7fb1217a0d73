"""From a diagnosis to a verified fix: `tpcheck hf ARCH --repair` (a rule override of transformers'
plan, `repair.rule_override`) and `tpcheck verify CASEFILE --repair` (a missing all-reduce inserted
where a `partial_sum` diagnosis points, `repair.collective`). Every candidate is checked by the full
check with the run's own settings, in a rank pool of its own, and is the repair only when that check
says `equivalent`. The report's `repair` object holds one entry per failed case
(docs/report-schema.md); each repaired one is printed in the user's own terms (`repair.terms`),
and a run whose every failed case was repaired and verified exits `ExitCode.REPAIRED` (4).
"""

from __future__ import annotations

import sys

FAILED = ("not equivalent", "error")


def run_repairs(cases: list[dict], specs: list, kind: str, timeout: float, quiet: bool, **kw):
    """The report's `repair` object for the failed `cases` (report cases, checks kept) of `specs`
    (matched by name); `kind` "plan_rule" (HuggingFace) or "collective" (case files and built-in
    blocks). Prints each entry unless quiet."""
    from tpcheck import resolve
    from tpcheck.checker.pool.session import run_specs
    from tpcheck.repair import collective, rule_override

    by_name = {s.name: s for s in specs}
    failed = [r for r in cases if r["verdict"] in FAILED and r["name"] in by_name]
    entries: list[dict] = []
    # collective repairs register their Cases before the pool forks
    staged = [collective.prepare(r, by_name[r["name"]]) for r in failed if kind != "plan_rule"]
    if failed:
        with resolve.launcher(timeout) as pool:

            def run_one(spec) -> dict:
                return run_specs([spec], pool)[0].to_json()

            for n, r in enumerate(failed):
                spec = by_name[r["name"]]
                if kind == "plan_rule":
                    rules = dict(dict(spec.overrides).get("tp_plan", ()))
                    target = rule_override.Target(r, spec, rules)
                    budget = kw.get("budget", rule_override.DEFAULT_BUDGET)
                    entry = rule_override.repair_case(target, run_one, budget)
                else:
                    entry = collective.repair_case(staged[n], run_one)
                entries.append(entry)
                if not quiet:
                    _say(entry)
    repaired = sum(e["status"] == "repaired" for e in entries)
    in_float64 = sum(e["status"] == "verified_in_float64" for e in entries)
    summary = (
        f"{repaired} of {len(entries)} failed case(s) repaired and verified"
        + (
            f", {in_float64} verified in float64 only (rounding left near the bounds)"
            if in_float64
            else ""
        )
        if entries
        else "nothing to repair: every case checked is equivalent"
        if all(r["verdict"] == "equivalent" for r in cases)
        else "nothing to repair: no case is not equivalent or an error"
    )
    if not quiet:
        print(f"tpcheck: repair: {summary}", file=sys.stderr)
    return {"kind": kind, "entries": entries, "summary": summary}


def _say(entry: dict) -> None:
    from tpcheck.repair import terms

    plan_rule = entry["kind"] == "plan_rule"
    lines = (terms.plan_rule_lines if plan_rule else terms.collective_lines)(entry)
    print("\n".join(f"tpcheck: {line}" for line in lines), file=sys.stderr)
    patch = (terms.tp_plan_patch if plan_rule else terms.collective_patch)(entry)
    if patch:
        print(patch, file=sys.stderr)


def repaired_results(report: dict) -> list[dict]:
    """The verifying runs of the repaired cases (their report cases, checks left out), in order."""
    entries = (report.get("repair") or {}).get("entries") or ()
    return [e["verified"]["result"] for e in entries if e.get("status") == "repaired"]


def exit_code_after(report: dict, code: int) -> int:
    """`ExitCode.REPAIRED` where the run as given failed (1 or 3) and every case that did not go
    as expected was repaired, each repair verified by its own full check; else `code`."""
    from tpcheck.errors import ExitCode

    entries = (report.get("repair") or {}).get("entries") or ()
    if code not in (ExitCode.NOT_EQUIVALENT, ExitCode.ERROR) or not entries:
        return code
    repaired = {e["case"] for e in entries if e.get("status") == "repaired"}
    failed = {r["name"] for r in report["cases"] if not r["as_expected"]}
    return ExitCode.REPAIRED if failed and failed <= repaired else code
