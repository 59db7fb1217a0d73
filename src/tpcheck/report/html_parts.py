"""What the HTML report's page and its case sections share: the styles, escaping, small tables
and the marks of a verdict and an expectation."""

from __future__ import annotations

import html
import re

from tpcheck.report.console import unexpected_text

MAX_FAILED_ROWS = 25  # failed checks listed per case; the JSON has them all
MAX_FAILED_ROWS_MANY = 8  # the same in a report of many cases (a sweep's page)
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


def _dl(items: list[tuple[str, object]]) -> str:
    return "<dl>" + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in items) + "</dl>"


def _verdict(v: str) -> str:
    return f'<span class="v v-{esc(v.replace(" ", "-"))}">{esc(v)}</span>'


def _mark(case: dict) -> str:
    if case["as_expected"]:
        return "<span class=ok>✓ as expected</span>"
    return f"<span class=unexpected>✗ {esc(unexpected_text(case))}</span>"


def _omitted(case: dict | None) -> int:
    """How many passing checks `tpcheck hf` left out of this case (0: all stored)."""
    omitted = (case or {}).get("checks_omitted") or {}
    return int(omitted.get("passed", 0)) if isinstance(omitted, dict) else 0
