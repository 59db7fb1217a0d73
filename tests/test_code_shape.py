"""The code stays readable: no module of src/tpcheck over 600 lines, no function or method in
`tpcheck.checker` over 60 lines, and the engine (`Engine` in checker/rank/engine.py) not over 300:
it is the step loop over stages, each a module beside it that receives the case's `Sides`
(sides.py) and never the engine (the layering test's rule 5).

Read from source with `ast` (nothing is imported). A function's length is `end_lineno - lineno + 1`
of its `def` (decorators excluded, its docstring, comments and nested functions included); a class's
the same of its `class` statement. The tests below the rules run the same measuring function on fake
sources written to tmp_path, so a measurer that stopped seeing long functions would fail them.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKER = REPO / "src" / "tpcheck" / "checker"
ENGINE = CHECKER / "rank" / "engine.py"

SRC = REPO / "src" / "tpcheck"

MAX_FUNCTION = 60
MAX_ENGINE = 300
MAX_MODULE = 600  # a module over this does more than one job: split it by job


def _length(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def long_functions(root: Path, limit: int = MAX_FUNCTION) -> list[str]:
    """Every function or method (nested ones included) in the .py files under `root` longer than
    `limit` lines, as "path:line name (N lines)", path relative to `root`'s parent."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _length(node) > limit:
                out.append(
                    f"{path.relative_to(root.parent)}:{node.lineno} {node.name} "
                    f"({_length(node)} lines)"
                )
    return out


def long_modules(root: Path, limit: int = MAX_MODULE) -> list[str]:
    """Every .py file under `root` of more than `limit` lines, as "path (N lines)", path relative
    to `root`'s parent."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if (n := len(path.read_text().splitlines())) > limit:
            out.append(f"{path.relative_to(root.parent)} ({n} lines)")
    return out


def long_class(path: Path, name: str, limit: int) -> str | None:
    """ "path:line name (N lines)" when class `name` in `path` is longer than `limit` lines, else
    None; a class that is not there is an offender too (the rule would otherwise
    pass by a rename)."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return (
                f"{path}:{node.lineno} {name} ({_length(node)} lines)"
                if _length(node) > limit
                else None
            )
    return f"{path}: no class {name}"


# ------------------------------------------------------------------------------------ the rules


def test_no_function_in_the_checker_is_over_60_lines():
    offenders = long_functions(CHECKER)
    assert not offenders, f"functions over {MAX_FUNCTION} lines (split them):\n" + "\n".join(
        offenders
    )


def test_no_source_module_is_over_600_lines():
    offenders = long_modules(SRC)
    assert not offenders, f"modules over {MAX_MODULE} lines (split them by job):\n" + "\n".join(
        offenders
    )


def test_the_engine_is_the_step_loop_at_most_300_lines():
    offender = long_class(ENGINE, "Engine", MAX_ENGINE)
    assert offender is None, (
        f"{offender}: over {MAX_ENGINE} lines; move what it calls into a module beside it"
    )


# ------------------------------------------------------------------------------------ the measurer


def _function(name: str, lines: int, indent: str = "") -> str:
    """A function of exactly `lines` lines: the def, then `lines - 1` statements."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))
    return f"{indent}def {name}():\n{body}"


def test_a_61_line_function_is_reported_with_its_file_and_line(tmp_path):
    pkg = tmp_path / "fake"
    pkg.mkdir()
    (pkg / "ok.py").write_text(_function("fits", 60))
    (pkg / "long.py").write_text('"""A module."""\n\n\n' + _function("too_long", 61))
    assert long_functions(pkg) == ["fake/long.py:4 too_long (61 lines)"]


def test_a_long_method_or_nested_function_is_reported_and_decorators_do_not_count(tmp_path):
    pkg = tmp_path / "fake"
    pkg.mkdir()
    decorated = "import functools\n\n\n" + "@functools.cache\n" * 5 + _function("decorated", 60)
    (pkg / "decorated.py").write_text(decorated)
    (pkg / "method.py").write_text("class C:\n" + _function("method", 61, indent="    "))
    (pkg / "nested.py").write_text(
        "def outer():\n" + _function("inner", 61, indent="    ") + "    return inner\n"
    )
    assert long_functions(pkg) == [
        "fake/method.py:2 method (61 lines)",
        "fake/nested.py:1 outer (63 lines)",
        "fake/nested.py:2 inner (61 lines)",
    ]


def test_a_601_line_module_is_reported(tmp_path):
    pkg = tmp_path / "fake"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "ok.py").write_text("x = 1\n" * 600)
    (pkg / "sub" / "long.py").write_text("x = 1\n" * 601)
    assert long_modules(pkg) == ["fake/sub/long.py (601 lines)"]


def test_a_long_class_is_reported_and_a_missing_one_too(tmp_path):
    src = tmp_path / "engine.py"
    src.write_text("class Engine:\n" + "".join(f"    x{i} = {i}\n" for i in range(451)))
    assert long_class(src, "Engine", 450) == f"{src}:1 Engine (452 lines)"
    assert long_class(src, "Engine", 452) is None
    assert long_class(src, "Other", 450) == f"{src}: no class Other"
