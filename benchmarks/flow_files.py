"""How many of tpcheck's source files the two flows of docs/architecture.md cross, measured by
running them (a maintainer follows the same path when reading):

- verify -> verdict: `tpcheck verify examples/own_module.py:buggy --world-size 2 --json ... --html
  ...` in this process; every file of src/tpcheck with a function called in the parent (the CLI, the
  case file, the launch, the merge, the verdict, the diagnosis, the reports), module-level import
  code left out.
- a check -> report: one module output's check (`act:`), in one world-1 case of the same file run
  in this process (no fork): every file of src/tpcheck on the call stack from the capture hook to
  `Comparator.compare` and under it, then the files the parent runs to merge, judge and diagnose the
  checks (`merge`) and to write them (the JSON report, the HTML report); the model's own code (the
  library half) left out.

Prints one line per flow: the count and the files. `python benchmarks/flow_files.py`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import tpcheck

SRC = Path(tpcheck.__file__).resolve().parent


def _ours(filename: str) -> str | None:
    path = Path(filename).resolve()
    return str(path.relative_to(SRC)) if path.is_relative_to(SRC) else None


def trace(fn) -> set[str]:
    """The source files of tpcheck with a function called while `fn` runs (module bodies
    excluded)."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name != "<module>":
            if (rel := _ours(frame.f_code.co_filename)) is not None:
                seen.add(rel)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def verify_flow(out: Path) -> set[str]:
    from tpcheck.cli import main

    example = Path(__file__).resolve().parents[1] / "examples" / "own_module.py"
    argv = [
        "verify",
        f"{example}:buggy",
        "--world-size",
        "2",
        "--json",
        str(out / "r.json"),
        "--html",
        str(out / "r.html"),
        "-q",
    ]
    return trace(lambda: main(argv))


def check_flow(out: Path) -> set[str]:
    """The files on the stacks that make, carry and report one check (world 1, in this process)."""
    from tpcheck.checker.casefile import file_spec
    from tpcheck.checker.rank import compare
    from tpcheck.checker.rank.engine import run_case_on_rank
    from tpcheck.checker.rank.ledger import CollectiveTap
    from tpcheck.checker.sync import Rendezvous
    from tpcheck.checker.verdict.result import merge
    from tpcheck.parallel.group import TPGroup
    from tpcheck.report import html, schema
    from tpcheck.resolve import RESOLVER

    example = Path(__file__).resolve().parents[1] / "examples" / "own_module.py"
    spec = RESOLVER.prepare(file_spec(f"{example}:buggy", 1))
    case = RESOLVER.build(spec)
    stacks: set[str] = set()
    real = compare.Comparator.compare

    def on_stack(self, *args, **kwargs):
        if args[2].kind != "act":  # (stage, step, check_id, ...): one kind of check
            return real(self, *args, **kwargs)
        frame = sys._getframe(1)
        while frame is not None:
            if (rel := _ours(frame.f_code.co_filename)) is not None:
                stacks.add(rel)
            frame = frame.f_back
        return trace_into(lambda: real(self, *args, **kwargs))

    def trace_into(fn):
        result = []
        stacks.update(trace(lambda: result.append(fn())))
        return result[0]

    compare.Comparator.compare = on_stack
    try:
        group = TPGroup(rank=0, world_size=1, tap=CollectiveTap(0))
        payload = run_case_on_rank(case, group, Rendezvous(None, 0, 1, 60.0))
    finally:
        compare.Comparator.compare = real
    result = []
    stacks.update(trace(lambda: result.append(merge(spec, [payload]))))
    report = result[0].to_json()
    stacks.update(trace(lambda: schema.build_report([report], exit_code=1)))
    stacks.update(trace(lambda: html.render_html(schema.build_report([report], exit_code=1))))
    # the rank's set-up and the model's own code are not the check's path
    return {f for f in stacks if not f.startswith(("models/", "parallel/"))}


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as d:
        for label, files in (
            ("verify -> verdict", verify_flow(Path(d))),
            ("a check -> report", check_flow(Path(d))),
        ):
            print(f"{label}: {len(files)} files: {', '.join(sorted(files))}")


if __name__ == "__main__":
    main()
