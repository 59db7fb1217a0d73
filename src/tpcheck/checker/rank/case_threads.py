"""The threads a case starts on a rank (a data loader's prefetch thread, a logger, a watchdog):
tpcheck cannot stop them, so it says where they matter. While one runs beside the case's passes,
random draws the dense side's RNG guard sees may be the thread's (rng.py names it then); one still
running when the case ends is named in the report's notes, and the rank processes are replaced
before the next case (the pool reads `RankPayload.threads_left`): a thread never outlives its
case into another's checks."""

from __future__ import annotations

import contextlib
import threading

from tpcheck.checker.sourcelines import defined_at

_BEFORE: list[set[int]] = []  # the threads alive when the current case began


@contextlib.contextmanager
def watched():
    """Around one case on this rank: which threads it starts."""
    _BEFORE.append({t.ident for t in threading.enumerate()})
    try:
        yield
    finally:
        _BEFORE.pop()


def running() -> list[threading.Thread]:
    """The threads the current case started that are still running (none outside a case)."""
    if not _BEFORE:
        return []
    return [t for t in threading.enumerate() if t.ident not in _BEFORE[-1] and t.is_alive()]


def describe(threads: list[threading.Thread]) -> str:
    """Each thread by name and what it runs, at its line: `'prefetch' (prefetch, loader.py:9)`."""
    out = []
    for t in threads:
        target = getattr(t, "_target", None)
        runs = (
            f"{getattr(target, '__qualname__', target)}, {defined_at(target)}"
            if target
            else type(t).__name__
        )
        out.append(f"{t.name!r} ({runs})")
    return ", ".join(out)


def note(threads: list[threading.Thread]) -> str:
    """The report's note (after "not checked: ") on threads still running at the case's end."""
    return (
        f"what the thread(s) your code started did beside the checks: {describe(threads)} still "
        "ran at the end of the case (random draws or collectives there are timed by the thread, "
        "not by the step; the rank processes were replaced before the next case)"
    )
