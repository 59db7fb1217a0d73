"""`tpcheck report FILE` as a CI gate: it exits with the report's verdict code, by the rule `run`
and `verify` use (`exit_code`: 2 a case invalid, else 3 one errored, else 1 one not as expected,
else 0), an interrupted run's report with the code the run recorded (128 + the signal's number);
`--exit-zero` shows the report and exits 0. A file that is not a valid report is 2 either way."""

import copy
import json
import subprocess
import sys

import pytest

from tpcheck.cli import main

from paths import REPO

OWN_MODULE = str(REPO / "examples" / "own_module.py")


@pytest.fixture(scope="module")
def real_report(tmp_path_factory) -> dict:
    """A real report of two cases: `own_mlp` equivalent, `own_mlp_bias_before_reduce` (its
    planted bug) not equivalent and not as expected: the run itself exits 1."""
    path = tmp_path_factory.mktemp("gate") / "r.json"
    assert main(["verify", OWN_MODULE, "--world-size", "2", "-q", "--json", str(path)]) == 1
    report = json.loads(path.read_text())
    assert [c["as_expected"] for c in report["cases"]] == [True, False]
    assert report["summary"]["exit_code"] == 1
    return report


def _write(tmp_path, report: dict) -> str:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    return str(path)


def _with_cases(report: dict, cases: list[dict], **summary) -> dict:
    """`report` holding `cases`, its summary counted again (as `build_report` counts it)."""
    report = copy.deepcopy(report)
    report["cases"] = cases
    report["summary"].update(
        cases=len(cases),
        as_expected=sum(c["as_expected"] for c in cases),
        verdicts={v: sum(c["verdict"] == v for c in cases) for v in {c["verdict"] for c in cases}},
        **summary,
    )
    return report


def _no_verdict(case: dict, verdict: str) -> dict:
    """`case` as a case that did not run to the end (`error` or `invalid`): problems, no checks."""
    case = copy.deepcopy(case)
    for key in ("checks", "ledger", "first_divergence", "diagnosis", "self_test"):
        case.pop(key, None)
    case.update(
        verdict=verdict,
        as_expected=False,
        summary=f"{verdict}: rank 0 raised",
        problems=[{"status": verdict, "rank": 0, "message": "raised"}],
    )
    return case


def test_a_report_with_a_case_not_as_expected_exits_1(real_report, tmp_path, capsys):
    path = _write(tmp_path, real_report)
    assert main(["report", path]) == 1
    err = capsys.readouterr().err
    assert "1 of 2 case(s) as expected" in err  # still shown in full
    assert "exit 1, the report's verdict (--exit-zero to exit 0" in err


def test_exit_zero_shows_it_and_exits_0(real_report, tmp_path, capsys):
    html = tmp_path / "r.html"
    assert main(["report", _write(tmp_path, real_report), "--exit-zero", "--html", str(html)]) == 0
    err = capsys.readouterr().err
    assert "1 of 2 case(s) as expected" in err and "exit 1" not in err
    assert html.read_text().startswith("<!DOCTYPE html>")


def test_an_all_equivalent_report_exits_0(real_report, tmp_path, capsys):
    report = _with_cases(real_report, real_report["cases"][:1], exit_code=0)
    assert main(["report", _write(tmp_path, report)]) == 0
    err = capsys.readouterr().err
    assert "1 of 1 case(s) as expected" in err and "exit" not in err


@pytest.mark.parametrize(
    "verdicts, code",
    [
        (["error"], 3),
        (["invalid"], 2),
        (["error", "invalid"], 2),  # invalid first: bad input is the user's to fix first
        (["not equivalent", "error"], 3),
    ],
)
def test_the_verdict_code_follows_the_one_rule(real_report, tmp_path, verdicts, code):
    equivalent, not_equivalent = real_report["cases"]
    cases = [
        not_equivalent if v == "not equivalent" else _no_verdict(equivalent, v) for v in verdicts
    ]
    report = _with_cases(real_report, cases, exit_code=code)
    assert main(["report", _write(tmp_path, report)]) == code
    assert main(["report", _write(tmp_path, report), "--exit-zero"]) == 0


def test_the_cases_are_judged_not_the_recorded_code(real_report, tmp_path):
    """A report whose summary says 0 but holds a case not as expected (edited, or merged from
    several runs by hand): the gate trusts the cases."""
    report = copy.deepcopy(real_report)
    report["summary"]["exit_code"] = 0
    assert main(["report", _write(tmp_path, report)]) == 1


def test_an_interrupted_runs_report_exits_with_its_recorded_code(real_report, tmp_path, capsys):
    """Every case that finished went as expected, but the run never ended: its report is no pass."""
    report = _with_cases(real_report, real_report["cases"][:1], exit_code=130)
    report["interrupted"] = {"signal": "SIGINT", "cases_finished": 1, "cases_planned": 2}
    path = _write(tmp_path, report)
    assert main(["report", path]) == 130
    err = capsys.readouterr().err
    assert "interrupted by SIGINT after 1 of 2 case(s)" in err and "exit 130" in err
    assert main(["report", path, "--exit-zero"]) == 0
    report["summary"]["exit_code"] = 0  # edited by hand: the signal it names still says 143
    report["interrupted"]["signal"] = "SIGTERM"
    assert main(["report", _write(tmp_path, report)]) == 143


def test_a_file_that_is_not_a_report_is_still_2_with_exit_zero(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something/2"}')
    assert main(["report", str(bad), "--exit-zero"]) == 2
    assert "something/2" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.json"), "--exit-zero"]) == 2
    assert "cannot read the report" in capsys.readouterr().err


def test_the_process_exits_with_the_verdict(real_report, tmp_path):
    """Through the `tpcheck` entry point, as CI runs it (the code is the process's)."""
    path = _write(tmp_path, real_report)
    for extra, code in (([], 1), (["--exit-zero"], 0)):
        proc = subprocess.run(
            [sys.executable, "-m", "tpcheck", "report", path, *extra],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert proc.returncode == code, proc.stderr
        assert "Traceback" not in proc.stderr
