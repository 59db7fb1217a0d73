"""Terminal output: a summary table, plain text when not on a TTY."""
from __future__ import annotations

import sys
from typing import TextIO


def _row(r: dict) -> str:
    mark = "ok  " if r["as_expected"] else "FAIL"
    first = r.get("first_divergence")
    where = f"{first['name']} ({first['stage']}, step {first['step']})" if first else ""
    return f"{mark} {r['name']:<44} {r['verdict']:<15} {where}"


def print_summary(results: list[dict], out: TextIO = sys.stderr) -> None:
    for r in results:
        print(_row(r), file=out)
        if not r["as_expected"]:
            print(f"     {r['summary']}", file=out)
    ok = sum(r["as_expected"] for r in results)
    print(f"{ok} of {len(results)} case(s) as expected", file=out)


def progress_printer(out: TextIO = sys.stderr):
    def progress(done: int, total: int, result: dict) -> None:
        print(f"[{done}/{total}] {result['name']}: {result['verdict']}", file=out, flush=True)

    return progress
