"""What every command shares, kept light (it is imported for `tpcheck --help`): stopping on signals,
writing stdout, the exit code once the outputs are written."""

from __future__ import annotations

import os
import signal
import sys
import threading

from tpcheck.errors import ExitCode

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# ------------------------------------------------------------------------------ signals


class Interrupted(BaseException):
    """A signal stopped the run (a BaseException, like KeyboardInterrupt: no `except Exception` in
    user or library code swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.name = signum, signal.Signals(signum).name

    @property
    def exit_code(self) -> int:
        return ExitCode.interrupted(self.signum)


class StopOnSignals:
    """While a command runs: the first SIGINT/SIGTERM/SIGHUP raises Interrupted in the main thread
    (the run stops its ranks and reports what finished); a second one kills every rank, removes the
    temp dirs and exits at once. Handlers are restored on exit (tests call `main` in-process)."""

    def __init__(self) -> None:
        self.saved: dict[int, object] = {}
        self.count = 0

    def __enter__(self) -> StopOnSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self.saved[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        self.count += 1
        if self.count > 1:
            # here, not at the top: this module is imported for `--help`; the pool imports torch
            from tpcheck.checker.pool.spawn import kill_all

            kill_all()
            name = signal.Signals(signum).name
            print(f"tpcheck: interrupted again by {name}: stopped at once", file=sys.stderr)
            os._exit(ExitCode.interrupted(signum))
        raise Interrupted(signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


# ------------------------------------------------------------------------------ stdout


def write_stdout(text: str) -> str | None:
    """Write `text` to stdout and flush it; on failure (a full disk, a closed pipe) return the
    problem and point stdout at /dev/null, so that Python's own flush at exit cannot fail again with
    a traceback."""
    if sys.stdout is None:  # started with stdout closed
        return "stdout is closed: the seed's JSON was not printed" if text else None
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # the reader stopped reading (`tpcheck faults | head`): not an error
        _stdout_to_devnull()
        return None
    except OSError as e:
        _stdout_to_devnull()
        return f"stdout: cannot write: {e.strerror or e}"
    return None


def _stdout_to_devnull() -> None:
    """Point stdout's file descriptor at /dev/null: what is still buffered cannot fail again at
    exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor behind sys.stdout: nothing left to flush
        pass


def exit_after_outputs(failed: list[str], code: int) -> int:
    """The exit code once the outputs are written: 2 when one failed (each said on stderr), else
    `code`."""
    if not failed:
        return code
    for line in failed:
        print(f"tpcheck: error: {line}", file=sys.stderr)
    print(
        f"tpcheck: error: exit 2 because an output failed (the checks alone give exit {code}; "
        "the other outputs were written)",
        file=sys.stderr,
    )
    return ExitCode.USAGE
