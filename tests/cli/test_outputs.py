"""Report outputs (`--json`, `--html` of run/verify, `--html` of report): bad paths refused before
any rank starts; regular files replaced atomically with the umask's mode; symlinks written through;
character devices and FIFOs written directly, never replaced; a write that fails after the run (a
full disk, here /dev/full) keeps the other outputs and exits 2 with a message; stdout
on a full disk too."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tpcheck.cli import main

from paths import REPO

INSPECT = ["run", "--mode", "inspect", "-q"]  # writes a report and forks no rank: the fastest run
CASE_FILE = str(REPO / "examples" / "own_module.py") + ":correct"


@pytest.fixture
def no_rank_may_start(monkeypatch):
    """Fail the test if a rank pool is created: bad output paths must be refused before that."""

    def launcher(*args, **kwargs):
        raise AssertionError("a rank pool was created before the output paths were checked")

    monkeypatch.setattr("tpcheck.resolve.launcher", launcher)


@pytest.fixture
def good_report(tmp_path) -> Path:
    """A valid report (the inspect run's: no cases) for `tpcheck report`."""
    path = tmp_path / "good.json"
    assert main([*INSPECT, "--json", str(path)]) == 0
    return path


def char_device(tmp_path: Path, name: str, minor: int) -> Path:
    """A character device like /dev/<name> (mem major 1): made in tmp_path when this process may
    (root), so that a regression that replaces it harms nothing; else the real one, which a non-root
    process cannot replace."""
    path = tmp_path / name
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
        with open(path, "w"):  # usable: not on a nodev mount
            pass
        return path
    except OSError:
        if os.geteuid() == 0:
            pytest.skip(
                "cannot make a device node here, and as root the real one could be replaced"
            )
        return Path("/dev") / name


def _error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tpcheck: error: ") and "Traceback" not in err
    return lines[0]


def _bad_paths(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """{case: (path, words the message must contain)}."""
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("not a directory\n")
    return {
        "empty": ("", "empty path"),
        "directory": (str(tmp_path / "a_dir"), "is a directory"),
        "trailing separator": (
            str(tmp_path / "a_dir" / "new") + os.sep,
            "ends with a path separator",
        ),
        "under a regular file": (str(tmp_path / "a_file" / "r.out"), "not a directory"),
        "missing parent": (str(tmp_path / "no_such_dir" / "r.out"), "does not exist"),
        "in /proc": ("/proc/tpcheck-report.out", "cannot create a file in '/proc'"),
    }


BAD = [
    "empty",
    "directory",
    "trailing separator",
    "under a regular file",
    "missing parent",
    "in /proc",
]
COMMANDS = {  # command line before the output flag, and the output flags it has
    "run": (["run", "--world-size", "1", "-q"], ["--json", "--html"]),
    "verify": (["verify", CASE_FILE, "--world-size", "1", "-q"], ["--json", "--html"]),
    "report": (None, ["--html"]),
}


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize(
    "command, flag", [(c, f) for c, (_, flags) in COMMANDS.items() for f in flags]
)
def test_bad_output_path_exits_2_naming_flag_path_and_problem_before_any_rank(
    command, flag, case, tmp_path, capsys, good_report, no_rank_may_start
):
    path, words = _bad_paths(tmp_path)[case]
    argv = ["report", str(good_report)] if command == "report" else COMMANDS[command][0]
    capsys.readouterr()
    before = sorted(os.listdir(tmp_path))
    assert main([*argv, flag, path]) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"{flag} {path!r}: " in line and words in line, line
    assert sorted(os.listdir(tmp_path)) == before  # no file, no probe, no temp file left


def test_unwritable_directory_is_refused(tmp_path, capsys, no_rank_may_start):
    if os.geteuid() == 0:
        pytest.skip(
            "root may write into a read-only directory (the /proc case covers an unwritable place)"
        )
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        assert main(["run", "--world-size", "1", "--json", str(locked / "r.json")]) == 2
    finally:
        locked.chmod(0o700)
    assert "Permission denied" in _error_line(capsys.readouterr().err)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_regular_files_are_replaced_atomically_with_the_umask_mode(umask, tmp_path):
    new, old = tmp_path / "new.json", tmp_path / "old.html"
    old.write_text("an old report\n")
    old.chmod(0o600)
    saved = os.umask(umask)
    try:
        assert main([*INSPECT, "--json", str(new), "--html", str(old)]) == 0
    finally:
        os.umask(saved)
    assert json.loads(new.read_text())["schema"] == "tpcheck.report/1"
    assert old.read_text().startswith("<!DOCTYPE html>")
    for path in (new, old):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, (path, oct(path.stat().st_mode))
    assert sorted(os.listdir(tmp_path)) == ["new.json", "old.html"]  # no temp file left


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    (tmp_path / "reports").mkdir()
    target = tmp_path / "reports" / "target.json"
    target.write_text("old\n")
    link, dangling = tmp_path / "link.json", tmp_path / "dangling.html"
    link.symlink_to(os.path.join("reports", "target.json"))  # relative, as `ln -s` makes them
    dangling.symlink_to(tmp_path / "reports" / "made.html")
    assert main([*INSPECT, "--json", str(link), "--html", str(dangling)]) == 0
    assert link.is_symlink() and os.readlink(link) == os.path.join("reports", "target.json")
    assert dangling.is_symlink()
    assert json.loads(target.read_text())["schema"] == "tpcheck.report/1"
    assert (tmp_path / "reports" / "made.html").read_text().startswith("<!DOCTYPE html>")
    assert sorted(os.listdir(tmp_path / "reports")) == ["made.html", "target.json"]


def test_a_character_device_is_written_not_replaced(tmp_path, capsys):
    null = char_device(tmp_path, "null", 3)
    before, beside = null.stat(), sorted(os.listdir(null.parent))
    assert main([*INSPECT, "--json", str(null), "--html", str(null)]) == 0
    after = null.stat()
    assert (
        stat.S_ISCHR(after.st_mode)
        and after.st_rdev == before.st_rdev
        and after.st_ino == before.st_ino
    )
    assert sorted(os.listdir(null.parent)) == beside  # no temp file beside it
    assert "Traceback" not in capsys.readouterr().err


def test_a_fifo_is_written_not_replaced(tmp_path):
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    try:
        assert main([*INSPECT, "--json", str(fifo)]) == 0
        out, _ = reader.communicate(timeout=60)
    finally:
        reader.kill()
    assert json.loads(out)["schema"] == "tpcheck.report/1"
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert os.listdir(tmp_path) == ["report.fifo"]


@pytest.mark.parametrize("full_flag, ok_flag", [("--json", "--html"), ("--html", "--json")])
def test_a_full_disk_keeps_the_other_output_and_exits_2(full_flag, ok_flag, tmp_path, capsys):
    """/dev/full is a character device whose writes fail with ENOSPC: the path check passes, the
    write after the run fails, as on a full disk."""
    full = char_device(tmp_path, "full", 7)
    ok = tmp_path / "ok.out"
    assert main(["run", "--mode", "inspect", full_flag, str(full), ok_flag, str(ok)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (
        f"tpcheck: error: {full_flag} {str(full)!r}: cannot write the report: "
        "No space left on device" in err
    )
    assert "the checks alone give exit 0" in err
    assert f"{ok_flag[2:].upper()} report: {ok}" in err and ok.stat().st_size > 0
    assert stat.S_ISCHR(full.stat().st_mode)


def test_report_html_on_a_full_disk_exits_2(tmp_path, capsys, good_report):
    full = char_device(tmp_path, "full", 7)
    assert main(["report", str(good_report), "--html", str(full)]) == 2
    err = capsys.readouterr().err
    assert "--html" in err and "No space left on device" in err and "Traceback" not in err


def _tpcheck_commands() -> list[list[str]]:
    """`python -m tpcheck` and the installed `tpcheck`
    script (they end the interpreter differently)."""
    script = Path(sys.executable).parent / "tpcheck"
    return [[sys.executable, "-m", "tpcheck"]] + ([[str(script)]] if script.exists() else [])


@pytest.mark.parametrize(
    "command",
    [c if len(c) > 1 else pytest.param(c, marks=pytest.mark.slow) for c in _tpcheck_commands()],
    ids=lambda c: "script" if len(c) == 1 else "module",
)
def test_stdout_on_a_full_disk_exits_2_with_a_message_and_keeps_the_report(command, tmp_path):
    full = char_device(tmp_path, "full", 7)
    report = tmp_path / "r.json"
    with open(full, "w") as stdout:
        proc = subprocess.run(
            [*command, "run", "--mode", "inspect", "--json", str(report), "-q"],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        faults = subprocess.run(
            [*command, "faults"],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            cwd=REPO,
        )
    for p in (proc, faults):
        assert p.returncode == 2, p.stderr
        assert "stdout: cannot write: No space left on device" in p.stderr
        assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    assert json.loads(report.read_text())["seed"]["world_size"] == 2
