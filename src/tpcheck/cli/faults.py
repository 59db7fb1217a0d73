"""`tpcheck faults`: the fault catalogue, as text or JSON."""

from __future__ import annotations

import argparse
import json

from tpcheck.cli.common import write_stdout
from tpcheck.errors import UsageError

EPILOG = """examples:
  tpcheck faults
  tpcheck faults --json | python -m json.tool"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--json", action="store_true", help="as JSON")


def main(args: argparse.Namespace) -> int:
    # here, not at the top: the catalogue imports torch, which `tpcheck faults --help` does not need
    from tpcheck.faults import CATALOGUE

    rows = [
        {
            "name": f.name,
            "bug_class": f.bug_class,
            "where": f.where,
            "expected_stage": f.expected_stage,
            "expected_signature": f.expected_signature,
            "blocks": list(f.blocks),
            "world_sizes": list(f.worlds),
            "sequence_parallel": f.sequence_parallel,
            "dtypes": list(f.dtypes),
        }
        for f in CATALOGUE.values()
    ]
    if args.json:
        text = json.dumps(rows, indent=2) + "\n"
    else:
        text = "".join(
            f"{r['name']:<32} [{', '.join(r['blocks'])}] {r['bug_class']}\n{'':<32} "
            f"injected: {r['where']}; expected: {r['expected_signature']} in "
            f"{r['expected_stage']}; dtypes: {', '.join(r['dtypes'])}\n"
            for r in rows
        )
    problem = write_stdout(text)
    if problem:
        raise UsageError(problem)
    return 0
