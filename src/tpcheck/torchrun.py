"""`tpcheck torchrun TORCHRUN_ARGS -- COMMAND`: torchrun's launcher run in this process, each worker
running `python -m tpcheck COMMAND`, and a non-zero verdict said in one line per outcome instead of
torchrun's ChildFailedError traceback and its "Root Cause" summary.

Everything before `--` goes, as given, to torchrun's own parser (`torch.distributed.run`);
everything after it is a tpcheck command that starts ranks (`run`, `verify`, `hf`). Exit codes: 0
when every rank exited 0; otherwise the ranks' codes decide by the rule of `exit_code`: 2 if any
rank said 2 (bad input), else 3 if any said 3, died of a signal, or exited with a code tpcheck does
not use, else 1. Bad input to the wrapper itself (no `--`, no command after it, a command that
starts no ranks, torchrun's own argument errors) is exit 2 before anything starts; a signal to the
launcher exits 128 + the signal's number once torchrun has stopped every rank.

torch is imported inside the functions: `tpcheck --help` and the argument checks stay light.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import signal
import sys
from collections.abc import Callable, Iterator, Mapping

from tpcheck.errors import INTERRUPTED_BY, ExitCode, UsageError

PROG = "tpcheck torchrun"
# tpcheck's commands that start ranks; the others (new, faults, report) run once, without torchrun
RANK_COMMANDS = ("run", "verify", "hf")
EXAMPLE = "tpcheck torchrun --nproc_per_node 2 -- verify case.py --world-size 2"
TORCHRUN_HELP = "`python -m torch.distributed.run --help` lists torchrun's arguments"

MEANINGS = {
    ExitCode.NOT_EQUIVALENT: "not equivalent: a case did not go as expected; the report says which",
    ExitCode.USAGE: "bad input: the ranks' message above names the value and the fix",
    ExitCode.ERROR: (
        "no verdict: a rank raised or died, or the checker failed its own control; the message "
        "above says which"
    ),
}
# How torchrun stops the ranks still running once one has exited non-zero: SIGTERM, then SIGKILL
# after its shutdown timeout (a tpcheck rank catches SIGTERM and exits 143).
STOPPED = {-signal.SIGTERM, -signal.SIGKILL, ExitCode.interrupted(signal.SIGTERM)}
ELASTIC = "torch.distributed.elastic"  # torchrun's agent and its loggers


# ------------------------------------------------------------------------------ arguments


def asks_for_help(argv: list[str]) -> bool:
    """`-h` or `--help` among torchrun's arguments (before
    `--`): tpcheck's help for `tpcheck torchrun`."""
    before = argv[: argv.index("--")] if "--" in argv else argv
    return any(a in ("-h", "--help") for a in before)


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's arguments, the tpcheck command) of `tpcheck torchrun ARGV`,
    split at the first `--`.
    UsageError: no `--`, nothing after it, or a command after it that starts no ranks."""
    if "--" not in argv:
        raise UsageError(
            f"no `--` in `{_line(argv)}`: put `--` between torchrun's arguments and "
            f"tpcheck's, e.g. `{_with_separator(argv)}`"
        )
    at = argv.index("--")
    torchrun_args, command = argv[:at], argv[at + 1 :]
    if not command:
        raise UsageError(
            f"nothing after `--` in `{_line(argv)}`: name the tpcheck command each rank "
            f"runs, e.g. `{EXAMPLE}`"
        )
    name = command[0]
    if name not in RANK_COMMANDS:
        if name in ("new", "faults", "report"):
            raise UsageError(
                f"`{name}` after `--` starts no ranks: run it as `tpcheck {shlex.join(command)}`, "
                f"without torchrun; after `--` give {', '.join(RANK_COMMANDS)}"
            )
        raise UsageError(
            f"{name!r} after `--` is not a tpcheck command that starts ranks: give "
            f"{', '.join(RANK_COMMANDS)}, e.g. `{EXAMPLE}`"
        )
    return torchrun_args, command


def _with_separator(argv: list[str]) -> str:
    """The user's `tpcheck torchrun` line with `--` before
    its first tpcheck command (else a generic example)."""
    for i, a in enumerate(argv):
        if a in RANK_COMMANDS:
            return _line([*argv[:i], "--", *argv[i:]])
    return EXAMPLE


def _line(argv: list[str]) -> str:
    return " ".join([PROG, *map(shlex.quote, argv)])


def parse_torchrun_args(torchrun_args: list[str], command: list[str]):
    """torchrun's namespace (`torch.distributed.run`'s parser, given `torchrun_args` as they are)
    for workers that run `python -m tpcheck COMMAND`. torchrun's argument errors:
    its message, exit 2."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = PROG

    def error(message: str):
        print(
            f"{PROG}: error: {message} (torchrun's arguments, before `--`; {TORCHRUN_HELP})",
            file=sys.stderr,
        )
        raise SystemExit(ExitCode.USAGE)

    parser.error = error  # its message in one line, without torchrun's forty-option usage
    ns = parser.parse_args([*torchrun_args, "--", "tpcheck"])
    # a positional argument before `--`: torchrun took it for the script
    if ns.training_script != "tpcheck":
        stray = [ns.training_script, *ns.training_script_args[:-1]]
        raise UsageError(
            f"{shlex.join(stray)} before `--` is not a torchrun option: tpcheck's command and its "
            f"arguments go after `--`, e.g. `{EXAMPLE}`"
        )
    for flag, given in (("--no-python", ns.no_python), ("--run-path", ns.run_path)):
        if given:
            raise UsageError(
                f"{flag}: each rank runs `python -m tpcheck {shlex.join(command)}`; drop {flag}"
            )
    ns.module, ns.training_script_args = True, list(command)
    return ns


# ------------------------------------------------------------------------------ exit codes


def exit_code(codes: Mapping[int, int]) -> int:
    """The one exit code for the ranks' non-zero codes {global rank: exit code}: 2 if any rank said
    2, else 3 if any said 3, died of a signal or gave a code tpcheck does not use, else 1 (0 for
    none). Ranks torchrun stopped after another rank had exited (SIGTERM, SIGKILL, 143) count only
    when no rank gave a code of its own."""
    if not codes:
        return 0
    said = [c for c in codes.values() if c not in STOPPED] or list(codes.values())
    if ExitCode.USAGE in said:
        return ExitCode.USAGE
    if any(c != ExitCode.NOT_EQUIVALENT for c in said):
        return ExitCode.ERROR
    return ExitCode.NOT_EQUIVALENT


def outcome_lines(codes: Mapping[int, int]) -> list[str]:
    """One line per distinct exit code of the ranks in
    `codes`, ranks listed, the code said in words."""
    by_code: dict[int, list[int]] = {}
    for rank, code in sorted(codes.items()):
        by_code.setdefault(code, []).append(rank)
    someone_said = any(c not in STOPPED for c in by_code)
    lines = []
    for code, ranks in sorted(by_code.items(), key=lambda item: (item[0] in STOPPED, item[0])):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        how = _signal_name(code)
        if code in STOPPED and someone_said:
            lines.append(f"{PROG}: {who} stopped by torchrun ({how}) once another rank had exited")
        elif code in MEANINGS:
            lines.append(f"{PROG}: {who} exited with code {code} ({MEANINGS[code]})")
        elif code < 0:
            lines.append(
                f"{PROG}: {who} killed by {how} (no verdict: the rank ended before saying one)"
            )
        elif code in INTERRUPTED_BY:
            lines.append(
                f"{PROG}: {who} exited with code {code} (interrupted by {how}: no verdict)"
            )
        else:
            lines.append(
                f"{PROG}: {who} exited with code {code} (not a tpcheck exit code: no verdict; the "
                "rank's output above says what ended it)"
            )
    return lines


def _signal_name(code: int) -> str:
    number = -code if code < 0 else code - 128
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# ------------------------------------------------------------------------------ launch


def main(argv: list[str], check_command: Callable[[list[str]], object]) -> int:
    """`tpcheck torchrun ARGV`: split, check, launch; the exit code. `check_command(command)` parses
    the tpcheck command with tpcheck's own parser, so that its flag errors are said
    once, before any rank."""
    try:
        torchrun_args, command = split_argv(argv)
        check_command(command)
        namespace = parse_torchrun_args(torchrun_args, command)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    return launch(namespace)


def launch(namespace) -> int:
    """Run torchrun's launcher (`torch.distributed.run.run`)
    in this process on a parsed namespace."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with _held_failure_logs() as held:
        try:
            torchrun.run(namespace)
        except ChildFailedError as e:  # its records are dropped: the lines below say it
            codes = {int(rank): int(failure.exitcode) for rank, failure in e.failures.items()}
            for line in outcome_lines(codes):
                print(line, file=sys.stderr)
            return exit_code(codes)
        except SignalException as e:
            held.release()
            name = signal.Signals(e.sigval).name
            print(
                f"{PROG}: interrupted by {name}: torchrun stopped every rank; no verdict",
                file=sys.stderr,
            )
            return ExitCode.interrupted(int(e.sigval))
        except Exception as e:  # said in one line; torchrun's own records are let through
            held.release()
            # torchrun's arguments, read into its launch config
            if _raised_in(e, torchrun.config_from_args):
                print(
                    f"{PROG}: error: {e} (torchrun's arguments, before `--`; {TORCHRUN_HELP})",
                    file=sys.stderr,
                )
                return ExitCode.USAGE
            print(
                f"{PROG}: error: torchrun stopped before the ranks finished: "
                f"{type(e).__name__}: {e}; no verdict",
                file=sys.stderr,
            )
            return ExitCode.ERROR
        held.release()
        return 0


def _raised_in(error: BaseException, function: Callable) -> bool:
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is function.__code__:
            return True
        tb = tb.tb_next
    return False


class _HeldRecords(logging.Filter):
    """Holds back the records of the loggers it filters from ERROR up, and from WARNING up for the
    worker-process loggers (`...elastic.multiprocessing.*`: on a failure, "failed (exitcode: 1) ..."
    and "Sending process N closing signal SIGTERM"); `release` emits them."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.loggers: list[logging.Logger] = []

    def filter(self, record: logging.LogRecord) -> bool:
        worker_bookkeeping = record.name.startswith(f"{ELASTIC}.multiprocessing")
        if record.levelno >= (logging.WARNING if worker_bookkeeping else logging.ERROR):
            self.records.append(record)
            return False
        return True

    def release(self) -> None:
        for lg in self.loggers:
            lg.removeFilter(self)
        self.loggers = []
        records, self.records = self.records, []
        for record in records:
            logging.getLogger(record.name).handle(record)


@contextlib.contextmanager
def _held_failure_logs() -> Iterator[_HeldRecords]:
    """While torchrun runs, its failure records (its loggers under `torch.distributed.elastic`, see
    `_HeldRecords`) are held back; its other warnings pass as they come. A failure of the ranks
    drops the held records (the outcome lines say it); any other ending lets them through."""
    held = _HeldRecords()
    names = [
        n for n in logging.root.manager.loggerDict if n == ELASTIC or n.startswith(ELASTIC + ".")
    ]
    for name in names:
        lg = logging.getLogger(name)
        lg.addFilter(held)
        held.loggers.append(lg)
    try:
        yield held
    finally:
        for lg in held.loggers:
            lg.removeFilter(held)
