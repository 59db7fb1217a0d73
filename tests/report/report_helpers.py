"""Helpers for the report tests: run the `tpcheck` command and keep its reports."""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SEED_ARGS = ("run", "--mode", "all", "--world-size", "2")  # what `make demo` runs
# A multi-step matrix with both seed faults and the
# hang fault: covers curves, problems and the hang row.
MATRIX_ARGS = (
    "run",
    "--world-size",
    "2",
    "--steps",
    "2",
    "--timeout",
    "2",
    "--fault",
    "missing_forward_reduce",
    "missing_backward_reduce",
    "collective_on_some_ranks",
)


@dataclass
class Run:
    proc: subprocess.CompletedProcess
    json_path: Path
    html_path: Path

    @property
    def report(self) -> dict:
        return json.loads(self.json_path.read_text())


def tpcheck(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tpcheck", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def run_with_reports(directory: Path, args: tuple[str, ...]) -> Run:
    json_path, html_path = directory / "report.json", directory / "report.html"
    proc = tpcheck(*args, "--json", str(json_path), "--html", str(html_path))
    assert proc.returncode == 0, proc.stderr
    return Run(proc, json_path, html_path)
