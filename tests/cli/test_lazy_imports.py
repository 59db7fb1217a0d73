"""`tpcheck --help` imports no command, `tpcheck faults --help` only `faults`, and neither imports
torch of the CLI's own. Each check runs in a fresh interpreter (this one has imported everything).

torch is still loaded by `tpcheck --help` as a user runs it, for two reasons outside the CLI's
commands: `tpcheck/__init__.py` re-exports the public API (`tpcheck.checker.case` imports torch),
and `entry()` keeps the process to one thread (`torch.set_num_threads(1)`) before `main` runs. So
the torch check stands the package's `__init__` aside (a bare `tpcheck` package on the same path):
it shows what `main` itself imports; `test_help_through_the_package_imports_no_torch` takes over
once the package's `__init__` is lazy."""

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
