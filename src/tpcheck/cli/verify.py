"""`tpcheck verify`: your own TP code, in case files (docs/case-files.md). A case's settings are its
own; the run-settings flags given override them."""

from __future__ import annotations

import argparse
import itertools
import os

from tpcheck.checker.case import CaseSpec, Target
from tpcheck.checker.casefile import expand_target, file_spec
from tpcheck.checker.pool.launch import DEFAULT_TIMEOUT_S, under_torchrun
from tpcheck.cli import options
from tpcheck.cli.execute import execute
from tpcheck.errors import UsageError

DEFAULTS = options.CASE_OWN
EPILOG = """examples:
  tpcheck verify my_case.py                          # every case in the file, world size 2
  tpcheck verify my_case.py:buggy --world-size 2 4   # one case, two world sizes
  tpcheck verify a.py b.py --dtype bf16 --steps 5 --json r.json
  tpcheck verify my_case.py --device cuda --world-size 2   # on GPUs, one per rank
  tpcheck verify my_case.py --repair                 # insert the missing all-reduce, check again"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("target", nargs="*", help="path/to/case.py or path/to/case.py:NAME")
    # str: `--world-size 2 4 case.py` takes the case file too; main hands it back to the targets
    parser.add_argument(
        "--world-size",
        nargs="+",
        default=None,
        metavar="WORLD_SIZE",
        help="TP world sizes (default: 2)",
    )
    options.add_run_settings(parser, DEFAULTS)
    parser.add_argument(
        "--print-plan",
        action="store_true",
        help="print, on stdout, the plan inferred for each case without one "
        "(Case(plan=None, load_tp=...))",
    )
    parser.add_argument(
        "--repair",
        action="store_true",
        help="for a case diagnosed partial_sum (a missing all-reduce): insert the all-reduce where "
        "the diagnosis points (after the module, on its output's gradient, or on the "
        "parameter's gradient), re-run the full check and say whether it makes it equivalent",
    )
    options.add_device_flag(parser)
    options.add_output_flags(parser)


def main(args: argparse.Namespace) -> int:
    """Case files: the world size is the launcher's; flags given override the Case's own values."""
    options.check_flags(args)
    split_world_sizes_from_targets(args)
    world_sizes = args.world_size or [int(os.environ["WORLD_SIZE"]) if under_torchrun() else 2]
    given = options.given_settings(args)
    targets = []
    for t in args.target:  # a file with several cases: all of them; a broken file: one invalid case
        try:
            targets += expand_target(t)
        except UsageError:
            targets.append(t)
    broken: dict = {}
    specs = [
        target_spec(t, ws, d, given, broken)
        for t, ws, d in itertools.product(targets, world_sizes, options.dtypes(args, DEFAULTS))
    ]
    if len(broken) == len(specs):
        raise next(iter(broken.values()))  # nothing to run: the first problem, exit 2
    if not getattr(args, "repair", False):
        return execute(specs, args)
    if under_torchrun():
        raise UsageError(
            "--repair under torchrun: the repair runs each candidate in a rank pool of its own; "
            "run tpcheck verify --repair without torchrun"
        )

    def finish(report: dict) -> None:
        from tpcheck.repair import run_repairs

        timeout = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout
        report["repair"] = run_repairs(report["cases"], specs, "collective", timeout, args.quiet)

    return execute(specs, args, finish_report=finish)


def split_world_sizes_from_targets(args: argparse.Namespace) -> None:
    """`--world-size 2 4 case.py` puts the case file among the world sizes (argparse cannot tell):
    the integers are world sizes, the rest targets. At least one target is required."""
    sizes, moved = [], []
    for value in args.world_size or []:
        if value.lstrip("+-").isdigit():
            sizes.append(value)
        elif value.endswith(".py") or ".py:" in value:
            moved.append(value)
        else:
            raise UsageError(
                f"--world-size {value}: a world size is a whole number (e.g. --world-size 2 4)"
            )
    args.world_size = [int(v) for v in sizes] or None
    args.target = [*args.target, *moved]
    if not args.target:
        raise UsageError(
            "verify needs a case file: tpcheck verify path/to/case.py[:NAME] (docs/case-files.md)"
        )


def target_spec(target: str, world_size: int, dtype: str | None, given: dict, broken: dict):
    """The spec of one case-file target; for a target that cannot be loaded, a spec that fails again
    (with the same message) when the launcher validates it: one invalid case, the other targets
    still run."""
    try:
        return file_spec(target, world_size, dtype=dtype, **given)
    except UsageError as e:
        spec = CaseSpec(
            block=str(Target("file", target)),
            world_size=world_size,
            label=f"{target}/tp{world_size}",
        )
        broken[spec] = e
        return spec
