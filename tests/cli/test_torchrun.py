"""`tpcheck torchrun TORCHRUN_ARGS -- COMMAND`: torchrun's launcher in-process, a non-zero verdict
said in one line per outcome (no ChildFailedError traceback, no "Root Cause" box), the exit code by
the rule. The quick tests start no processes (the launcher is replaced where a launch would start
ranks); the slow ones run the real command on two ranks."""

import json
import logging
import signal
import subprocess
import sys

import pytest

from tpcheck import cli
from tpcheck import torchrun as tr

from paths import REPO

CASE = REPO / "examples" / "own_module.py"
NOT_EQUIVALENT_LINE = (
    "tpcheck torchrun: ranks [0, 1] exited with code 1 (not equivalent: a case did not go as "
    "expected; the report says which)"
)


# ------------------------------------------------------------------------------ the split


def test_split_at_the_first_separator():
    torchrun_args, command = tr.split_argv(
        ["--nproc_per_node", "2", "--", "verify", "case.py", "--", "x"]
    )
    assert torchrun_args == ["--nproc_per_node", "2"]
    assert command == ["verify", "case.py", "--", "x"]  # a later `--` is the command's own


def test_no_torchrun_arguments_is_allowed():
    assert tr.split_argv(["--", "run", "--world-size", "1"]) == ([], ["run", "--world-size", "1"])


def test_missing_separator_names_the_line_and_the_fix(capsys):
    code = cli.main(["torchrun", "--nproc_per_node", "2", "verify", "case.py", "--world-size", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert (
        "tpcheck torchrun: error: no `--` in `tpcheck torchrun --nproc_per_node 2 "
        "verify case.py --world-size 2`" in err
    )
    assert "put `--` between torchrun's arguments and tpcheck's" in err
    # where it goes
    assert "e.g. `tpcheck torchrun --nproc_per_node 2 -- verify case.py --world-size 2`" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_no_arguments_at_all_is_the_missing_separator(capsys):
    assert cli.main(["torchrun"]) == 2
    err = capsys.readouterr().err
    assert (
        "no `--`" in err
        and "e.g. `tpcheck torchrun --nproc_per_node 2 -- verify case.py --world-size 2`" in err
    )


def test_nothing_after_the_separator(capsys):
    assert cli.main(["torchrun", "--nproc_per_node", "2", "--"]) == 2
    err = capsys.readouterr().err
    assert "nothing after `--`" in err and "name the tpcheck command each rank runs" in err


@pytest.mark.parametrize("word", ["verfy", "--version", "torchrun"])
def test_not_a_command_that_starts_ranks(capsys, word):
    assert cli.main(["torchrun", "--nproc_per_node", "2", "--", word, "case.py"]) == 2
    err = capsys.readouterr().err
    assert (
        f"{word!r} after `--` is not a tpcheck command that starts ranks: give run, verify, hf"
        in err
    )


def test_a_command_that_starts_no_ranks(capsys):
    assert cli.main(["torchrun", "--", "faults", "--json"]) == 2
    err = capsys.readouterr().err
    assert (
        "`faults` after `--` starts no ranks: run it as `tpcheck faults --json`, without torchrun"
        in err
    )


def test_a_bad_flag_of_the_tpcheck_command_is_refused_before_any_rank(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["torchrun", "--nproc_per_node", "2", "--", "verify", "case.py", "--bogus"])
    assert e.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_torchrun_argument_errors_are_its_message_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["torchrun", "--bogus", "3", "--", "verify", "case.py"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("tpcheck torchrun: error: unrecognized arguments: --bogus")
    assert "Traceback" not in err and "usage:" not in err


def test_a_word_before_the_separator_is_not_taken_for_torchrun_script(capsys):
    assert (
        cli.main(["torchrun", "--nproc_per_node", "2", "case.py", "--", "verify", "case.py"]) == 2
    )
    assert "case.py before `--` is not a torchrun option" in capsys.readouterr().err


def test_no_python_is_refused(capsys):
    assert cli.main(["torchrun", "--no-python", "--", "verify", "case.py"]) == 2
    assert (
        "--no-python: each rank runs `python -m tpcheck verify case.py`; drop --no-python"
        in capsys.readouterr().err
    )


def test_the_workers_run_python_dash_m_tpcheck_with_the_command():
    ns = tr.parse_torchrun_args(
        ["--nproc_per_node", "2", "--max-restarts", "0"], ["verify", "c.py", "--json", "r"]
    )
    assert ns.module is True and ns.training_script == "tpcheck"
    assert ns.training_script_args == ["verify", "c.py", "--json", "r"]
    assert ns.nproc_per_node == "2"


def test_a_launch_config_error_is_bad_input(capsys):
    # torchrun's parser takes any --nproc_per_node string;
    # its launch config refuses `foo` before any rank
    assert cli.main(["torchrun", "--nproc_per_node", "foo", "--", "verify", "case.py"]) == 2
    err = capsys.readouterr().err
    assert (
        "tpcheck torchrun: error: Unsupported nproc_per_node value: foo" in err
        and "Traceback" not in err
    )


# ------------------------------------------------------------------------------ help


@pytest.mark.parametrize(
    "argv", [["torchrun", "--help"], ["torchrun", "--nproc_per_node", "2", "-h", "--", "verify"]]
)
def test_help_has_the_examples(capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tpcheck torchrun")
    assert "examples:" in out and "tpcheck torchrun --nproc_per_node 2 -- verify case.py" in out


def test_listed_in_tpcheck_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "torchrun" in capsys.readouterr().out


# ------------------------------------------------------------------------------ the exit-code rule


@pytest.mark.parametrize(
    "codes, expected",
    [
        ({}, 0),
        ({0: 1, 1: 1}, 1),
        ({0: 2, 1: 2}, 2),
        ({0: 3, 1: 3}, 3),
        ({0: 1, 1: 2}, 2),  # bad input first: the user's to fix
        ({0: 3, 1: 2}, 2),
        ({0: 1, 1: 3}, 3),
        ({0: 1, 1: -11}, 3),  # a rank died of SIGSEGV: no verdict
        ({0: 1, 1: 130}, 3),  # a rank interrupted by SIGINT
        ({0: 1, 1: 7}, 3),  # a code tpcheck does not use
        ({0: 1, 1: -15}, 1),  # torchrun stopped rank 1 once rank 0 had exited 1
        ({0: 2, 1: -9}, 2),
        ({0: 1, 1: 143}, 1),  # ... which caught the SIGTERM and exited 143
        ({0: -15, 1: -15}, 3),  # every rank stopped: nobody said anything
        ({0: 143}, 3),
    ],
)
def test_exit_code_rule(codes, expected):
    assert tr.exit_code(codes) == expected


def test_one_line_per_distinct_outcome():
    lines = tr.outcome_lines({1: 1, 0: 1, 3: -11, 2: 2})
    assert lines == [
        "tpcheck torchrun: rank 3 killed by SIGSEGV (no verdict: the rank ended before saying one)",
        NOT_EQUIVALENT_LINE,
        (
            "tpcheck torchrun: rank 2 exited with code 2 (bad input: the ranks' message "
            "above names the value and the fix)"
        ),
    ]


def test_a_stopped_rank_is_said_as_stopped_only_next_to_a_rank_that_said_something():
    assert (
        tr.outcome_lines({0: 1, 1: -15})[1]
        == "tpcheck torchrun: rank 1 stopped by torchrun (SIGTERM) once another rank had exited"
    )
    assert tr.outcome_lines({0: -15}) == [
        "tpcheck torchrun: rank 0 killed by SIGTERM (no verdict: the rank ended before saying one)"
    ]


# -------------------------------------------------------------------- the launch, torchrun replaced


@pytest.fixture
def elastic_records():
    """The records that reach the handlers of torchrun's
    worker-process logger (after its filters)."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    import torch.distributed.run  # noqa: F401 - torchrun's loggers exist

    handler = Keep()
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _fake_run(monkeypatch, behaviour):
    import torch.distributed.run

    monkeypatch.setattr(torch.distributed.run, "run", behaviour)


def test_failed_ranks_are_said_in_one_line_and_torchrun_failure_log_is_dropped(
    monkeypatch, capsys, elastic_records
):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def run(ns):
        assert ns.training_script_args == ["verify", "case.py"]
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").error(
            "failed (exitcode: 1) local_rank: 0"
        )
        failures = {
            r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=1, error_file="<N/A>")
            for r in (0, 1)
        }
        raise ChildFailedError(name="tpcheck", failures=failures)

    _fake_run(monkeypatch, run)
    code = cli.main(["torchrun", "--nproc_per_node", "2", "--", "verify", "case.py"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().splitlines() == [NOT_EQUIVALENT_LINE]
    assert elastic_records == []  # its failure record held back, then dropped
    # afterwards the logger is as it was: nothing held any more
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").error("after")
    assert [r.getMessage() for r in elastic_records] == ["after"]


def test_other_torchrun_errors_are_one_line_exit_3_with_its_records_let_through(
    monkeypatch, capsys, elastic_records
):
    def run(ns):
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").error(
            "rendezvous went wrong"
        )
        raise RuntimeError("rendezvous timed out")

    _fake_run(monkeypatch, run)
    assert cli.main(["torchrun", "--", "verify", "case.py"]) == 3
    err = capsys.readouterr().err
    assert (
        "tpcheck torchrun: error: torchrun stopped before the ranks finished: "
        "RuntimeError: rendezvous timed out" in err
    )
    assert [r.getMessage() for r in elastic_records] == ["rendezvous went wrong"]


def test_a_signal_to_the_launcher_exits_128_plus_it(monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def run(ns):
        raise SignalException("Process got signal: 15", sigval=signal.SIGTERM)

    _fake_run(monkeypatch, run)
    assert cli.main(["torchrun", "--", "verify", "case.py"]) == 143
    assert (
        "tpcheck torchrun: interrupted by SIGTERM: torchrun stopped every rank"
        in capsys.readouterr().err
    )


def test_a_normal_return_is_exit_0(monkeypatch, capsys):
    _fake_run(monkeypatch, lambda ns: None)
    assert cli.main(["torchrun", "--nproc_per_node", "2", "--", "verify", "case.py"]) == 0
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------ real launches


def _tpcheck_torchrun(tmp_path, *verify_args):
    report = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-m",
        "tpcheck",
        "torchrun",
        "--nproc_per_node",
        "2",
        "--",
        "verify",
        *verify_args,
        "--world-size",
        "2",
        "--steps",
        "1",
        "--json",
        str(report),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    verdicts = (
        {c["name"]: c["verdict"] for c in json.loads(report.read_text())["cases"]}
        if report.exists()
        else None
    )
    return proc, verdicts


@pytest.mark.slow
def test_a_buggy_case_exits_1_with_one_line_and_no_torchrun_traceback(tmp_path):
    proc, verdicts = _tpcheck_torchrun(tmp_path, f"{CASE}:correct", f"{CASE}:buggy")
    assert proc.returncode == 1, proc.stderr
    assert verdicts == {
        "own_mlp/tp2/float32": "equivalent",
        "own_mlp_bias_before_reduce/tp2/float32": "not equivalent",
    }
    assert NOT_EQUIVALENT_LINE in proc.stderr.splitlines()
    for text in ("Traceback", "ChildFailedError", "Root Cause", "failed (exitcode"):
        assert text not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_correct_cases_exit_0(tmp_path):
    proc, verdicts = _tpcheck_torchrun(tmp_path, f"{CASE}:correct", "--dtype", "float32", "float64")
    assert proc.returncode == 0, proc.stderr
    assert verdicts == {"own_mlp/tp2/float32": "equivalent", "own_mlp/tp2/float64": "equivalent"}
    assert "tpcheck torchrun:" not in proc.stderr and "Traceback" not in proc.stderr
