"""The line the console and the HTML report give a case's float64 run (`float64_run`)."""

from __future__ import annotations


def float64_line(case: dict) -> str:
    """'float64 run: <verdict> ...' for a case with a float64 run (or its skip); '' without one."""
    run = case.get("float64_run")
    if not run:
        return ""
    if "skipped" in run:
        return f"float64 run: {run['skipped']}"
    parts = [run["verdict"]]
    first, d = run.get("first_divergence"), run.get("diagnosis") or {}
    if first:
        sig = f"; {d['signature']}" if d.get("signature") else ""
        parts.append(f"first at {first['name']} ({first['stage']}, step {first['step']}){sig}")
    if run.get("checks") is not None:
        parts.append(f"{run['checks']} checks")
    parts.append(f"{run['seconds']:.2f} s")
    return "float64 run: " + ", ".join(parts)
