"""tpcheck: prove a tensor-parallel implementation computes what its dense model computes.

The public API, re-exported lazily: `import tpcheck` (and so `tpcheck --help`, and pytest loading
the plugin) imports no torch; the first use of a name imports the module that defines it."""

from __future__ import annotations

import importlib

from tpcheck._version import __version__
from tpcheck.errors import UsageError

# name -> the module that defines it
_LAZY = {
    "check": "tpcheck.api",
    "exit_code": "tpcheck.api",
    "Case": "tpcheck.checker.case",
    "CaseSpec": "tpcheck.checker.case",
    "Injection": "tpcheck.checker.case",
    "RunSettings": "tpcheck.checker.settings",
    "TPGroup": "tpcheck.parallel.group",
    "Plan": "tpcheck.plan",
    "Placement": "tpcheck.plan",
    "Replicate": "tpcheck.plan",
    "Shard": "tpcheck.plan",
    "Fused": "tpcheck.plan",
    "AppliedOnRank": "tpcheck.plan",
    "OnRank": "tpcheck.plan",
}

__all__ = [*_LAZY, "UsageError", "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tpcheck' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # once imported, an attribute like any other
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
