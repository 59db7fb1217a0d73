"""Errors with a meaning for the exit code.

`UsageError`: the user's input is wrong (sizes that do not divide, an unknown name, a plan that does
not fit). The CLI prints its message and exits 2. Messages name the offending value and the fix.
"""
from __future__ import annotations

EXIT_EQUIVALENT = 0
EXIT_NOT_EQUIVALENT = 1
EXIT_USAGE = 2
EXIT_ERROR = 3  # a rank raised or died, or the checker failed its self-test: no verdict


class UsageError(ValueError):
    """A mistake in the user's input; exit code 2."""
