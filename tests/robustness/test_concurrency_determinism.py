"""Two checks at once do not collide (no fixed port, no shared temp file); the same command gives
the same JSON (timings aside: keys named `seconds`); the report is written atomically."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpcheck.cli import main
from tpcheck.report import schema

from timings import without_timings

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_concurrent_checks_do_not_collide(tmp_path):
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tpcheck", "run", "--mode", "all", "-q", "--json", str(o)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for o in outs
    ]
    try:
        done = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, done):
        assert p.returncode == 0, err
    assert done[0][0] == done[1][0]  # the seed's JSON on stdout
    a, b = (without_timings(json.loads(o.read_text())) for o in outs)
    assert a == b and a["summary"]["cases"] == 3


def test_same_command_twice_gives_identical_json(tmp_path):
    argv = [
        "run",
        "--world-size",
        "1",
        "2",
        "--fault",
        "missing_forward_reduce",
        "missing_backward_reduce",
        "--steps",
        "2",
        "-q",
    ]
    reports = []
    for i in range(2):
        path = tmp_path / f"r{i}.json"
        assert main([*argv, "--json", str(path)]) == 0
        reports.append(without_timings(json.loads(path.read_text())))
    assert reports[0] == reports[1]
    assert reports[0]["summary"]["cases"] >= 4


@pytest.mark.parametrize("failing", ["replace", "fsync"])
def test_crash_while_writing_keeps_the_old_report_and_no_temp_file(tmp_path, monkeypatch, failing):
    path = tmp_path / "report.json"
    path.write_text("old report\n")

    def boom(*args, **kwargs):
        raise OSError(f"simulated crash in os.{failing}")

    monkeypatch.setattr(schema.os, failing, boom)
    with pytest.raises(OSError, match="simulated crash"):
        schema.write_atomic(str(path), "new report\n" * 1000)
    monkeypatch.undo()
    assert path.read_text() == "old report\n"
    assert os.listdir(tmp_path) == ["report.json"]
    schema.write_atomic(str(path), "new report\n")  # and a write that succeeds replaces it whole
    assert path.read_text() == "new report\n" and os.listdir(tmp_path) == ["report.json"]
