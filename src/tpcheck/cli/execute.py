"""Running a command's cases and saying what they found: the forked rank pool (or the ranks torchrun
started), the summary on stderr, the seed's JSON or the inferred plans on stdout, the --json and
--html reports, the exit code. Used by run, verify and hf; `write_outputs` by report too."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
from collections.abc import Callable

# `resolve.launcher`, looked up at each call: the CLI's tests stand in for the rank pool there
from tpcheck import resolve
from tpcheck.checker.devices import check_device
from tpcheck.checker.pool.launch import DEFAULT_TIMEOUT_S, under_torchrun
from tpcheck.checker.pool.session import Lanes, run_specs
from tpcheck.checker.verdict.result import exit_code
from tpcheck.cli.common import Interrupted, exit_after_outputs, write_stdout
from tpcheck.errors import ExitCode, UsageError
from tpcheck.repair import exit_code_after, repaired_results
from tpcheck.report.console import print_summary, progress_printer
from tpcheck.report.html import render_html
from tpcheck.report.module_outputs import counts, module_outputs_code
from tpcheck.report.schema import build_report, write_atomic
from tpcheck.seed_compat import seed_payload


def execute(
    specs: list,
    args: argparse.Namespace,
    seed_mode: str | None = None,
    seed_world_size: int = 2,
    finish_report: Callable[[dict], None] | None = None,
    lanes: int = 1,
) -> int:
    """Run specs (forked pool, or the torchrun ranks), print and write reports, return the exit
    code. seed_mode: the seed's JSON for that mode goes to stdout (inspect: for `seed_world_size`
    ranks). finish_report(report): adds to the report before it is written (the HF sweep's
    table). lanes: forked pools that run the cases side by side (session.py `Lanes`)."""
    timeout = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout
    torchrun = under_torchrun()
    specs = on_device(specs, getattr(args, "device", "cpu"), torchrun)
    if not torchrun:  # bad input fails fast, before any rank is forked
        refuse_if_none_valid(specs)
    launcher = resolve.torchrun_launcher(timeout) if torchrun else resolve.launcher(timeout)
    if lanes > 1 and not torchrun:
        launcher = Lanes([launcher, *(resolve.launcher(timeout) for _ in range(lanes - 1))])
    try:
        results, interrupted = run_all(specs, launcher, args.quiet, torchrun)
        is_rank0 = not torchrun or launcher.rank == 0
        code = exit_code(results) if is_rank0 else 0
        if interrupted:
            code = ExitCode.interrupted(signal.Signals[interrupted["signal"]])
        if is_rank0:
            seed = None
            if seed_mode and not interrupted:
                seed = seed_payload(seed_mode, results, seed_world_size)
            report = build_report(results, exit_code=code, seed=seed, interrupted=interrupted)
            if finish_report is not None:
                finish_report(report)
            if "repair" in report and not interrupted:
                code = report["summary"]["exit_code"] = exit_code_after(report, code)
            code = say(report, results, len(specs), code, args)
        if torchrun:
            code = launcher.broadcast_code(code)
        return code
    finally:
        try:
            launcher.close()
        except Interrupted:  # a signal while saying goodbye to healthy ranks: stop them instead
            if hasattr(launcher, "abort"):
                launcher.abort()
            raise


def on_device(specs: list, device: str, torchrun: bool) -> list:
    """The specs with `--device`; on "cuda", refused at once (exit 2) where this machine has no GPU
    for every rank (under torchrun each rank checks its own machine)."""
    if device == "cpu":
        return specs
    if not torchrun:
        check_device(device, max(s.world_size for s in specs))
    return [
        dataclasses.replace(s, device=device, label=f"{s.label}/{device}" if s.label else "")
        for s in specs
    ]


def refuse_if_none_valid(specs: list) -> None:
    """The first problem (exit 2) when no spec is valid: nothing would run. Otherwise each bad case
    is one "invalid" result (the launcher validates it again) and the rest run."""
    problems = []
    for spec in specs:
        try:
            resolve.RESOLVER.validate(resolve.RESOLVER.prepare(spec))
        except UsageError as e:
            problems.append(e)
    if problems and len(problems) == len(specs):
        raise problems[0]


def run_all(specs: list, launcher, quiet: bool, torchrun: bool) -> tuple[list[dict], dict | None]:
    """(results, None), or on a signal (the results of the cases that finished, what stopped them):
    every rank is stopped at once, and what finished is still reported."""
    progress = None if quiet or len(specs) < 2 else progress_printer()
    results: list[dict] = []

    def report(result) -> None:  # the report's case, made once, here at the edge
        results.append(result.to_json())
        if progress is not None:
            progress(len(results), len(specs), results[-1])

    try:
        run_specs(specs, launcher, report)
    except Interrupted as e:
        if torchrun:
            raise
        launcher.abort()
        return results, {
            "signal": e.name,
            "cases_finished": len(results),
            "cases_planned": len(specs),
        }
    return results, None


def say(
    report: dict, results: list[dict], planned: int, code: int, args: argparse.Namespace
) -> int:
    """Rank 0's outputs: the seed's JSON, the summary (or, quiet, why the exit code is 2), the
    inferred plans, the reports; the exit code once they are written."""
    interrupted = report.get("interrupted")
    failed = []  # outputs that could not be written: said at the end, exit 2
    seed = report.get("seed")
    seed_to = seed_destination(args)
    if seed and seed_to == "-" and (problem := write_stdout(json.dumps(seed, indent=2) + "\n")):
        failed.append(problem)
    if not args.quiet:
        if results:
            print_summary(results, sys.stderr)
        if after := repaired_results(report):  # last: what the verified fixes make of the cases
            print(
                f"tpcheck: with the repair{'s' if len(after) > 1 else ''} printed above, each "
                "checked again in full:",
                file=sys.stderr,
            )
            print_summary(after, sys.stderr)
    else:  # quiet, but never silent about why the exit code is 2
        for r in results:
            if r["verdict"] in ("invalid", "error"):
                print(f"tpcheck: error: {r['name']}: {r['summary']}", file=sys.stderr)
    if getattr(args, "print_plan", False) and (problem := write_stdout(plans_text(results))):
        failed.append(problem)
    if interrupted:
        print(
            f"tpcheck: interrupted by {interrupted['signal']} after {len(results)} of {planned} "
            "case(s): every rank was stopped; the reports hold the cases that finished",
            file=sys.stderr,
        )
    outputs = {"--json": args.json_path, "--html": args.html_path}
    if seed and seed_to not in (None, "-"):
        outputs["--seed-json"] = seed_to
    failed += write_outputs(report, outputs, args.quiet)
    if not interrupted:
        return exit_after_outputs(failed, code)
    for line in failed:  # the signal's exit code stands; a failed output is still said
        print(f"tpcheck: error: {line}", file=sys.stderr)
    return code


def plans_text(results: list[dict]) -> str:
    """`verify --print-plan`: the plan inferred for each case, as code; for a plan written in the
    case file, its module outputs (the activations written and those inferred where it is silent);
    else why there is none."""
    return "".join(_plan_text(r) for r in results)


def _plan_text(r: dict) -> str:
    if r.get("inferred_plan"):
        return f"# {r['name']}\n{r['inferred_plan']}\n"
    if r.get("activations"):
        return (
            f"# {r['name']}: plan written in the case file; its module outputs "
            f"({counts(r['activations'])}):\n{module_outputs_code(r['activations'])}\n"
        )
    return f"# {r['name']}: no plan inferred (written in the case file, or {r['verdict']})\n"


def seed_destination(args: argparse.Namespace) -> str | None:
    """Where the seed's JSON of a `--mode` run goes: `--seed-json` when given ("-": stdout); else
    stdout for one mode (as the seed's own script prints it) and nowhere for `--mode all`, whose
    screen is the summary (its JSON is in the --json report, under "seed")."""
    given = getattr(args, "seed_json_path", None)
    if given is not None:
        return given
    return None if getattr(args, "mode", None) == "all" else "-"


# what each output is called when it is written
OUTPUT_LABELS = {
    "--json": "JSON report",
    "--html": "HTML report",
    "--seed-json": "seed-compatible JSON",
}


def write_outputs(report: dict, outputs: dict[str, str | None], quiet: bool) -> list[str]:
    """Write the report to each output given ({flag: path}); one that fails is skipped and the
    others are still written. Returns a line per failure."""
    failed = []
    for flag, path in outputs.items():
        if path is None:
            continue
        try:
            if flag == "--seed-json":  # as stdout would have it
                text = json.dumps(report["seed"], indent=2) + "\n"
            elif flag == "--json":
                text = json.dumps(report, indent=2, sort_keys=True) + "\n"
            else:
                text = render_html(report)
            write_atomic(path, text)
        except OSError as e:
            failed.append(f"{flag} {path!r}: cannot write the report: {e.strerror or e}")
        else:
            if not quiet:
                print(f"{OUTPUT_LABELS[flag]}: {path}", file=sys.stderr)
    return failed
