"""Signals and leftovers, through the real command in a child process: SIGINT (as a terminal's
Ctrl-C sends it, to the foreground process group), SIGTERM and SIGHUP stop every rank, write a
partial report marked `interrupted`, exit 128 + the signal, print no traceback, and leave no process
and no temp dir (pool stores, torch's compile cache); a second Ctrl-C exits at once, leaving nothing
either. Processes spawned by the code under test die with its rank; a closed stderr never leaks the
summary into stdout."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

RUNTIME = os.path.join(os.path.dirname(__file__), "case_files", "runtime.py")
WAIT_S = 120  # a bound for the test itself (the child normally finishes in seconds)


def _env(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    mark = uuid.uuid4().hex
    env = dict(os.environ, TMPDIR=str(tmp), TPCHECK_TEST_MARK=mark)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    return env, tmp, mark


def _marked(mark: str) -> list[int]:
    """Processes (other than zombies reaped by nobody
    yet) whose environment carries the test's mark."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if f"TPCHECK_TEST_MARK={mark}".encode() not in f.read():
                    continue
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        out.append(int(d))
    return out


def _none_left(mark: str) -> bool:
    """True once no process carries the mark; a process SIGKILLed just before its parent exited may
    take a moment to go (bounded wait, for the kernel, not a timing assertion)."""
    deadline = time.monotonic() + WAIT_S
    while _marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _marked(mark) == []


def _start(tmp_path, *targets, world=2):
    env, tmp, mark = _env(tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "tpcheck",
        "verify",
        *[f"{RUNTIME}:{t}" for t in targets],
        "--world-size",
        str(world),
        "--timeout",
        "60",
        "--json",
        str(tmp_path / "report.json"),
    ]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=tmp_path,
    )
    return proc, tmp, mark


def _wait_for_first_case(proc) -> list[str]:
    """Read stderr until the first case is reported (one progress line per case off a terminal)."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("[1/"):
            return lines
    raise AssertionError("the run ended before its first case was reported:\n" + "".join(lines))


@pytest.mark.parametrize(
    "sig",
    [
        signal.SIGINT,
        pytest.param(signal.SIGTERM, marks=pytest.mark.slow),
        pytest.param(signal.SIGHUP, marks=pytest.mark.slow),
    ],
)
def test_a_signal_stops_the_run_and_keeps_what_finished(tmp_path, sig):
    proc, tmp, mark = _start(tmp_path, "ok", "sleeps")  # the second case sleeps 600 s on every rank
    seen = _wait_for_first_case(proc)
    if sig == signal.SIGINT:
        # what a terminal's Ctrl-C does: the whole foreground process group
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=WAIT_S)
    err = "".join(seen) + err
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err
    assert f"interrupted by {sig.name} after 1 of 2 case(s)" in err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["interrupted"] == {"signal": sig.name, "cases_finished": 1, "cases_planned": 2}
    assert report["summary"]["exit_code"] == 128 + sig
    assert [c["verdict"] for c in report["cases"]] == ["equivalent"]
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "tpcheck",
            "report",
            str(tmp_path / "report.json"),
            "--html",
            str(tmp_path / "report.html"),
        ],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    # the partial report is valid, and as a gate it exits with the interrupted run's code
    assert shown.returncode == 128 + sig and "1 of 1 case(s) as expected" in shown.stderr
    assert (
        f"interrupted by {sig.name} after 1 of 2 case(s)" in (tmp_path / "report.html").read_text()
    )
    assert os.listdir(tmp) == []  # no pool store, no compile cache
    assert _none_left(mark)  # no rank left


def test_a_second_ctrl_c_exits_at_once_and_leaves_nothing(tmp_path):
    proc, tmp, mark = _start(tmp_path, "ok", "sleeps")
    _wait_for_first_case(proc)
    os.killpg(proc.pid, signal.SIGINT)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert os.listdir(tmp) == []
    assert _none_left(mark)


@pytest.mark.slow
def test_processes_spawned_by_the_code_under_test_die_with_its_rank(tmp_path):
    proc, tmp, mark = _start(tmp_path, "spawns")
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    assert _none_left(mark)
    # torch's torchinductor_<user> cache went to a private dir, removed
    assert os.listdir(tmp) == []


def test_closed_stderr_keeps_stdout_pure_json(tmp_path):
    env, tmp, _ = _env(tmp_path)
    cmd = f"{sys.executable} -m tpcheck run --mode equivalence --world-size 2 2>&-"
    done = subprocess.run(
        cmd, shell=True, env=env, stdout=subprocess.PIPE, text=True, timeout=WAIT_S, cwd=tmp_path
    )
    assert done.returncode == 0
    assert json.loads(done.stdout)["mode"] == "equivalence"
