"""One case's section of the HTML report: its summary line, what it could not check, its
diagnosis and first divergence, problems, per-step curves, failed checks, RNG placements, the plan
inferred, the collective ledger per phase and rank, and the report keys not shown elsewhere."""

from __future__ import annotations

import json

from tpcheck.checker.checkid import CheckId
from tpcheck.checker.vocabulary import LEDGER_PHASES, WARMUP
from tpcheck.report.float64 import float64_line
from tpcheck.report.html_parts import (
    KNOWN_CASE_KEYS,
    MAX_FAILED_ROWS,
    MAX_FAILED_ROWS_MANY,
    NONE,
    _dl,
    _mark,
    _omitted,
    _table,
    _verdict,
    esc,
)
from tpcheck.report.module_outputs import counts, module_outputs_code


def _case_section(i: int, case: dict, curves: bool = True, many: bool = False) -> str:
    """One case's section; `curves`: its per-step curves drawn (a page draws at most a few).
    In a report of `many` cases, a case that went as expected gets a brief section (its verdict,
    notes and problems, without the inferred plan, the ledger's table and the other keys), and a
    failed one lists fewer of its failed checks."""
    brief = many and bool(case.get("as_expected"))
    parts = [
        f"<section class=case id='case-{i}'><h3>{esc(case['name'])} {_verdict(case['verdict'])} "
        f"{_mark(case)}</h3><p>{esc(case.get('summary', ''))}</p>"
        f"<p class=muted>expected: {esc(case['expected'])} · spec: "
        f"<code>{esc(_spec_text(case))}</code></p>"
    ]
    if _omitted(case):
        parts.append(
            f"<p class=note>Checks: {_omitted(case)} passed, not stored (left out of the report; "
            f"{len(case.get('checks', []))} stored).</p>"
        )
    if brief:
        parts += [_forward_only(case), _float64_run(case), _notes(case), _problems(case)]
        parts.append(
            "<p class=muted>As expected; its inferred plan, collective ledger and self-test are "
            "in the JSON report (<code>--json</code>), and in this page when it is checked "
            "alone.</p></section>"
        )
        return "\n".join(p for p in parts if p)
    parts += [
        _forward_only(case),
        _float64_run(case),
        _notes(case),
        _diagnosis(case),
        _first_divergence(case),
        _problems(case),
        _curves(case) if curves else _curves_left_out(case),
        _failed_checks(case, MAX_FAILED_ROWS_MANY if many else MAX_FAILED_ROWS),
        _rng(case),
        _inferred_plan(case),
        _ledger(case),
        _extras(case),
        "</section>",
    ]
    return "\n".join(p for p in parts if p)


def _forward_only(case: dict) -> str:
    """A case checked forward only: why, its decode passes, its notes, and what was not checked."""
    fo = case.get("forward_only")
    if not fo:
        return ""
    decode = (
        f"; each step a prefill and {fo['decode_steps']} decode step(s) through the model's own "
        "cache (checks named <code>...:decodeK</code>)"
        if fo["decode_steps"]
        else ""
    )
    notes = "".join(f"<br>Note: {esc(n)}" for n in fo["notes"])
    return (
        f"<p class=note>Forward only: {esc(fo['reason'])}{decode}. No backward, gradient or "
        f"optimizer checks.{notes}</p>"
    )


def _float64_run(case: dict) -> str:
    """The case's float64 run in a line (docs/tolerances.md#the-float64-run)."""
    line = float64_line(case)
    return f"<p class=note>{esc(line)}</p>" if line else ""


def _notes(case: dict) -> str:
    """What the case could not check, and why (an optimizer that keeps its state elsewhere)."""
    notes = case.get("notes") or []
    return "".join(f"<p class=note>Not checked: {esc(n)}</p>" for n in notes)


def _spec_text(case: dict) -> str:
    spec = case.get("spec") or {}
    return " ".join(f"{k}={v}" for k, v in spec.items() if v not in (None, "", {}, False))


def _diagnosis(case: dict) -> str:
    d = case.get("diagnosis")
    if not d:
        return ""
    keys = ["signature", "cause", "location", "stage", "step", "ranks"]
    items = [(k, d[k]) for k in keys if d.get(k) is not None]
    items += [
        (k, v if isinstance(v, str) else json.dumps(v, sort_keys=True))
        for k, v in sorted(d.items())
        if k not in keys and v is not None
    ]
    return "<h4>Diagnosis</h4>" + _dl(items)


def _first_divergence(case: dict) -> str:
    f = case.get("first_divergence")
    if not f:
        return ""
    items = [
        ("tensor", f["name"]),
        ("stage", f["stage"]),
        ("step", f["step"]),
        ("ranks", f["ranks"]),
        ("error", f"{f['error']:.4g}{_raw(f)}"),
        ("bound", f"{f['bound']:.4g} ({f['kind']})"),
    ]
    return "<h4>First divergent tensor</h4>" + _dl(items)


def _problems(case: dict) -> str:
    rows, shown = [], {}  # a traceback shown once: ranks that raised alike say which rank's it is
    for p in case.get("problems", []):
        last = p.get("last_collective")
        where = f"{last[0]} at {last[1]} ({last[2]})" if last else ""
        tb = p.get("traceback") or ""
        if tb in shown:
            tb = f"<p class=muted>traceback: the same as rank {esc(shown[tb])}'s</p>"
        elif tb:
            shown[tb] = p.get("rank")
            tb = f"<details><summary>traceback</summary><pre>{esc(tb)}</pre></details>"
        rows.append(
            f"<tr><td class=num>{esc(p.get('rank'))}</td><td>{esc(p.get('status'))}</td>"
            f"<td>{esc(where)}</td><td>{esc(p.get('message', ''))}{tb}</td></tr>"
        )
    if not rows:
        return ""
    return "<h4>Rank problems</h4>" + _table(
        "<tr><th>rank</th><th>status</th><th>last collective</th><th>message</th></tr>"
        + "".join(rows)
    )


def _curves(case: dict) -> str:
    """error / bound per step, for the tensors whose figure moved over the steps (none: no plot)."""
    if not _several_steps(case):
        return ""
    from tpcheck.report import plots

    if not plots.step_curves(case):
        return ""

    return (
        f"<h4>Error / bound per step</h4><img class=curves alt='error over bound per step for "
        f"{esc(case['name'])}' src='{plots.curves_png(case)}'>"
    )


def _several_steps(case: dict) -> bool:
    return max((c["step"] for c in case.get("checks", [])), default=0) >= 2


def _curves_left_out(case: dict) -> str:
    if not _several_steps(case):
        return ""
    return (
        "<p class=muted>Per-step curves: drawn for the first cases not as expected of a report "
        "with many cases; check this case alone to see its own.</p>"
    )


def _raw(c: dict) -> str:
    """The raw |TP - dense| beside a figure an allowance relaxed."""
    return f" (raw {c['raw_error']:.3g})" if c.get("raw_error") is not None else ""


def _failed_checks(case: dict, limit: int = MAX_FAILED_ROWS) -> str:
    failed = sorted(
        (c for c in case.get("checks", []) if not c["passed"]),
        key=lambda c: (c["step"], c["seq"], c["rank"]),
    )
    if not failed:
        return ""
    rows = "".join(
        f"<tr><td>{esc(c['stage'])}</td><td class=num>{c['step']}</td><td>{esc(c['name'])}</td>"
        f"<td class=num>{c['rank']}</td><td class=num>{c['error']:.3g}{_raw(c)}</td><td "
        f"class=num>{c['bound']:.3g}</td><td>{esc(c['kind'])}</td>"
        f"<td>{esc(c['placement'])}</td></tr>"
        for c in failed[:limit]
    )
    more = (
        f"<p class=muted>… and {len(failed) - limit} more in the JSON report.</p>"
        if len(failed) > limit
        else ""
    )
    return (
        f"<details><summary>Failed checks ({len(failed)})</summary>"
        + _table(
            "<tr><th>stage</th><th>step</th><th>tensor</th><th>rank</th><th>error</th>"
            "<th>bound</th><th>kind</th><th>placement</th></tr>" + rows
        )
        + more
        + "</details>"
    )


def _rng(case: dict) -> str:
    """The RNG placement checks (dropout masks), one row per draw site: its region's rule (the
    placement of its mask), how many times it was checked over steps and ranks,
    and how many failed."""
    sites: dict[str, dict] = {}
    for c in case.get("checks", []):
        if c["kind"] != "rng":
            continue
        site = sites.setdefault(
            CheckId.parse(c["name"]).target,
            {"placement": c["placement"], "reason": c["reason"], "checked": 0, "failed": 0},
        )
        site["checked"] += 1
        site["failed"] += not c["passed"]
    if not sites:
        return ""
    rows = "".join(
        f"<tr><td>{esc(name)}</td><td>{esc(s['placement'])}</td><td>{esc(s['reason'])}</td>"
        f"<td class=num>{s['checked']}</td><td "
        f"class='num{' off' if s['failed'] else ''}'>{s['failed']}</td></tr>"
        for name, s in sites.items()
    )
    return "<h4>Random masks (RNG placement)</h4>" + _table(
        "<tr><th>draw</th><th>mask placement</th><th>rule</th><th>checks</th><th>failed</th></tr>"
        + rows,
        " class=rng",
    )


def _inferred_plan(case: dict) -> str:
    """A case with no plan written: the plan tpcheck inferred (parameters, the module outputs it
    checked and how, those it did not and why), as the code to paste into the case file; with a
    plan written, its module outputs: the placements written, those inferred where it is silent,
    those not checked and why."""
    plan = case.get("inferred_plan")
    if not plan and (record := case.get("activations")):
        return (
            f"<h4>Module outputs (plan written; {esc(counts(record))})</h4>"
            f"<pre class=plan>{esc(module_outputs_code(record))}</pre>"
        )
    if not plan:
        return ""
    skipped = plan.count("\n# not checked: ")
    return (
        f"<h4>Plan inferred (no plan written; {skipped} module output(s) not checked, said "
        f"why)</h4><pre class=plan>{esc(plan)}</pre>"
    )


def ledger_rows(ledger: dict) -> tuple[list[str], list[tuple[str, str]], dict, dict]:
    """From the case's ledger ({expected, per_rank, problems}, see checker/rank/ledger.py): ranks,
    rows (phase, op) in phase order, expected {(phase, op): (count, sites)} per step, per-rank cells
    {(phase, op, rank): {"count", "bytes"}}."""
    per_rank = ledger.get("per_rank") or {}
    ranks = sorted(per_rank, key=int)
    cells = {
        (phase, op, r): v
        for r in ranks
        for phase, ops in per_rank[r].items()
        for op, v in ops.items()
    }
    expected: dict = {}
    for e in ledger.get("expected") or []:
        count, sites = expected.get((e["phase"], e["op"]), (0, []))
        expected[(e["phase"], e["op"])] = (count + e["count"], sites + [e["site"]])
    order = {p: i for i, p in enumerate(LEDGER_PHASES)}
    keys = {(phase, op) for phase, op, _ in cells} | set(expected)
    rows = sorted(keys, key=lambda k: (order.get(k[0], len(order)), k))
    return ranks, rows, expected, cells


def _ledger(case: dict) -> str:
    """Per phase and op, the collectives each rank issued (over all steps) beside those expected.
    With an expectation (a built-in block), a count that differs from it is marked; with none (user
    code: the "collective ledger of user code"), the expected columns say "—" and what is marked is
    what differs between ranks: a count not the same on every rank, a phase with no collective on
    some rank. A byte count not recorded says "—"."""
    ledger = case.get("ledger")
    if not isinstance(ledger, dict):
        return ""
    ranks, rows, expected, cells = ledger_rows(ledger)
    if not rows:
        return "<h4>Collective ledger</h4><p class=muted>No collective was issued or expected.</p>"
    given = bool(ledger.get("expected"))
    head = "".join(f"<th>rank {esc(r)}: count</th><th>rank {esc(r)}: bytes</th>" for r in ranks)
    body, asymmetric = [], []
    for phase, op in rows:
        want, sites = expected.get((phase, op), (0, []))
        got = {r: cells.get((phase, op, r), {"count": 0}) for r in ranks}
        differ = len({g.get("count", 0) for g in got.values()}) > 1
        if differ:
            counts = ", ".join(f"rank {r}: {got[r].get('count', 0)}" for r in ranks)
            asymmetric.append(f"{phase} {op} ({counts})")
        tds = ""
        for r in ranks:
            count = got[r].get("count", 0)
            if given and count != want and phase != WARMUP:
                cls, title = "num off", f" title='expected {want}'"
            elif not given and differ:
                what = "no collective here on this rank" if count == 0 else "ranks differ"
                cls, title = "num off", f" title='{what}'"
            else:
                cls, title = "num", ""
            tds += f"<td class='{cls}'{title}>{count}</td>{_bytes_cell(got[r], count)}"
        want_td = (
            f"<td class=num>{want}</td>"
            if given and phase != WARMUP
            else f"<td class=none>{NONE}</td>"
        )
        sites_td = f"<td>{esc(', '.join(sorted(sites)))}</td>" if given else "<td class=none>—</td>"
        body.append(f"<tr><td>{esc(phase)}</td><td>{esc(op)}</td>{want_td}{sites_td}{tds}</tr>")
    note = (
        ""
        if given
        else "<p class=muted>No expectation was given for this code's collectives: the table "
        "shows what each rank issued; a count is marked where the ranks differ.</p>"
    )
    if not given and asymmetric:
        note += (
            "<p class=ledger-asymmetric><b>Ranks differ:</b> "
            + esc("; ".join(asymmetric))
            + " (a collective issued on some ranks only hangs or mismatches)</p>"
        )
    return (
        "<h4>Collective ledger (all steps)</h4>"
        + note
        + _table(
            "<tr><th>phase</th><th>op</th><th>expected</th><th>expected sites</th>"
            f"{head}</tr>{''.join(body)}",
            " class=ledger",
        )
        + _ledger_problems(ledger)
    )


def _bytes_cell(cell: dict, count: int) -> str:
    """The bytes a rank moved, or "—" where the ledger recorded none for collectives it issued."""
    moved = cell.get("bytes")
    if moved is None or (moved == 0 and count > 0):
        return f"<td class=none>{NONE}</td>"
    return f"<td class=num>{moved:,}</td>"


def _ledger_problems(ledger: dict) -> str:
    """What the ledger check found against the collectives
    the block implies (missing, extra, asymmetric)."""
    problems = ledger.get("problems") or []
    if not problems:
        return ""
    items = "".join(
        f"<li>{esc(p.get('text', p) if isinstance(p, dict) else p)}</li>" for p in problems
    )
    return f"<p><b>Ledger check:</b></p><ul class=ledger-problems>{items}</ul>"


def _extras(case: dict) -> str:
    """Keys other parts of tpcheck add to a case (e.g.
    ledger_check), shown as JSON so none is hidden."""
    extra = {k: v for k, v in case.items() if k not in KNOWN_CASE_KEYS}
    if not extra:
        return ""
    return (
        "<details><summary>More ("
        + esc(", ".join(sorted(extra)))
        + ")</summary><pre>"
        + esc(json.dumps(extra, indent=2, sort_keys=True, default=str))
        + "</pre></details>"
    )
