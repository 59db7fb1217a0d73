"""From a diagnosis to a verified fix: `tpcheck hf ARCH --repair` (a rule override of transformers'
plan, `repair.rule_override`) and `tpcheck verify CASEFILE --repair` (a missing all-reduce inserted
where a `partial_sum` diagnosis points, `repair.collective`). Every candidate is checked by the full
check with the run's own settings, in a rank pool of its own, and is the repair only when that check
says `equivalent`. The report's `repair` object holds one entry per failed case
(docs/report-schema.md).
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
                    repair = rule_override if kind == "plan_rule" else collective
                    lines = repair.entry_lines(entry)
                    print("\n".join(f"tpcheck: {line}" for line in lines), file=sys.stderr)
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
