"""The `tpcheck` command line. `main(argv) -> exit code`:

0  every case went as expected (correct implementations equivalent, injected faults caught)
1  some case did not (a TP implementation differs from its dense twin, or a fault was missed)
2  bad input or a rank that raised/died (the message names the value and the fix)
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

from tpcheck.errors import EXIT_USAGE, UsageError

MODES = ("inspect", "equivalence", "missing_forward_reduce", "missing_backward_reduce", "all")  # = seed.MODES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpcheck", description="Prove a tensor-parallel implementation "
                                     "computes what its dense model computes; say where and why when not.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="check built-in blocks (a matrix of blocks x world sizes x dtypes x faults)")
    run.add_argument("--mode", choices=MODES, help="the seed's modes on the seed fixture (prints the seed's JSON); "
                     "'all' runs inspect and the three run modes in one launch")
    run.add_argument("--block", nargs="+", default=["mlp"], help="blocks to check (default: mlp)")
    run.add_argument("--preset", default=None, help="model shapes: seed, tiny, llama3-8b-layer (default: seed)")
    run.add_argument("--world-size", type=int, nargs="+", default=None, help="TP world sizes (default: 2)")
    run.add_argument("--dtype", nargs="+", default=["float32"],
                     help="float32, bfloat16, float16, float64 (default: float32)")
    run.add_argument("--sp", action="store_true", help="sequence parallelism")
    run.add_argument("--fault", nargs="+", default=[], help="inject catalogue faults ('all' for every one)")
    run.add_argument("--steps", type=int, default=None, help="optimizer steps (default 3; 1 for --mode)")
    run.add_argument("--optimizer", choices=("sgd", "adamw"), default=None)
    run.add_argument("--lr", type=float, default=None)
    run.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation micro-batches")
    run.add_argument("--seed", type=int, default=31)
    _add_output_args(run)
    run.set_defaults(func=cmd_run)

    verify = sub.add_parser("verify", help="check your own TP code: a case file (docs/case-files.md)")
    verify.add_argument("target", nargs="+", help="path/to/case.py or path/to/case.py:NAME")
    verify.add_argument("--world-size", type=int, nargs="+", default=None, help="TP world sizes (default: 2)")
    verify.add_argument("--dtype", nargs="+", default=None, help="override the case's dtype(s)")
    verify.add_argument("--steps", type=int, default=None, help="override the case's optimizer steps")
    verify.add_argument("--optimizer", choices=("sgd", "adamw"), default=None)
    verify.add_argument("--lr", type=float, default=None)
    verify.add_argument("--micro-batches", type=int, default=None)
    verify.add_argument("--seed", type=int, default=None)
    _add_output_args(verify)
    verify.set_defaults(func=cmd_verify)

    faults = sub.add_parser("faults", help="list the fault catalogue")
    faults.add_argument("--json", action="store_true")
    faults.set_defaults(func=cmd_faults)

    report = sub.add_parser("report", help="print the summary of a JSON report and render it as HTML")
    report.add_argument("result", metavar="RESULT.json", help="a report written by `tpcheck run --json`")
    report.add_argument("--html", dest="html_path", metavar="PATH", help="write the HTML report here")
    report.set_defaults(func=cmd_report)
    return parser


def _add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=None, help="seconds any collective may wait (default 20)")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write the full JSON report here")
    p.add_argument("--html", dest="html_path", metavar="PATH", help="write the HTML report here")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"tpcheck: error: {e}", file=sys.stderr)
        return EXIT_USAGE


# ------------------------------------------------------------------------------ run


def cmd_run(args: argparse.Namespace) -> int:
    from tpcheck.check.launch import under_torchrun

    if args.timeout is not None and not 0 < args.timeout <= 3600:
        raise UsageError(f"--timeout {args.timeout} must be in (0, 3600] seconds")
    world_sizes = args.world_size or [int(os.environ["WORLD_SIZE"]) if under_torchrun() else 2]
    if args.mode:
        from tpcheck.seed import mode_specs

        if len(world_sizes) != 1:
            raise UsageError(f"--mode takes one --world-size, got {world_sizes}")
        specs = mode_specs(args.mode, world_sizes[0], preset=args.preset, steps=args.steps, optimizer=args.optimizer,
                           lr=args.lr, seed=args.seed)
    else:
        specs = matrix_specs(args, world_sizes)
    return execute(specs, args, seed_mode=args.mode)


def matrix_specs(args: argparse.Namespace, world_sizes: list[int]) -> list:
    from tpcheck.check.case import CaseSpec
    from tpcheck.faults import CATALOGUE, get_fault
    from tpcheck.resolve import feasible

    faults: list[str | None] = [None]
    if args.fault == ["all"]:
        faults += list(CATALOGUE)
    else:
        faults += [get_fault(f).name for f in args.fault]
    specs = []
    for block, ws, dtype, fault in itertools.product(args.block, world_sizes, args.dtype, faults):
        spec = CaseSpec(block=block, preset=args.preset or "seed", world_size=ws, dtype=dtype,
                        steps=3 if args.steps is None else args.steps, optimizer=args.optimizer or "adamw", lr=args.lr,
                        micro_batches=args.micro_batches, sequence_parallel=args.sp, seed=args.seed)
        if fault is None:
            specs.append(spec)
        elif CATALOGUE[fault].applies(block, ws, spec.optimizer, dtype) and feasible(CATALOGUE[fault].prepare(spec)):
            specs.append(CATALOGUE[fault].prepare(spec))
    if not specs:
        raise UsageError("no case to run: the faults given apply to none of the blocks and world sizes given")
    return specs


def cmd_verify(args: argparse.Namespace) -> int:
    """Case files: the world size is the launcher's; flags given override the Case's own values."""
    from tpcheck.check.launch import under_torchrun
    from tpcheck.check.usercode import file_spec

    world_sizes = args.world_size or [int(os.environ["WORLD_SIZE"]) if under_torchrun() else 2]
    given = {"steps": args.steps, "optimizer": args.optimizer, "lr": args.lr,
             "micro_batches": args.micro_batches, "seed": args.seed}
    specs = [file_spec(t, ws, dtype=d, **given)
             for t, ws, d in itertools.product(args.target, world_sizes, args.dtype or [None])]
    return execute(specs, args)


def execute(specs: list, args: argparse.Namespace, seed_mode: str | None = None) -> int:
    """Run specs (forked pool, or the torchrun ranks), print and write reports, return the exit code."""
    from tpcheck.check.launch import DEFAULT_TIMEOUT_S, under_torchrun
    from tpcheck.check.result import exit_code
    from tpcheck.check.session import run_specs
    from tpcheck.report.console import print_summary, progress_printer
    from tpcheck.report.schema import build_report, write_atomic
    from tpcheck.resolve import RESOLVER, torchrun_launcher
    from tpcheck.resolve import launcher as pool_launcher

    timeout = args.timeout or DEFAULT_TIMEOUT_S
    if not under_torchrun():  # bad input fails fast, before any rank is forked
        for spec in specs:
            RESOLVER.validate(RESOLVER.prepare(spec))
    launcher = torchrun_launcher(timeout) if under_torchrun() else pool_launcher(timeout)
    try:
        progress = None if args.quiet or len(specs) < 2 else progress_printer()
        results = run_specs(specs, launcher, progress)
        is_rank0 = not under_torchrun() or launcher.rank == 0
        code = exit_code(results) if is_rank0 else 0
        if is_rank0:
            seed = None
            if seed_mode:
                from tpcheck.seed import seed_payload

                seed = seed_payload(seed_mode, results, specs[0].world_size if specs else 2)
            report = build_report(results, exit_code=code, seed=seed)
            if seed_mode:
                print(json.dumps(report["seed"], indent=2))
            if not args.quiet:
                print_summary(results, sys.stderr)
            else:  # quiet, but never silent about why the exit code is 2
                for r in results:
                    if r["verdict"] in ("invalid", "error"):
                        print(f"tpcheck: error: {r['name']}: {r['summary']}", file=sys.stderr)
            if args.json_path:
                write_atomic(args.json_path, json.dumps(report, indent=2, sort_keys=True) + "\n")
                _say(args, f"JSON report: {args.json_path}")
            if args.html_path:
                from tpcheck.report.html import render_html

                write_atomic(args.html_path, render_html(report))
                _say(args, f"HTML report: {args.html_path}")
        if under_torchrun():
            code = launcher.broadcast_code(code)
        return code
    finally:
        launcher.close()


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.quiet:
        print(text, file=sys.stderr)


# ------------------------------------------------------------------------------ report


def cmd_report(args: argparse.Namespace) -> int:
    from tpcheck.report.console import print_summary
    from tpcheck.report.schema import SCHEMA, write_atomic

    try:
        with open(args.result) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read the report {args.result!r}: {e}; pass a file from `tpcheck run --json`") \
            from None
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        found = report.get("schema") if isinstance(report, dict) else type(report).__name__
        raise UsageError(f"{args.result!r} has schema {found!r}, this tpcheck reads {SCHEMA!r}")
    print_summary(report["cases"], sys.stderr)
    if args.html_path:
        from tpcheck.report.html import render_html

        write_atomic(args.html_path, render_html(report))
        print(f"HTML report: {args.html_path}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------ faults


def cmd_faults(args: argparse.Namespace) -> int:
    from tpcheck.faults import CATALOGUE

    rows = [{"name": f.name, "bug_class": f.bug_class, "where": f.where, "expected_stage": f.expected_stage,
             "expected_signature": f.expected_signature, "blocks": list(f.blocks), "world_sizes": list(f.worlds),
             "sequence_parallel": f.sequence_parallel}
            for f in CATALOGUE.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['name']:<32} [{', '.join(r['blocks'])}] {r['bug_class']}")
            print(f"{'':<32} injected: {r['where']}; expected: {r['expected_signature']} in {r['expected_stage']}")
    return 0
