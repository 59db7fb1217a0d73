"""`tpcheck run`: the built-in blocks, a matrix of blocks x world sizes x dtypes x faults; with
--mode, the seed's modes on the seed's fixture (the seed's JSON on stdout)."""

from __future__ import annotations

import argparse
import itertools
import os

from tpcheck.checker.case import CaseSpec
from tpcheck.checker.pool.launch import under_torchrun
from tpcheck.cli import options
from tpcheck.cli.execute import execute
from tpcheck.errors import UsageError
from tpcheck.faults import CATALOGUE, get_fault
from tpcheck.resolve import RESOLVER, feasible
from tpcheck.seed_compat import MODES, mode_specs

DEFAULTS = options.NO_DEFAULTS  # RunSettings' own: float32, 3 AdamW steps, 2 micro-batches, seed 31
MODE_NOTES = {"steps": "1 for --mode", "optimizer": "sgd for --mode"}  # seed.mode_specs' own
# Options `run --mode` applies (by argparse dest); any other option given with --mode is refused.
MODE_OPTIONS = {
    "mode",
    "world_size",
    "preset",
    "steps",
    "optimizer",
    "lr",
    "seed",
    "timeout",
    "json_path",
    "html_path",
    "seed_json_path",
    "quiet",
}
# inspect runs nothing
INSPECT_OPTIONS = {"mode", "world_size", "json_path", "html_path", "seed_json_path", "quiet"}
EPILOG = """examples:
  tpcheck run --block mlp attention --world-size 2 4 --dtype float32 bf16
  tpcheck run --block layer --sp --fault all --json r.json --html r.html
  tpcheck run --block layer lm --preset tiny --dropout 0.1 --attention-dropout 0.1 --world-size 2 4
  tpcheck run --mode all --world-size 2              # the seed's modes: a summary table
  tpcheck run --mode equivalence                     # one seed mode: its JSON on stdout
  tpcheck run --block layer --preset tiny --world-size 2 --device cuda   # one GPU per rank, NCCL"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument(
        "--mode",
        choices=MODES,
        help="the seed's modes on the seed fixture; one mode prints the seed's JSON on stdout "
        "(as the seed's script does), 'all' runs inspect and the three run modes in one launch "
        "and prints the summary (its seed JSON: --seed-json, or under 'seed' in --json)",
    )
    parser.add_argument(
        "--seed-json",
        dest="seed_json_path",
        metavar="PATH",
        help="with --mode: write the seed-compatible JSON here ('-': stdout) instead of stdout",
    )
    parser.add_argument(
        "--block", nargs="+", default=["mlp"], help="blocks to check (default: mlp)"
    )
    parser.add_argument(
        "--preset", default=None, help="model shapes: seed, tiny, llama3-8b-layer (default: seed)"
    )
    parser.add_argument(
        "--world-size", type=int, nargs="+", default=None, help="TP world sizes (default: 2)"
    )
    options.add_run_settings(parser, DEFAULTS, MODE_NOTES)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument(
        "--fault", nargs="+", default=[], help="inject catalogue faults ('all' for every one)"
    )
    parser.add_argument(
        "--dropout",
        type=float,
        default=None,
        metavar="P",
        help="hidden dropout of the blocks (after the embedding, on each block's "
        "output); default 0",
    )
    parser.add_argument(
        "--attention-dropout",
        type=float,
        default=None,
        metavar="P",
        help="dropout of the attention probabilities; default 0",
    )
    options.add_device_flag(parser)
    options.add_output_flags(parser)


def main(args: argparse.Namespace) -> int:
    options.check_flags(args)
    if args.seed_json_path is not None and not args.mode:
        raise UsageError(
            f"--seed-json {args.seed_json_path!r} goes with --mode: only the seed's modes have the "
            "seed's JSON (a matrix run's report: --json PATH)"
        )
    if args.seed_json_path not in (None, "-"):
        options.check_output_path("--seed-json", args.seed_json_path)
    world_sizes = args.world_size or [int(os.environ["WORLD_SIZE"]) if under_torchrun() else 2]
    if args.mode:
        refuse_options_the_mode_ignores(args)
        if len(world_sizes) != 1:
            raise UsageError(f"--mode takes one --world-size, got {world_sizes}")
        if args.mode in ("inspect", "all") and not under_torchrun():
            check_inspect_world_size(world_sizes[0])
        specs = mode_specs(
            args.mode, world_sizes[0], preset=args.preset, **options.given_settings(args)
        )
    else:
        specs = matrix_specs(args, world_sizes)
    return execute(specs, args, seed_mode=args.mode, seed_world_size=world_sizes[0])


def matrix_specs(args: argparse.Namespace, world_sizes: list[int]) -> list[CaseSpec]:
    """Every block x world size x dtype, correct and with each fault given that applies to it."""
    faults: list[str | None] = [None]
    if args.fault == ["all"]:
        faults += list(CATALOGUE)
    else:
        faults += [get_fault(f).name for f in args.fault]
    specs = []
    for block, ws, dtype, fault in itertools.product(
        args.block, world_sizes, options.dtypes(args, DEFAULTS), faults
    ):
        run = options.run_settings(args, dtype, DEFAULTS)
        spec = CaseSpec(
            block=block,
            preset=args.preset or "seed",
            world_size=ws,
            run=run,
            sequence_parallel=args.sp,
            overrides=dropout_overrides(args),
        )
        if fault is None:
            specs.append(spec)
        elif CATALOGUE[fault].applies(
            block, ws, run.optimizer, dtype, run.micro_batches, run.master_weights
        ):
            faulty = CATALOGUE[fault].prepare(spec)
            if feasible(faulty):
                specs.append(faulty)
    if not specs:
        raise UsageError(
            "no case to run: the faults given apply to none of the blocks and world sizes given"
        )
    return specs


def dropout_overrides(args: argparse.Namespace) -> tuple:
    """The blocks' dropout probabilities given on the command line, as config overrides."""
    return tuple(
        (name, value)
        for name, value in (
            ("dropout", args.dropout),
            ("attention_dropout", args.attention_dropout),
        )
        if value is not None
    )


# ------------------------------------------------------------------------------ --mode


def given_options(argv: list[str]) -> dict[str, str]:
    """{dest: flag} of the options typed in `argv` (not those left at their defaults): the command's
    words are parsed again by a parser whose options default to nothing. (argparse lists a parser's
    options only in its `_actions`: there is no public way.)"""
    parser = argparse.ArgumentParser(prog="tpcheck run")
    add_arguments(parser)
    for action in parser._actions:
        if action.option_strings:
            action.default = argparse.SUPPRESS
    given = vars(parser.parse_args(argv[argv.index("run") + 1 :]))
    return {
        a.dest: max(a.option_strings, key=len)
        for a in parser._actions
        if a.option_strings and a.dest in given
    }


def refuse_options_the_mode_ignores(args: argparse.Namespace) -> None:
    """`run --mode` checks the seed's fixture: options given that it would not apply are refused."""
    inspect = args.mode == "inspect"
    applies = INSPECT_OPTIONS if inspect else MODE_OPTIONS
    ignored = [flag for dest, flag in given_options(args.argv).items() if dest not in applies]
    if not ignored:
        return
    them = "it" if len(ignored) == 1 else "them"
    does = (
        "runs nothing, it prints the seed MLP's shapes for --world-size ranks"
        if inspect
        else (
            "checks the seed's MLP block in float32, without sequence parallelism, one micro-batch "
            "per step, with the mode's own fault"
        )
    )
    fix = f"drop {them}"
    if not inspect:
        fix += f", or drop --mode to run the matrix check with {them}"
    raise UsageError(f"--mode {args.mode} ignores {', '.join(ignored)}: it {does}; {fix}")


def check_inspect_world_size(world_size: int) -> None:
    """inspect shows the seed MLP split over `world_size` ranks: refuse a world size a run would
    refuse."""
    RESOLVER.validate(CaseSpec(block="mlp", preset="seed", world_size=world_size))
