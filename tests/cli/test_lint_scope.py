"""`make lint` (and so `make test`) lints the project's own trees only: a case file a user writes in
the clone (`tpcheck new my_case.py`, as README's Install does) is theirs. Run in a copy of the
repository with such a file beside it, holding an unused import and a long line: green; the same
mistakes in a file of the project's trees: red, naming it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paths import REPO

VENV = Path(sys.prefix)
USER_FILE = "import os\n\nX = '" + "x" * 120 + "'\n"


def _copy(tmp_path: Path) -> Path:
    """The tracked files of the repository (as a clone has them), in `tmp_path`/repo."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    dest = tmp_path / "repo"
    for rel in filter(None, listed):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    # older than the venv's stamp: `make` must not reinstall the venv it is handed
    os.utime(dest / "pyproject.toml", (0, 0))
    return dest


def _lint(repo: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", "lint", f"VENV={VENV}"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def repo(tmp_path):
    if shutil.which("make") is None or shutil.which("git") is None:
        pytest.skip("make and git are needed to run `make lint` in a copy of the repository")
    if not (VENV / ".installed-stamp").exists() or not (VENV / "bin" / "ruff").exists():
        pytest.skip(f"{VENV} is not the venv `make` builds (no .installed-stamp or ruff)")
    return _copy(tmp_path)


def test_a_users_own_file_in_the_clone_is_not_linted(repo):
    (repo / "my_case.py").write_text(USER_FILE)
    done = _lint(repo)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "my_case.py" not in done.stdout + done.stderr


def test_the_same_mistakes_in_the_projects_trees_are_caught(repo):
    """The scope is the project's trees, not nothing: the file moved into examples/ fails lint."""
    (repo / "examples" / "my_case.py").write_text(USER_FILE)
    done = _lint(repo)
    assert done.returncode != 0
    assert "examples/my_case.py" in done.stdout + done.stderr
