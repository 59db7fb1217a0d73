"""The `tpcheck` command line. `main(argv) -> exit code`:

0  every case went as expected (correct implementations equivalent, injected faults caught)
1  some case did not (a TP implementation differs from its dense twin, or a fault was missed)
2  bad input (the message names the value and the fix), or an output (--json, --html, stdout) that
   could not be written after the run (the others are still written)
3  no verdict: a rank raised or died, or the checker failed its own control (the message says which)
130, 143, 129  interrupted by SIGINT (Ctrl-C), SIGTERM or SIGHUP: every rank is stopped at once, the
   cases that finished are reported (marked `interrupted`), temp dirs are removed; a second signal
   exits at once

`tpcheck torchrun TORCHRUN_ARGS -- COMMAND` (torchrun's launcher in this process, `python -m
tpcheck COMMAND` on each rank) exits 0 when every rank exited 0, else by the ranks' codes: 2 if any
rank said 2, else 3 if any said 3, died of a signal or exited with another code, else 1 (a rank
torchrun stopped once another had exited does not count); one line on stderr per distinct code, no
torchrun traceback. Its own bad input (no `--`, nothing or no rank-starting command after it,
torchrun's argument errors) is 2 before anything starts; a signal to the launcher exits 128 + its
number once torchrun has stopped every rank.

The package, as pytest lays out its options: one module per command (run, verify, hf, report, new,
faults, torchrun), each with `add_arguments(parser)` and `main(args) -> int`; `parser.py` lists the
commands and imports only the chosen one (so `tpcheck --help` imports none, and no torch of its
own); `options.py` defines once the flags several commands share (the run settings, the outputs,
the device); `execute.py` runs a command's cases and writes the reports; `common.py` is what every
command shares and must stay light: signals, stdout, the exit code after the outputs.
"""

from __future__ import annotations

import os
import sys

from tpcheck.cli.common import Interrupted, StopOnSignals, write_stdout
from tpcheck.cli.parser import parse_argv
from tpcheck.errors import ExitCode, UsageError


def entry() -> None:
    """The `tpcheck` command: `main`, then exit without torch's slow interpreter teardown (about a
    second; gloo sometimes aborts in it), once stdout and stderr are flushed -- argparse's exits
    (--help, --version, a flag error) too. Its own process computes on one thread, so that the ranks
    it forks may share the CPUs (`main(one_thread=True)`)."""
    try:
        code = main(one_thread=True)
    except SystemExit as e:
        if not isinstance(e.code, int):
            raise
        code = e.code
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: list[str] | None = None, *, one_thread: bool = False) -> int:
    """Run the command `argv` (default: the process's arguments); its exit code. `one_thread`
    (the `tpcheck` command's own process): once the arguments are read (`--help` exits before,
    without torch), this process computes on one thread, so that the ranks it forks share the
    CPUs (checker/pool/spawn.py)."""
    if sys.stderr is None:  # started with stderr closed: print(file=None) would write to stdout
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_argv(argv)
    args.argv = argv
    if one_thread:
        # imported here, not at the top: `import tpcheck.cli` (and `--help`) needs no torch
        from tpcheck.checker.pool.spawn import keep_parent_to_one_thread

        keep_parent_to_one_thread()
    try:
        with StopOnSignals():
            code = args.func(args)
    except UsageError as e:
        print(f"tpcheck: error: {e}", file=sys.stderr)
        code = ExitCode.USAGE
    except Interrupted as e:  # before any case ran (while importing a case file, say)
        print(f"tpcheck: interrupted by {e.name}: nothing was checked", file=sys.stderr)
        code = e.exit_code
    problem = write_stdout("")  # what is still buffered: a full disk or a closed pipe shows here
    if problem:
        print(f"tpcheck: error: {problem}", file=sys.stderr)
        return ExitCode.USAGE
    return code
