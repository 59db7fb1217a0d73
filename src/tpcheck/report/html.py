"""The HTML report: one self-contained page (styles inline, figures as base64 PNG, no script, no
network), readable offline and attachable to a CI run.

The page, top to bottom: the summary (cases, verdicts, expectations); the diagnosis of every case
that is not equivalent or not as expected (first divergence, signature, explanation, the user's
line: on the first screen); the heatmap of log10(error / bound) per case and tensor, at the tensors
some case failed at, every check folded under it; then one section per case (html_case.py: its
diagnosis, first divergent tensor, per-step curves of the tensors that moved, failed checks, the
collective ledger per phase and rank). Every string from the report is escaped (html_parts.py).
"""

from __future__ import annotations

import json

from tpcheck.report.html_case import _case_section
from tpcheck.report.html_parts import CSS, FINDINGS, _dl, _mark, _omitted, _table, _verdict, esc


def render_html(report: dict) -> str:
    """The whole page for a report built by tpcheck.report.schema.build_report."""
    cases = report.get("cases", [])
    sweep = report.get("sweep")
    summary = _sweep(sweep, cases) if sweep else _summary_table(cases)  # one summary table
    parts = [_header(report), summary, _diagnoses(cases), _heatmap(cases)]
    curves, many = curve_cases(cases), len(cases) > MANY_CASES
    parts += [_case_section(i, case, i in curves, many) for i, case in enumerate(cases)]
    title = f"tpcheck report: {_banner_text(report)}"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head>\n<body>\n"
        + "\n".join(p for p in parts if p)
        + "\n</body></html>\n"
    )


# ------------------------------------------------------------------------------ top of the page


MAX_CURVES = 6  # per-step curves (an image each) in one page: a sweep's page stays readable
MANY_CASES = 40  # beyond this, cases that went as expected get a brief section (a sweep's page)


def curve_cases(cases: list[dict]) -> set[int]:
    """The cases whose per-step curves may be drawn: all of a report of at most MAX_CURVES cases;
    else MAX_CURVES of them, those that did not go as expected first, each in the report's order."""
    order = sorted(range(len(cases)), key=lambda i: (bool(cases[i].get("as_expected")), i))
    return set(order[:MAX_CURVES])


def _banner_text(report: dict) -> str:
    s = report.get("summary", {})
    text = f"{s.get('as_expected', 0)} of {s.get('cases', 0)} case(s) as expected"
    stop = report.get("interrupted")
    if stop:
        text += (
            f" · interrupted by {stop['signal']} after {stop['cases_finished']} of "
            f"{stop['cases_planned']} case(s): the rest never ran"
        )
    return text


def _header(report: dict) -> str:
    s = report.get("summary", {})
    good = s.get("as_expected") == s.get("cases") and not report.get("interrupted")
    env = report.get("environment", {})
    env_text = ", ".join(f"{k} {v}" for k, v in sorted(env.items()))
    verdicts = ", ".join(f"{n} {v}" for v, n in sorted(s.get("verdicts", {}).items()))
    return (
        f"<h1>tpcheck report</h1><div class=muted>tpcheck {esc(report.get('tpcheck', '?'))} · "
        f"{esc(env_text)} · schema {esc(report.get('schema', '?'))}</div>"
        f'<div class="banner {"good" if good else "bad"}" id=banner>{esc(_banner_text(report))} · '
        f"verdicts: {esc(verdicts)} · exit code {esc(s.get('exit_code', '?'))}</div>"
    )


def _sweep(sweep: dict, cases: list[dict]) -> str:
    """`tpcheck hf`'s table, the page's one summary table: one row per architecture x world size x
    dtype (its case linked), skipped ones with their reason; a failing row's reason is its cause,
    with the docs/findings page when the report names one."""
    index = {c["name"]: i for i, c in enumerate(cases)}
    rows = []
    for r in sweep["rows"]:
        i = index.get(r.get("case", ""))
        case = cases[i] if i is not None else None
        name = esc(r["architecture"])
        arch = f"<a href='#case-{i}'>{name}</a>" if i is not None else name
        mark = _mark(case) if case else ""
        expected = esc(case["expected"]) if case else ""
        rows.append(
            f"<tr><td>{arch}</td><td class=num>{esc(r['world_size'])}</td>"
            f"<td>{esc(r['dtype'])}</td><td>{_verdict(r['verdict'])}{_omitted_note(case)}</td>"
            f"<td>{expected}</td><td>{mark}</td><td class=long>{esc(r['first_divergence'])}</td>"
            f"<td class=long>{esc(r['signature'])}</td><td class=num>{r['seconds']:.2f}</td>"
            f"<td class=long>{_sweep_reason(r, case)}</td></tr>"
        )
    rules = ", ".join(f"{k} = {v}" for k, v in sweep.get("rules", {}).items()) or "none"
    return (
        f"<h2>HuggingFace transformers {esc(sweep['transformers'])}: the TP plans</h2>"
        f"<p id=sweep-summary>{esc(sweep['summary'])} · plan rules overridden: {esc(rules)}</p>"
        + _table(
            "<tr><th>architecture</th><th>TP</th><th>dtype</th><th>verdict</th><th>expected</th>"
            "<th>as expected</th><th>first divergence</th><th>signature</th><th>seconds</th>"
            "<th>reason</th></tr>" + "".join(rows),
            " id=sweep",
        )
    )


def _omitted_note(case: dict | None) -> str:
    n = _omitted(case)
    if not n or case.get("checks"):
        return ""
    title = f"{n} passing checks left out of the report"
    return f" <span class=note title='{title}'>passed, not stored</span>"


def _sweep_reason(row: dict, case: dict | None) -> str:
    texts = [row.get("reason", ""), row.get("signature", ""), row.get("summary", "")]
    diagnosis = (case or {}).get("diagnosis") or {}
    texts += [json.dumps(case, default=str)] if case else []
    finding = next((m.group(0) for t in texts if t for m in [FINDINGS.search(str(t))] if m), "")
    reason = row.get("reason") or ""
    if not reason and row["verdict"] not in ("equivalent", "skipped"):
        reason = diagnosis.get("cause") or (case or {}).get("summary", "") or row["signature"]
    return esc(reason) + (f" (see <code>{esc(finding)}</code>)" if finding else "")


def _summary_table(cases: list[dict]) -> str:
    from tpcheck.report.console import signature_text, where_text

    rows = "".join(
        f"<tr><td><a href='#case-{i}'>{esc(c['name'])}</a></td><td "
        f"class=num>{esc(c.get('world_size', ''))}</td><td>{esc(c.get('dtype', ''))}</td>"
        f"<td>{_verdict(c['verdict'])}</td><td>{esc(c['expected'])}</td><td>{_mark(c)}</td>"
        f"<td class=long>{esc(where_text(c))}</td><td class=long>{esc(signature_text(c))}</td></tr>"
        for i, c in enumerate(cases)
    )
    return "<h2>Summary</h2>" + _table(
        "<tr><th>case</th><th>TP</th><th>dtype</th><th>verdict</th><th>expected</th>"
        "<th>as expected</th><th>first divergence</th><th>signature</th></tr>" + rows,
        " id=summary",
    )


def _heatmap(cases: list[dict]) -> str:
    unstored = [c for c in cases if _omitted(c) and not c.get("checks")]
    drawn = [c for c in cases if c not in unstored]
    note = (
        "<p class=note id=not-stored>Passed, not stored (their passing checks were left out of "
        "the report, so they have no cells): "
        + esc(", ".join(c["name"] for c in unstored))
        + "</p>"
        if unstored
        else ""
    )
    if not any(c.get("checks") for c in drawn):
        return ("<h2>Error relative to bound</h2>" + note) if note else ""
    cases = drawn
    from tpcheck.report import plots

    failing, every = plots.failing_columns(cases), plots.tensor_columns(cases)
    if len(every) > plots.MAX_COLUMNS:
        return _heatmap_by_stage(cases, len(every)) + note
    shown = (
        f"<p class=muted>The tensors some case failed at ({len(failing)} of {len(every)}):</p>"
        f"<img id=heatmap alt='heatmap of error over bound at the failing tensors' "
        f"src='{plots.heatmap_png(cases, only=failing)}'>"
        if failing and len(failing) < len(every)
        else ""
    )
    full = (
        f"<img id={'heatmap-all' if shown else 'heatmap'} alt='heatmap of error over bound per "
        f"case and tensor' src='{plots.heatmap_png(cases)}'>"
    )
    if shown or not failing:  # folded: the failing region first, every check a click away
        inside = "" if failing else ", every one inside its bound"
        full = (
            f"<details><summary>All checks: {len(every)} tensors{inside}</summary>{full}</details>"
        )
    return (
        "<h2>Error relative to bound</h2><p class=muted>Each cell: log10(error / bound), the "
        "maximum over ranks, steps and stages (loaded weights, optimizer updates, buffers, "
        "cross-rank replica agreement). 0 is the bound: green is inside it, red is a failure; "
        "the scale is "
        f"capped at ±{plots.CAP:g} decades. Exact (bitwise) checks have bound 0: a match is at the "
        "floor, any difference at the ceiling. Grey: not checked (the case stopped before). A "
        "block with many tensors is cut into panels, one under the other, by stage.</p>"
        + shown
        + full
        + note
    )


def _heatmap_by_stage(cases: list[dict], tensors: int) -> str:
    from tpcheck.report import plots

    return (
        "<h2>Error relative to bound, by stage</h2><p class=muted>"
        f"{tensors:,} tensors across {len(cases)} cases, too many for a column each: each cell is "
        "log10(error / bound) of the worst check of that stage (over its tensors, ranks and "
        "steps); each case's section below names its failed tensors. 0 is the bound: green is "
        f"inside it, red a failure, capped at ±{plots.CAP:g} decades; grey: no check at that "
        "stage.</p>"
        f"<img id=heatmap alt='heatmap of the worst error over bound per case and stage' "
        f"src='{plots.heatmap_png(plots.by_stage(cases))}'>"
    )


def _diagnoses(cases: list[dict]) -> str:
    """Right under the summary: for each case that is not equivalent or not as expected, what
    diverged first, its signature, the explanation and the fix, and the user's line where one is
    known; the rest of the page (heatmap, cases) follows."""
    rows = [_diagnosed(i, c) for i, c in enumerate(cases) if not _fine(c)]
    rows = [r for r in rows if r]
    if not rows:
        return ""
    return "<section id=diagnosis><h2>Diagnosis</h2>" + "".join(rows) + "</section>"


def _fine(case: dict) -> bool:
    return case["as_expected"] and case["verdict"] == "equivalent"


def _diagnosed(i: int, case: dict) -> str:
    d, f = case.get("diagnosis") or {}, case.get("first_divergence") or {}
    head = (
        f"<h3><a href='#case-{i}'>{esc(case['name'])}</a> {_verdict(case['verdict'])} "
        f"{_mark(case)}</h3>"
    )
    if not d and not f:  # no divergence to name (a hang, an error): the summary says why
        return head + f"<p>{esc(case.get('summary', ''))}</p>"
    items = []
    if f:
        ranks = ", ".join(map(str, f.get("ranks", [])))
        items.append(("first divergence", f"{f['name']} ({f['stage']}, step {f['step']})"))
        items.append(("on ranks", ranks))
    if d:
        items += [("signature", d.get("signature")), ("explanation", d.get("sentence"))]
    if line := _user_line(case):
        items.append(("your line", line))
    if finding := case.get("finding"):
        items.append(("known defect", f"{finding['title']} ({finding['doc']})"))
    return head + _dl([(k, v) for k, v in items if v])


def _user_line(case: dict) -> str | None:
    """The user's source line the diagnosis names: where an operation ran on a shard, or the
    loader that loaded a failing weight."""
    ops = ((case.get("diagnosis") or {}).get("evidence") or {}).get("ops") or []
    if ops and ops[0].get("at"):
        return str(ops[0]["at"])
    loaded = [c.get("loaded_by") for c in case.get("checks", []) if not c["passed"]]
    return next((x for x in loaded if x), None)
