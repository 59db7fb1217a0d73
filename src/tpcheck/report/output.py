"""Where reports go: an output path is checked before any rank starts; `schema.write_atomic` writes
it after the run, never replacing what is not a regular file.

- A regular file (or a new one) is replaced atomically: a temp file in the same directory, then
  `os.replace`; a crash leaves the old file or none, never half a file. It gets the mode a new file
  gets under the umask (0666 & ~umask), as a shell redirection would.
- A symlink is written through: its target is written as above, the link stays a link.
- A character device (/dev/null, /dev/stdout) or a FIFO is opened and written, never replaced.
- A directory, a block device, a socket, a path under a regular file, a missing directory, a place
  where no file can be created and an empty path are refused before the run (UsageError, exit 2).
"""

from __future__ import annotations

import os
import stat
import tempfile

from tpcheck.errors import UsageError


def written_directly(mode: int) -> bool:
    """Is a file of this `st_mode` opened and written
    rather than replaced (a character device, a FIFO)?"""
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def check_output_path(flag: str, path: str | None) -> None:
    """Raise UsageError (one line: the flag, the path, the problem) unless a report can be written
    at `path`; None (the flag not given) is fine."""
    if path is None:
        return
    problem = output_problem(path)
    if problem:
        raise UsageError(f"{flag} {path!r}: {problem}")


def output_problem(path: str) -> str | None:
    """Why a report cannot be written at `path`, or None when it can."""
    if not path:
        return "an empty path; give a file name"
    if path.endswith(os.sep):
        return "ends with a path separator; give a file name"
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return _directory_problem(os.path.dirname(target))
    except NotADirectoryError:
        return f"is under {_first_non_directory(target)!r}, which is not a directory"
    except OSError as e:  # a symlink loop, no permission to look
        return f"cannot be used: {e.strerror}"
    if stat.S_ISDIR(mode):
        return "is a directory; give a file name inside it"
    if stat.S_ISREG(mode):
        return _directory_problem(os.path.dirname(target))
    if written_directly(mode):
        return None if os.access(target, os.W_OK) else "is not writable"
    kind = (
        "a block device (a disk)"
        if stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a file"
    )
    return f"is {kind}; give a regular file, a FIFO or a character device such as /dev/null"


def _first_non_directory(path: str) -> str:
    """The first ancestor of `path` that exists but is not a directory (e.g. a regular file)."""
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        ancestor = os.sep.join(parts[:i])
        if os.path.exists(ancestor) and not os.path.isdir(ancestor):
            return ancestor
    return os.path.dirname(path)


def _directory_problem(directory: str) -> str | None:
    """Why no new file can be created in `directory` (tried with a probe file), or None."""
    try:
        mode = os.stat(directory).st_mode
    except FileNotFoundError:
        return f"directory {directory!r} does not exist; create it first"
    except NotADirectoryError:
        return f"is under {_first_non_directory(directory)!r}, which is not a directory"
    except OSError as e:
        return f"directory {directory!r} cannot be used: {e.strerror}"
    if not stat.S_ISDIR(mode):
        return f"{directory!r} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".tpcheck-probe-")
    except OSError as e:
        return f"cannot create a file in {directory!r}: {e.strerror}"
    os.close(fd)
    os.unlink(probe)
    return None


def current_umask() -> int:
    """The process's umask (read by setting it and
    putting it back: there is no other portable way)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
