"""What `pip install` gives a user without the repository: the case-file template and the report
schema inside the package, the examples and docs the README points to under
<prefix>/share/tpcheck."""

import subprocess
import sys
import zipfile

import pytest

from paths import REPO


def test_the_wheel_ships_the_template_schema_examples_and_docs(tmp_path):
    pytest.importorskip(
        "setuptools", reason="building the wheel needs setuptools in this environment"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-build-isolation",
            "--no-deps",
            str(REPO),
            "-w",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("tpcheck-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"tpcheck/templates/case.py", "tpcheck/report/schema.json"} <= names
    shared = {n.split("/share/tpcheck/", 1)[1] for n in names if "/share/tpcheck/" in n}
    examples = {p.name for p in (REPO / "examples").glob("*.py")}
    docs = {p.name for p in (REPO / "docs").glob("*.md")}
    assert {f"examples/{e}" for e in examples} | {f"docs/{d}" for d in docs} <= shared
