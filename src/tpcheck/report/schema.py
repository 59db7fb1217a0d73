"""The versioned JSON report. Deterministic: the same run gives the same bytes, timings aside
(they live under keys named `seconds`)."""

from __future__ import annotations

import os
import platform
import tempfile

import torch

from tpcheck._version import __version__
from tpcheck.report.output import current_umask, written_directly

SCHEMA = "tpcheck.report/1"


def _backend(results: list[dict]) -> str:
    """The collective backends the cases ran on: gloo, and NCCL beside it for cases on GPUs."""
    on_gpu = any(r.get("spec", {}).get("device") == "cuda" for r in results)
    return "gloo+nccl" if on_gpu else "gloo"


def build_report(
    results: list[dict],
    *,
    exit_code: int,
    seed: dict | None = None,
    interrupted: dict | None = None,
) -> dict:
    """The report of a run: its case results, their summary, (for the seed's modes) the seed's JSON,
    and for a run stopped by a signal `interrupted`: {signal, cases_finished, cases_planned}."""
    report = {
        "schema": SCHEMA,
        "tpcheck": __version__,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "backend": _backend(results),
        },
        "summary": {
            "cases": len(results),
            "as_expected": sum(r["as_expected"] for r in results),
            "verdicts": {
                v: sum(r["verdict"] == v for r in results)
                for v in sorted({r["verdict"] for r in results})
            },
            "exit_code": exit_code,
        },
        "cases": results,
    }
    if seed is not None:
        report["seed"] = seed
    if interrupted is not None:
        report["interrupted"] = interrupted
    return report


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path`. A regular file (or a new one) is replaced atomically, so that a crash
    leaves the old file or none, never half a file, and gets the mode the umask gives a new file; a
    symlink is written through to its target (the link stays); a character device or a FIFO is
    opened and written, never replaced (tpcheck.report.output). Raises OSError
    when the write fails."""
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and written_directly(mode):
        with open(target, "w") as f:
            f.write(text)
        return
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tpcheck-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o666 & ~current_umask())
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def load_schema() -> dict:
    """The JSON Schema (draft 2020-12) of what build_report
    returns; shipped as report/schema.json."""
    import json
    from importlib.resources import files

    return json.loads(files("tpcheck.report").joinpath("schema.json").read_text())
