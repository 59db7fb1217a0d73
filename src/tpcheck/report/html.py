"""The HTML report: one self-contained page (styles inline, figures as base64 PNG, no script, no
network), readable offline and attachable to a CI run.

Sections: the summary (cases, verdicts, expectations), the heatmap of log10(error / bound) per case
and tensor, and per case its diagnosis, first divergent tensor, per-step error curves (multi-step
runs), failed checks and the collective ledger per phase and rank. Every string from
the report is escaped.
"""

from __future__ import annotations

import html
import json
import re

from tpcheck.checker.checkid import CheckId
from tpcheck.checker.vocabulary import LEDGER_PHASES, WARMUP
from tpcheck.report.console import unexpected_text
from tpcheck.report.float64 import float64_line
from tpcheck.report.module_outputs import counts, module_outputs_code

MAX_FAILED_ROWS = 25  # failed checks listed per case; the JSON has them all
KNOWN_CASE_KEYS = {
    "name",
    "spec",
    "world_size",
    "dtype",
    "expected",
    "verdict",
    "as_expected",
    "summary",
    "seconds",
    "checks",
    "ledger",
    "first_divergence",
    "problems",
    "diagnosis",
    "inferred_plan",
    "activations",
    "checks_omitted",
}
NONE = "—"  # a cell with nothing to show (no expectation given, no byte count recorded)
FINDINGS = re.compile(r"docs/findings/[\w./-]+\.md")

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
 margin:24px auto;max-width:1200px;padding:0 16px;color:#1d1d1f;background:#fff}
h1{font-size:24px;margin:0 0 4px}h2{font-size:19px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:16px;margin:18px 0 6px}.muted{color:#666}
.wrap{overflow-x:auto;max-width:100%;margin:6px 0 12px}
table{border-collapse:collapse;margin:0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f6}td.num{text-align:right;font-variant-numeric:tabular-nums}
.banner{padding:10px 14px;border-radius:6px;font-weight:600;margin:12px 0}
.good{background:#e3f4e1;color:#14532d}.bad{background:#fde2e1;color:#7f1d1d}
.v{padding:1px 7px;border-radius:9px;font-size:13px;white-space:nowrap}
.v-equivalent{background:#d7f0d2;color:#14532d}.v-not-equivalent{background:#fbd5d3;color:#7f1d1d}
.v-hang{background:#eddcf7;color:#4c1d95}.v-error,.v-invalid{background:#fde68a;color:#713f12}
.v-skipped{background:#e5e7eb;color:#374151}
td.off{background:#fbd5d3;font-weight:700}td.long{min-width:9em;overflow-wrap:anywhere}td.none{color:#888;text-align:center}
.note{color:#14532d;font-style:italic}
.ok{color:#15803d;font-weight:600;white-space:nowrap}
.unexpected{color:#b91c1c;font-weight:700;white-space:nowrap}
img{max-width:100%;height:auto;border:1px solid #eee}
section.case{border:1px solid #e3e3e3;border-radius:6px;padding:4px 14px 10px;margin:14px 0}
pre{background:#f6f6f8;padding:8px;overflow-x:auto;font-size:12px;white-space:pre-wrap}
code{font-size:13px;overflow-wrap:anywhere}
dl{display:grid;grid-template-columns:max-content auto;gap:2px 14px;margin:6px 0}
dt{font-weight:600}dd{margin:0}
#diagnosis h3{margin:10px 0 2px}details>summary{cursor:pointer;color:#444;margin:6px 0}
"""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _table(inner: str, attrs: str = "") -> str:
    """A table in a wrapper that scrolls sideways when the table is wider than its card."""
    return f"<div class=wrap><table{attrs}>{inner}</table></div>"


def render_html(report: dict) -> str:
    """The whole page for a report built by tpcheck.report.schema.build_report."""
    cases = report.get("cases", [])
    sweep = report.get("sweep")
    summary = _sweep(sweep, cases) if sweep else _summary_table(cases)  # one summary table
    parts = [_header(report), summary, _diagnoses(cases), _heatmap(cases)]
    parts += [_case_section(i, case) for i, case in enumerate(cases)]
    title = f"tpcheck report: {_banner_text(report)}"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head>\n<body>\n"
        + "\n".join(p for p in parts if p)
        + "\n</body></html>\n"
    )


# ------------------------------------------------------------------------------ top of the page


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


def _omitted(case: dict | None) -> int:
    """How many passing checks `tpcheck hf` left out of this case (0: all stored)."""
    omitted = (case or {}).get("checks_omitted") or {}
    return int(omitted.get("passed", 0)) if isinstance(omitted, dict) else 0


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


def _verdict(v: str) -> str:
    return f'<span class="v v-{esc(v.replace(" ", "-"))}">{esc(v)}</span>'


def _mark(case: dict) -> str:
    if case["as_expected"]:
        return "<span class=ok>✓ as expected</span>"
    return f"<span class=unexpected>✗ {esc(unexpected_text(case))}</span>"


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


# ------------------------------------------------------------------------------ one case


def _case_section(i: int, case: dict) -> str:
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
    parts += [
        _forward_only(case),
        _float64_run(case),
        _notes(case),
        _diagnosis(case),
        _first_divergence(case),
        _problems(case),
        _curves(case),
        _failed_checks(case),
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


def _dl(items: list[tuple[str, object]]) -> str:
    return "<dl>" + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in items) + "</dl>"


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
    rows = []
    for p in case.get("problems", []):
        last = p.get("last_collective")
        where = f"{last[0]} at {last[1]} ({last[2]})" if last else ""
        tb = (
            f"<details><summary>traceback</summary><pre>{esc(p['traceback'])}</pre></details>"
            if p.get("traceback")
            else ""
        )
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
    if max((c["step"] for c in case.get("checks", [])), default=0) < 2:
        return ""
    from tpcheck.report import plots

    if not plots.step_curves(case):
        return ""

    return (
        f"<h4>Error / bound per step</h4><img class=curves alt='error over bound per step for "
        f"{esc(case['name'])}' src='{plots.curves_png(case)}'>"
    )


def _raw(c: dict) -> str:
    """The raw |TP - dense| beside a figure an allowance relaxed."""
    return f" (raw {c['raw_error']:.3g})" if c.get("raw_error") is not None else ""


def _failed_checks(case: dict) -> str:
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
        for c in failed[:MAX_FAILED_ROWS]
    )
    more = (
        f"<p class=muted>… and {len(failed) - MAX_FAILED_ROWS} more in the JSON report.</p>"
        if len(failed) > MAX_FAILED_ROWS
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
