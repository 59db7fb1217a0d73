"""Shared helpers for the benchmarks: medians, tables, JSON results, subprocess timing, and a memory
watchdog that polls a process tree through /proc.

Machines here are shared and noisy, so every benchmark reports the median of repeated runs and
ratios measured in the same run (alternating the two sides, so a burst of load hits both)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
PY = sys.executable


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--quick", action="store_true", help="fewer repeats and smaller sizes")
    return p


def median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def environment() -> dict:
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "loadavg_at_start": load,
    }


def write(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(
        json.dumps(
            {"benchmark": name, "environment": environment(), **payload}, indent=2, default=str
        )
    )
    print(f"-> {path.relative_to(ROOT)}")
    return path


def table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-markdown table (also readable on a terminal)."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [
        line(r) for r in cells
    ]
    return "\n".join(out)


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 1000 else f"{c:.0f}"
    return str(c)


def verdict(name: str, met: bool, measured: str, target: str) -> dict:
    print(f"TARGET {name}: {measured} (target {target}) -> {'MET' if met else 'MISSED'}")
    return {"name": name, "measured": measured, "target": target, "met": met}


def timed_run(
    cmd: list[str], *, env: dict | None = None, cwd: Path = ROOT, timeout: float = 300
) -> tuple[float, int]:
    """(wall seconds, exit code) of a subprocess, output discarded."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout
    )
    wall = time.perf_counter() - t0
    if proc.returncode not in (0,):
        sys.stderr.write(
            f"[bench] {' '.join(cmd)} exited {proc.returncode}: {proc.stderr.decode()[-400:]}\n"
        )
    return wall, proc.returncode


def child_env(**extra: str) -> dict:
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(ROOT / "src"))
    env.update(extra)
    return env


# ------------------------------------------------------------------------------ memory watchdog


def _status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _tree(root: int) -> list[int]:
    """root and all its descendants, from /proc/<pid>/task/*/children."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def watched_run(
    cmd: list[str],
    *,
    limit_gib: float,
    timeout: float,
    env: dict | None = None,
    poll_s: float = 0.1,
) -> dict:
    """Run `cmd`, polling its process tree. Per process: peak VmHWM (the kernel's own high-water
    mark, so exact even between polls). Total: peak over polls of the summed VmRSS (double counts
    pages that forked ranks share with their parent copy-on-write; an upper bound, used by the
    watchdog) and of the summed Pss (shared pages split; closer to what the machine really lost).
    Kills the tree and reports exceeded=True if the summed VmRSS passes `limit_gib`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    hwm: dict[int, int] = {}
    peak_rss = peak_pss = 0
    exceeded = timed_out = False
    limit_kb = limit_gib * 1024**2
    n = 0
    while proc.poll() is None:
        pids = _tree(proc.pid)
        rss = sum(_status_kb(p, "VmRSS") for p in pids)
        for p in pids:
            hwm[p] = max(hwm.get(p, 0), _status_kb(p, "VmHWM"))
        peak_rss = max(peak_rss, rss)
        if n % 5 == 0 or rss > 0.5 * limit_kb:
            peak_pss = max(peak_pss, sum(_pss_kb(p) for p in pids))
        n += 1
        if rss > limit_kb or time.perf_counter() - t0 > timeout:
            exceeded, timed_out = rss > limit_kb, not rss > limit_kb
            os.killpg(proc.pid, 9)
            break
        time.sleep(poll_s)
    out, err = proc.communicate()
    gib = 1024**2
    return {
        "returncode": proc.returncode,
        "wall_s": time.perf_counter() - t0,
        "exceeded": exceeded,
        "timed_out": timed_out,
        "peak_total_rss_gib": peak_rss / gib,
        "peak_total_pss_gib": peak_pss / gib,
        "peak_rss_per_process_gib": sorted((v / gib for v in hwm.values()), reverse=True),
        "stdout": out.decode(errors="replace"),
        "stderr": err.decode(errors="replace")[-2000:],
    }
