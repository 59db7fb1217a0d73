"""Errors with a meaning for the exit code, and the exit codes.

`UsageError`: the user's input is wrong (sizes that do not divide, an unknown name, a plan that does
not fit). The CLI prints its message and exits `ExitCode.USAGE`. Messages name the offending value
and the fix.
"""

from __future__ import annotations

import enum
import signal


class ExitCode(enum.IntEnum):
    """What the `tpcheck` command (and `tpcheck report` read as a gate) exits with."""

    EQUIVALENT = 0  # every case got the verdict it was expected to get
    NOT_EQUIVALENT = 1  # some case did not (a TP bug found, or a planted one missed)
    USAGE = 2  # bad input: the message names the value and the fix
    ERROR = 3  # a rank raised or died, or the checker failed its self-test: no verdict
    REPAIRED = 4  # with --repair: every case that failed got a fix, each verified equivalent

    @staticmethod
    def interrupted(signum: int) -> int:
        """The code of a run stopped by a signal (SIGINT 130, SIGTERM 143, SIGHUP 129): 128 + its
        number, as a shell reports it."""
        return 128 + int(signum)


INTERRUPTED_BY = {
    ExitCode.interrupted(s): s.name for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)
}


class UsageError(ValueError):
    """A mistake in the user's input; exit code 2."""
