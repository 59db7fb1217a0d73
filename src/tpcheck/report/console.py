"""Terminal output: a summary table and a progress bar for matrices.

Colours and the live bar only on a terminal: rich detects it (`force_terminal=None`) from the
stream's `isatty()` and the usual variables (NO_COLOR, FORCE_COLOR). Anywhere else (CI logs, pipes,
files) the same table comes out as plain text, without ANSI escapes, and progress is one line per
case, so logs stay greppable.
"""

from __future__ import annotations

import atexit
import sys
from typing import TextIO

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from tpcheck.report.float64 import float64_line

# Plain output is not wrapped at rich's default 80 columns: CI logs are wide, and a wrapped case
# name is harder to grep than a long line.
PLAIN_WIDTH = 200
VERDICT_STYLE = {
    "equivalent": "green",
    "not equivalent": "red",
    "hang": "magenta",
    "error": "bold red",
    "invalid": "yellow",
}


def make_console(out: TextIO) -> Console:
    console = Console(file=out, force_terminal=None, highlight=False, soft_wrap=False)
    # a pipe or a file: tables laid out at a fixed width, text lines never wrapped
    if not console.is_terminal:
        console.width = PLAIN_WIDTH
        console.soft_wrap = True
    return console


def where_text(r: dict) -> str:
    """Where a case first diverged: 'name (stage, step N) on ranks [..]', or '' when nowhere."""
    first = r.get("first_divergence")
    if first:
        return f"{first['name']} ({first['stage']}, step {first['step']}) ranks {first['ranks']}"
    waits = sorted(
        {tuple(p["last_collective"]) for p in r.get("problems", []) if p.get("last_collective")}
    )
    if r.get("verdict") == "hang" and waits:
        return "waiting in " + ", ".join(f"{op} at {site} ({phase})" for op, site, phase in waits)
    d = r.get("diagnosis") or {}
    if d.get("location") or d.get("stage"):
        parts = [
            p
            for p in (d.get("stage"), f"step {d['step']}" if d.get("step") is not None else None)
            if p
        ]
        return (
            f"{d.get('location') or '?'} ({', '.join(parts)})" if parts else str(d.get("location"))
        )
    return ""


def signature_text(r: dict) -> str:
    """The diagnosis' signature ('partial_sum at down'); a hang names itself; else ''."""
    d = r.get("diagnosis") or {}
    if d.get("signature"):
        loc = d.get("location")
        return f"{d['signature']} at {loc}" if loc else str(d["signature"])
    return "hang" if r.get("verdict") == "hang" else ""


def finding_line(r: dict) -> str:
    """'finding: <doc> (<title>)' for a case whose diagnosis matches a documented upstream defect
    (the report's `finding`, tpcheck/findings.py); '' otherwise."""
    f = r.get("finding")
    return f"finding: {f['doc']} ({f['title']})" if f else ""


def summary_table(results: list[dict]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    # On a narrow terminal the long columns wrap; the short ones keep their width.
    for col, min_width in (
        ("case", 20),
        ("tp", 2),
        ("dtype", 8),
        ("verdict", 14),
        ("expected", 10),
        ("first divergence", 16),
        ("signature", 9),
    ):
        table.add_column(col, min_width=min_width, overflow="fold")
    for r in results:
        expected = (
            Text(f"ok ({r['expected']})", style="green")
            if r["as_expected"]
            else Text(unexpected_text(r), style="bold red")
        )
        verdict = Text(r["verdict"], style=VERDICT_STYLE.get(r["verdict"], ""))
        table.add_row(
            r["name"],
            str(r.get("world_size", "")),
            str(r.get("dtype", "")),
            verdict,
            expected,
            where_text(r),
            signature_text(r),
        )
    return table


def unexpected_text(r: dict) -> str:
    """A case that did not go as expected, in the order people read it: what was expected, then
    what came ("expected not equivalent, got equivalent": a planted fault went unseen)."""
    return f"expected {r['expected']}, got {r['verdict']}"


def print_summary(results: list[dict], out: TextIO | None = None) -> None:
    """The table, then for every case that did not go as expected its summary and diagnosed cause
    (on `out`, default the sys.stderr of the call)."""
    console = make_console(sys.stderr if out is None else out)
    _print_table(console, summary_table(results))
    for r in results:
        if r["as_expected"]:
            if r.get("finding"):  # expected, and a documented upstream defect: say which
                console.print(Text(f"{r['name']}: ", style="bold") + Text(finding_line(r)))
            continue
        console.print(Text(f"{r['name']}: ", style="bold") + Text(r.get("summary", "")))
        cause = (r.get("diagnosis") or {}).get("cause")
        if cause:
            console.print(f"  cause: {cause}", markup=False)
        if line := float64_line(r):
            console.print(f"  {line}", markup=False)
        if r.get("finding"):
            console.print(f"  {finding_line(r)}", markup=False)
    ok = sum(r["as_expected"] for r in results)
    style = "green" if ok == len(results) else "bold red"
    console.print(Text(f"{ok} of {len(results)} case(s) as expected", style=style))


def _print_table(console: Console, table: Table) -> None:
    """On a terminal as is; elsewhere without the cells' trailing padding (clean CI logs)."""
    if console.is_terminal:
        console.print(table)
        return
    with console.capture() as captured:
        console.print(table)
    console.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def progress_printer(out: TextIO | None = None):
    """A callback `progress(done, total, result)`: a live bar on a terminal, one line per case
    elsewhere. `out` defaults to the sys.stderr of the call (not of the import: a test
    runner replaces it)."""
    out = sys.stderr if out is None else out
    console = make_console(out)
    if not console.is_terminal:

        def progress(done: int, total: int, result: dict) -> None:
            console.print(f"[{done}/{total}] {result['name']}: {result['verdict']}", markup=False)
            out.flush()

        return progress
    return _LiveBar(console)


class _LiveBar:
    """Started on the first finished case, stopped on the last (or at exit, should a run die
    half-way, so the cursor is never left hidden). No refresh thread: it redraws
    when a case finishes."""

    def __init__(self, console: Console):
        self.bar = Progress(
            TextColumn("[bold]checking"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=console,
            auto_refresh=False,
        )
        self.task = None

    def __call__(self, done: int, total: int, result: dict) -> None:
        if self.task is None:
            self.bar.start()
            atexit.register(self.bar.stop)
            self.task = self.bar.add_task("", total=total)
        if not result["as_expected"]:
            self.bar.console.print(
                Text(f"{result['name']}: {unexpected_text(result)}", style="bold red")
            )
        self.bar.update(
            self.task, completed=done, description=f"{result['name']}: {result['verdict']}"
        )
        self.bar.refresh()
        if done >= total:
            self.bar.stop()
