"""`tpcheck report`: a JSON report read back, checked against the shipped schema, its summary
printed and, with --html, rendered; it exits with the report's verdict code, as the run that wrote
it did, so that CI can gate on a report made elsewhere (--exit-zero: render only, exit 0)."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from tpcheck.checker.verdict.result import exit_code
from tpcheck.cli.common import exit_after_outputs
from tpcheck.cli.execute import write_outputs
from tpcheck.errors import INTERRUPTED_BY, ExitCode, UsageError
from tpcheck.repair import exit_code_after
from tpcheck.report.console import print_summary
from tpcheck.report.output import check_output_path
from tpcheck.report.schema import SCHEMA, load_schema
from tpcheck.report.validate import first_error

EPILOG = """exit code: the report's verdict, as `tpcheck run` gives it (0 every case as expected,
1 some case not, 2 a case invalid, 3 a case errored; an interrupted run's 130, 143 or 129); 2 for
a file that is not a valid report or an output that cannot be written.

examples:
  tpcheck report r.json --html r.html
  tpcheck report r.json --exit-zero     # show it, exit 0 whatever it found"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument(
        "result", metavar="RESULT.json", help="a report written by `tpcheck run --json`"
    )
    parser.add_argument(
        "--html", dest="html_path", metavar="PATH", help="write the HTML report here"
    )
    parser.add_argument(
        "--exit-zero",
        action="store_true",
        help="exit 0 whatever the report's verdicts (a file that is not a valid report, or an "
        "output that cannot be written, is still 2)",
    )


def main(args: argparse.Namespace) -> int:
    """Read a JSON report, checked against the shipped schema (the first error: exit 2), print its
    summary and optionally render it as HTML; exit with its verdict code (`verdict_code`) unless
    --exit-zero."""
    check_output_path("--html", args.html_path)
    try:
        with open(args.result) as f:
            report = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise UsageError(
            f"cannot read the report {args.result!r}: {e}; pass a file from `tpcheck run --json`"
        ) from None
    if isinstance(report, dict) and report.get("schema") != SCHEMA:
        raise UsageError(
            f"{args.result!r} has schema {report.get('schema')!r}, this tpcheck reads {SCHEMA!r}"
        )
    error = first_error(report, load_schema())
    if error:
        raise UsageError(
            f"{args.result!r} is not a valid {SCHEMA} report: at {error}; pass a file "
            "from `tpcheck run --json`"
        )
    print_summary(report["cases"], sys.stderr)
    code = verdict_code(report)
    stop = report.get("interrupted")
    if stop:
        print(
            f"tpcheck report: the run was interrupted by {stop['signal']} after "
            f"{stop['cases_finished']} of {stop['cases_planned']} case(s)",
            file=sys.stderr,
        )
    failed = write_outputs(report, {"--html": args.html_path}, quiet=False)
    if code and not args.exit_zero and not failed:
        print(
            f"tpcheck report: exit {code}, the report's verdict (--exit-zero to exit 0 after "
            "showing it)",
            file=sys.stderr,
        )
    return exit_after_outputs(failed, 0 if args.exit_zero else code)


def verdict_code(report: dict) -> int:
    """The exit code of the run that wrote `report`, from the report itself: the cases judged by
    the one rule `run` and `verify` use (`exit_code`), computed again rather than read from
    `summary.exit_code` so that a gate trusts the cases; except for an interrupted run, whose cases
    are only those that finished: its recorded code (128 + the signal's number), which says the
    run never ended. A run with `--repair` whose every failed case was repaired and verified: 4
    (`exit_code_after`, from the report's repair entries)."""
    stop = report.get("interrupted")
    if not stop:
        return exit_code_after(report, exit_code(report["cases"]))
    recorded = report["summary"]["exit_code"]
    if recorded in INTERRUPTED_BY:
        return recorded
    # a report edited by hand (its recorded code not a signal's): the code of the signal it names
    return ExitCode.interrupted(signal.Signals[stop["signal"]])
