"""`tpcheck report`: a JSON report read back, checked against the shipped schema, its summary
printed and, with --html, rendered."""

from __future__ import annotations

import argparse
import json
import sys

from tpcheck.cli.common import exit_after_outputs
from tpcheck.cli.execute import write_outputs
from tpcheck.errors import UsageError
from tpcheck.report.console import print_summary
from tpcheck.report.output import check_output_path
from tpcheck.report.schema import SCHEMA, load_schema
from tpcheck.report.validate import first_error

EPILOG = """examples:
  tpcheck report r.json --html r.html"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument(
        "result", metavar="RESULT.json", help="a report written by `tpcheck run --json`"
    )
    parser.add_argument(
        "--html", dest="html_path", metavar="PATH", help="write the HTML report here"
    )


def main(args: argparse.Namespace) -> int:
    """Read a JSON report, checked against the shipped schema (the first error: exit 2), print its
    summary and optionally render it as HTML."""
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
    return exit_after_outputs(write_outputs(report, {"--html": args.html_path}, quiet=False), 0)
