"""`tpcheck hf`: HuggingFace transformers' own TP plans, architecture by architecture (the sweep
itself is tpcheck/hf.py). Architectures that cannot be checked are rows of the sweep, the others
cases."""

from __future__ import annotations

import argparse
import sys

from tpcheck.checker.pool.spawn import rank_thread_cap
from tpcheck.cli import options
from tpcheck.cli.common import exit_after_outputs, write_stdout
from tpcheck.cli.execute import execute
from tpcheck.errors import UsageError

SWEEP_RANK_THREADS = 1  # intra-op threads of a rank in `tpcheck hf` (see main)
# pools running the sweep's cases side by side: one case's ranks compute while another's wait
# for each other (rank 0's float64 truth, a collective), so the CPUs are not left idle
SWEEP_LANES = 2
DEFAULTS = {"steps": 2}  # optimizer steps per architecture in a sweep; the rest RunSettings' own
EPILOG = """examples:
  tpcheck hf llama qwen3 --world-size 2 4            # two architectures, transformers' own plans
  tpcheck hf --all --json sweep.json --html sweep.html   # every architecture with a TP plan
  tpcheck hf qwen3 --micro-batches 1                 # one micro-batch (no gradient accumulation)
  tpcheck hf qwen3 --rule 'model.layers.*.self_attn.q_norm=replicate'   # override a plan rule
  tpcheck hf qwen3 --repair                          # find and verify a rule override that fixes it
  tpcheck hf --list                                  # the architectures with a TP plan"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument(
        "architecture", nargs="*", help="model types (llama, qwen3, mixtral, ...); see --list"
    )
    parser.add_argument(
        "--all",
        dest="all_architectures",
        action="store_true",
        help="every architecture whose config declares a TP plan",
    )
    parser.add_argument(
        "--list",
        dest="list_architectures",
        action="store_true",
        help="print the architectures with a TP plan and exit",
    )
    parser.add_argument(
        "--world-size", type=int, nargs="+", default=[2], help="TP world sizes (default: 2)"
    )
    options.add_run_settings(parser, DEFAULTS)
    parser.add_argument(
        "--rule",
        action="append",
        metavar="PATTERN=STYLE",
        help="override one rule of transformers' plan (repeatable), e.g. "
        "'model.layers.*.mlp.down_proj=rowwise'",
    )
    parser.add_argument(
        "--repair",
        action="store_true",
        help="for each architecture not equivalent (or an error): try overrides of the plan keys "
        "of its failing modules (transformers' own styles and tpcheck's "
        "tpcheck_reduce_grad_on_arrival), one key, then pairs, each checked by the full check; "
        "print the smallest verified override as --rule flags, or that no plan change fixes it",
    )
    parser.add_argument(
        "--repair-budget",
        type=int,
        default=None,
        metavar="N",
        help="with --repair: at most N candidate plans checked per architecture (default 16)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="keep every check of every case in the JSON (default: the failed ones, and counts)",
    )
    options.add_output_flags(parser)


def main(args: argparse.Namespace) -> int:
    check_repair_flags(args)  # before transformers is imported: bad flags fail at once
    # here, not at the top: tpcheck.hf imports transformers (half a second); `--help` needs none
    from tpcheck import hf

    if args.list_architectures:
        problem = write_stdout("".join(f"{n}\n" for n in hf.select([], True)))
        return exit_after_outputs([problem] if problem else [], 0)
    options.check_flags(args)
    if any(w < 2 for w in args.world_size):
        raise UsageError(
            f"--world-size {' '.join(map(str, args.world_size))}: transformers shards "
            "nothing on one rank; give 2 or more"
        )
    names = hf.select(args.architecture, args.all_architectures)
    rules = hf.parse_rules(args.rule)
    specs, skipped = hf.plan_sweep(
        names,
        args.world_size,
        options.dtypes(args, DEFAULTS),
        rules,
        **options.given_settings(args, DEFAULTS),
    )
    if not specs:
        raise UsageError(
            "nothing to check: "
            + "; ".join(
                f"{r['architecture']} (tp{r['world_size']}) skipped: {r['reason']}"
                for r in skipped[:5]
            )
        )

    def finish(report: dict) -> None:
        """The sweep's table in the report, the passing checks dropped unless --full."""
        report["sweep"] = hf.sweep_section(report["cases"], skipped, args.world_size, rules)
        if args.repair:  # before the passing checks are dropped: the failed ones name the modules
            from tpcheck.checker.pool.launch import DEFAULT_TIMEOUT_S
            from tpcheck.repair import run_repairs

            report["repair"] = run_repairs(
                report["cases"],
                specs,
                "plan_rule",
                DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout,
                args.quiet,
                budget=args.repair_budget or DEFAULT_REPAIR_BUDGET,
            )
        if not args.full:
            report["cases"] = [hf.compact(r) for r in report["cases"]]
        if not args.quiet:
            for row in skipped:
                print(
                    f"tpcheck: {row['architecture']} (tp{row['world_size']}) skipped: "
                    f"{row['reason']}",
                    file=sys.stderr,
                )
            print(f"tpcheck hf: {report['sweep']['summary']}", file=sys.stderr)

    # one intra-op thread per rank, rank 0's float64 passes too: the shape-reduced models are too
    # small for a thread team to pay, and on a loaded machine its waits cost seconds (spawn.py)
    with rank_thread_cap(SWEEP_RANK_THREADS):
        return execute(specs, args, finish_report=finish, lanes=SWEEP_LANES)


DEFAULT_REPAIR_BUDGET = 16  # tpcheck.repair.rule_override.DEFAULT_BUDGET (not imported for --help)


def check_repair_flags(args: argparse.Namespace) -> None:
    if args.repair_budget is not None and not args.repair:
        raise UsageError(f"--repair-budget {args.repair_budget}: give it with --repair")
    if args.repair_budget is not None and args.repair_budget < 1:
        raise UsageError(
            f"--repair-budget {args.repair_budget}: the number of candidate plans to check per "
            "architecture is 1 or more (default 16)"
        )
    from tpcheck.checker.pool.launch import under_torchrun

    if args.repair and under_torchrun():
        raise UsageError(
            "--repair under torchrun: the repair runs each candidate plan in a rank pool of its "
            "own; run tpcheck hf --repair without torchrun"
        )
    if args.repair and args.all_architectures:
        raise UsageError(
            "--repair with --all: a repair checks up to --repair-budget candidate plans per "
            "failed architecture; run the sweep, then repair the architectures it found not "
            "equivalent by name (tpcheck hf qwen3 --repair)"
        )
