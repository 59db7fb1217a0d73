"""`tpcheck --help` imports no command, `tpcheck faults --help` only `faults`, and none imports
torch: not the CLI's own modules, not the package's `__init__` (its public API re-exported lazily),
not the `tpcheck` command's entry (the process is kept to one thread once the arguments are read).
Each check runs in a fresh interpreter (this one has imported everything)."""

import json
import subprocess
import sys

import pytest

from paths import REPO

PACKAGE_DIR = REPO / "src" / "tpcheck"
BARE_PACKAGE = f"""
import types
bare = types.ModuleType("tpcheck")
bare.__path__ = [{str(PACKAGE_DIR)!r}]
sys.modules["tpcheck"] = bare  # tpcheck/__init__.py does not run
"""
HELP = """
import json, sys
{setup}
from tpcheck.cli import main
for argv in {argvs!r}:
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
print(json.dumps({{"torch": "torch" in sys.modules,
                   "cli": sorted(m for m in sys.modules if m.startswith("tpcheck.cli."))}}))
"""
LIGHT = ["tpcheck.cli.common", "tpcheck.cli.parser"]  # what `tpcheck.cli` itself imports


def _imported(*argvs: list[str], bare: bool = False) -> dict:
    """{"torch": imported?, "cli": the tpcheck.cli modules imported} after main(argv), each argv
    in turn, in a fresh interpreter."""
    code = HELP.format(setup=BARE_PACKAGE if bare else "", argvs=list(argvs))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_help_imports_no_command():
    assert _imported(["--help"])["cli"] == LIGHT


def test_a_commands_help_imports_that_command_alone():
    assert _imported(["faults", "--help"])["cli"] == sorted([*LIGHT, "tpcheck.cli.faults"])
    run = _imported(["run", "--help"])["cli"]
    assert "tpcheck.cli.run" in run and not {"tpcheck.cli.verify", "tpcheck.cli.hf"} & set(run)


def test_help_and_faults_help_import_no_torch_of_the_clis_own():
    assert _imported(["--help"], ["faults", "--help"], ["torchrun", "--help"], bare=True) == {
        "torch": False,
        "cli": sorted([*LIGHT, "tpcheck.cli.faults", "tpcheck.cli.torchrun"]),
    }


def test_help_through_the_package_imports_no_torch():
    code = "import sys, tpcheck; print('torch' in sys.modules)"
    package = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    if package.stdout.strip() == "True":
        pytest.skip(
            "tpcheck/__init__.py imports torch (it re-exports check, Case, RunSettings, "
            "...): `tpcheck --help` loads it before the CLI runs"
        )
    assert _imported(["--help"], ["faults", "--help"])["torch"] is False


def test_the_tpcheck_command_help_imports_no_torch():
    """The command as a user runs it (`python -m tpcheck`, the same `entry()` as the console
    script): Python's own import log of `--help` and `faults --help` names no torch module."""
    for argv in (["--help"], ["faults", "--help"]):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "tpcheck", *argv],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
        assert "tpcheck.cli" in imported  # the log is read
        assert not [m for m in imported if m == "torch" or m.startswith("torch.")], argv


def test_the_package_still_gives_every_public_name():
    """Lazy, not less: every name of `tpcheck.__all__` resolves, to the object its module
    defines."""
    code = (
        "import importlib, tpcheck\n"
        "for n in tpcheck.__all__:\n"
        "    v = getattr(tpcheck, n)\n"
        "    assert v is not None, n\n"
        "from tpcheck import Case, check\n"
        "from tpcheck.checker.case import Case as C\n"
        "assert Case is C and callable(check)\n"
        "print('ok')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
