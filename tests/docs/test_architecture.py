"""docs/architecture.md names the package as it is: every module and package it names exists, and
every sub-package is named.

A name is a path token: words joined by '/', ending in `.py`, `.sh`, `.md`, `.json` or '/'
(`checker/rank/engine.py`, `pool/`, `case.py`); `forward/backward` is none. Where each must be:

1. `src/...` and `tests/...`, `benchmarks/...`, `examples/...`, `docs/...`: that path in the
   repository; `tpcheck/...`: that path under `src/`;
2. a path whose first word is a sub-package's name (`checker/plan_rules.py`, `pool/`, `rank/`): that
   path under a package of that name (`pool/` is `checker/pool/`);
3. a single `name.py` or `name/`: a module, or a directory, of that name anywhere in the package;
4. in a module table (`| module | job |`), each `name.py` of the first column: in the package the
   prose above the table names last (`rank/` — one case on one rank: is `checker/rank/`).

Every sub-package (a directory with `__init__.py`) under src/tpcheck must be named: its name as a
directory of some path token (`repair/`, `checker/pool/`, `adapters/dtensor.py` names `adapters`).
A failure lists each stale name with its line, and each package the doc does not name.
"""

from __future__ import annotations

import re
from pathlib import Path

from paths import REPO

DOC = REPO / "docs" / "architecture.md"
PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+(?:\.py|\.sh|\.md|\.json|/))(?![\w./-])")
REPO_ROOTS = {"src", "tests", "benchmarks", "examples", "docs"}
MODULE_TABLE = re.compile(r"\|\s*module\s*\|")


def packages(src: Path) -> list[Path]:
    """Every sub-package of the package at `src` (not `src` itself)."""
    return sorted(p.parent for p in src.rglob("__init__.py") if p.parent != src)


def found(token: str, repo: Path, src: Path) -> bool:
    """Whether path token `token` names a module, file or directory that exists (rules 1-3)."""
    is_dir = token.endswith("/")
    parts = token.rstrip("/").split("/")

    def there(path: Path) -> bool:
        return path.is_dir() if is_dir else path.is_file()

    if parts[0] in REPO_ROOTS:
        return there(repo / token)
    if parts[0] == src.name:
        return there(src.parent / token)
    if len(parts) == 1:
        return any(there(p) for p in src.rglob(parts[0]))
    return any(there(d.parent / token) for d in packages(src) if d.name == parts[0])


def package_dir(token: str, src: Path) -> Path | None:
    """The one directory of the package a table's prose names (`rank/`), else None."""
    parts = token.rstrip("/").split("/")
    if parts[0] == src.name:
        parts = parts[1:]
    if not parts:
        return src
    dirs = [d for d in packages(src) if d.parts[-len(parts) :] == tuple(parts)]
    return dirs[0] if len(dirs) == 1 else None


def problems(doc: str, repo: Path) -> list[str]:
    """The stale names of `doc` (an architecture page) and the packages under repo/src/tpcheck it
    does not name, as lines to print."""
    src = repo / "src" / "tpcheck"
    out, named, last_package, table_package = [], set(), None, None
    for number, line in enumerate(doc.splitlines(), 1):
        checked = line
        if line.startswith("#"):
            last_package = None
        if not line.lstrip().startswith("|"):
            table_package = None
        elif table_package is None and MODULE_TABLE.match(line.strip()):
            table_package = last_package or ("the prose above", None)
        elif table_package is not None:  # a module table's row: its first cell, in its package
            first, _, checked = line.strip().strip("|").partition("|")
            owner, where = table_package
            for module in PATH.findall(first):
                named.update(module.rstrip("/").split("/")[:-1])
                if where is None:
                    out.append(f"line {number}: `{module}`: no package named above the table")
                elif not (where / module).exists():
                    out.append(
                        f"line {number}: `{module}` is no module of {owner} "
                        f"({where.relative_to(repo)})"
                    )
        for token in PATH.findall(checked):
            parts = token.rstrip("/").split("/")
            named.update(parts if token.endswith("/") else parts[:-1])
            if not found(token, repo, src):
                out.append(f"line {number}: `{token}` names nothing under src/tpcheck or the repo")
            elif token.endswith("/") and (where := package_dir(token, src)) is not None:
                last_package = (token, where)
    for package in packages(src):
        if package.name not in named:
            rel = package.relative_to(repo)
            out.append(f"{rel}/ is a package the doc does not name (as `{package.name}/`)")
    return out


def test_the_architecture_names_the_package_as_it_is():
    found_problems = problems(DOC.read_text(), REPO)
    assert not found_problems, "docs/architecture.md against src/tpcheck:\n" + "\n".join(
        found_problems
    )


def _fake_repo(tmp_path: Path) -> Path:
    src = tmp_path / "src" / "tpcheck"
    for package in ("checker", "checker/rank", "adapters", "repair"):
        (src / package).mkdir(parents=True)
        (src / package / "__init__.py").write_text("")
    for module in ("plan.py", "checker/case.py", "checker/rank/engine.py", "adapters/dtensor.py"):
        (src / module).write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_plan.py").write_text("")
    return tmp_path


FAKE_DOC = """# Architecture

```
  checker/   adapters/   repair/   plan.py
     case.py
```

`plan.py` is the seam; `adapters/dtensor.py` holds one adapter; tests/test_plan.py tests it;
forward/backward pairs are no path.

`rank/` — one case on one rank:

| module | job |
|---|---|
| `engine.py` | the step loop |
"""


def test_a_faithful_fake_architecture_has_no_problem(tmp_path):
    assert problems(FAKE_DOC, _fake_repo(tmp_path)) == []


def test_stale_names_and_unnamed_packages_are_reported(tmp_path):
    repo = _fake_repo(tmp_path)
    (repo / "src" / "tpcheck" / "report").mkdir()
    (repo / "src" / "tpcheck" / "report" / "__init__.py").write_text("")
    doc = (
        FAKE_DOC.replace("`adapters/dtensor.py`", "`adapters/megatron.py`")
        .replace("   repair/", "   seed.py")
        .replace("| `engine.py` |", "| `engine.py`, `sides.py` |")
    )
    assert problems(doc, repo) == [
        "line 4: `seed.py` names nothing under src/tpcheck or the repo",
        "line 8: `adapters/megatron.py` names nothing under src/tpcheck or the repo",
        "line 15: `sides.py` is no module of rank/ (src/tpcheck/checker/rank)",
        "src/tpcheck/repair/ is a package the doc does not name (as `repair/`)",
        "src/tpcheck/report/ is a package the doc does not name (as `report/`)",
    ]


def test_a_module_renamed_into_a_package_is_reported_both_ways(tmp_path):
    repo = _fake_repo(tmp_path)
    adapters = repo / "src" / "tpcheck" / "adapters"
    (adapters / "dtensor.py").unlink()
    (adapters / "dtensor").mkdir()
    (adapters / "dtensor" / "__init__.py").write_text("")
    assert problems(FAKE_DOC, repo) == [
        "line 8: `adapters/dtensor.py` names nothing under src/tpcheck or the repo",
        "src/tpcheck/adapters/dtensor/ is a package the doc does not name (as `dtensor/`)",
    ]
