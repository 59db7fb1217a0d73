"""CLI behaviour: exit codes, bad input, no orphan processes."""

import json
import subprocess
import sys

import pytest

from tpcheck.cli import main

from paths import REPO


def _run(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "tpcheck", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_bad_world_size_exits_2_naming_both_numbers():
    proc = _run("run", "--mode", "equivalence", "--world-size", "5")
    assert proc.returncode == 2
    assert "world size 5" in proc.stderr and "12" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_fault_and_dtype_exit_2(capsys):
    assert main(["run", "--fault", "no_such_fault"]) == 2
    assert "no_such_fault" in capsys.readouterr().err
    assert main(["run", "--dtype", "float8"]) == 2
    assert "float8" in capsys.readouterr().err


@pytest.mark.parametrize(
    "faults",
    [
        ["missing_forward_reduce", "missing_backward_reduce"],
        pytest.param(["all"], marks=pytest.mark.slow),
    ],
    ids=["two", "all"],
)
def test_matrix_writes_json_and_exit_0(tmp_path, faults):
    out = tmp_path / "r.json"
    proc = _run("run", "--world-size", "1", "2", "--fault", *faults, "--json", str(out), "-q")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["schema"] == "tpcheck.report/1"
    assert report["summary"]["cases"] == len(report["cases"]) >= 3
    assert all(c["as_expected"] for c in report["cases"])


def test_faults_lists_the_catalogue():
    proc = _run("faults", "--json")
    names = {f["name"] for f in json.loads(proc.stdout)}
    assert {"missing_forward_reduce", "missing_backward_reduce"} <= names


@pytest.mark.slow
def test_runs_under_torchrun():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "-m",
            "tpcheck",
            "run",
            "--mode",
            "equivalence",
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["passed"] is True and result["world_size"] == 2


def test_cli_modes_are_the_seed_modes():
    # seed_compat.py owns them; `run --mode` offers exactly those
    from tpcheck import seed_compat
    from tpcheck.cli.parser import build_parser

    parser = build_parser("run")
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    (mode,) = [a for a in commands.choices["run"]._actions if a.dest == "mode"]
    assert tuple(mode.choices) == seed_compat.MODES
