"""Source locations as people read them: whose code a frame is (`frame_kind`), the user's line an
exception was raised at (`user_frame`), where a callable is defined (`defined_at`), and paths
shortened for messages (`readable_path`, `short_path`).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import re
import sysconfig
import traceback

_TPCHECK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(importlib.util.find_spec("torch").origin) + os.sep
_PYTHON_DIRS = tuple(
    {sysconfig.get_paths()["stdlib"] + os.sep, os.path.dirname(os.__file__) + os.sep}
)
_INSTALLED = ("site-packages/", "dist-packages/")
_PYTHON_LIB = re.compile(r"/lib/python3[.\d]*/")


@functools.lru_cache(maxsize=4096)
def frame_kind(path: str) -> str:
    """Whose code a frame's file is: "user" (the code under test: the user's files and the libraries
    they call, transformers or Megatron-Core), "tpcheck", "torch" or "python" (the standard library,
    frozen and generated code). The one rule for every place that names the user's line: an
    exception's frame (`user_frame`), a rank's traceback (verdict/failures.py), a rank's live stack
    (pool/heartbeat.py). Paths from another host (a rank's traceback under torchrun) are told by
    their installed layout."""
    if not path or path.startswith("<"):
        return "python"
    slashed = path.replace(os.sep, "/")
    for kind, own_dir in (("tpcheck", _TPCHECK_DIR), ("torch", _TORCH_DIR)):
        if path.startswith(own_dir) or any(f"{where}{kind}/" in slashed for where in _INSTALLED):
            return kind
    if any(where in slashed for where in _INSTALLED):
        return "user"
    return "python" if path.startswith(_PYTHON_DIRS) or _PYTHON_LIB.search(slashed) else "user"


def caller(frame):
    """The first frame from `frame` outward that does more than hand a torch call on: not
    torch's or Python's own code, nor one of tpcheck's function modes (`__torch_function__`)
    calling the operation it intercepted; None past the outermost."""
    while frame is not None:
        kind = frame_kind(frame.f_code.co_filename)
        if kind not in ("torch", "python") and not (
            kind == "tpcheck" and frame.f_code.co_name == "__torch_function__"
        ):
            return frame
        frame = frame.f_back
    return None


def user_frame(exc: BaseException, path: str | None) -> str:
    """ "file.py:LINE" of the deepest traceback frame in the user's file `path` (else in any code
    under test, `frame_kind`)."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if path and os.path.abspath(f.filename) == path]
    if not mine:
        mine = [f for f in frames if frame_kind(os.path.abspath(f.filename)) == "user"]
    if not mine:
        return short_path(path) if path else "?"
    return f"{short_path(mine[-1].filename)}:{mine[-1].lineno}"


def defined_at(fn) -> str:
    """ "file.py:LINE" where the user's callable is defined."""
    target = inspect.unwrap(fn)
    try:
        return (
            f"{short_path(os.path.abspath(inspect.getsourcefile(target)))}:"
            f"{inspect.getsourcelines(target)[1]}"
        )
    except (TypeError, OSError):
        return getattr(target, "__qualname__", repr(target))


def _defined_in(fn) -> str | None:
    try:
        return os.path.abspath(inspect.getsourcefile(inspect.unwrap(fn)))
    except (TypeError, OSError):
        return None


def readable_path(path: str) -> str:
    """A source path as people read it: from the installed package's root
    ('transformers/models/x/modeling_x.py') when it is installed, else `short_path`'s."""
    slashed = path.replace(os.sep, "/")
    for where in _INSTALLED:
        if where in slashed:
            return slashed.split(where, 1)[1]
    return short_path(path)


def short_path(path: str | None) -> str:
    if not path:
        return "?"
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path
