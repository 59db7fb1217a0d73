"""torch.distributed's collectives as torch defines them, taken when tpcheck is imported (before
any case file runs): the checker's own collectives (the replica checks, the partial-sum test of
the inferred activations) run through these. A user's replacement of `torch.distributed.all_reduce`
(a logging, averaging or compressing wrapper) then acts on the TP code that calls it, as in the
real run, never on tpcheck's checks; and the report names the replacement (`replaced`)."""

from __future__ import annotations

import contextlib
import sys

import torch.distributed as dist

from tpcheck.checker.rank.ledger import USER_COLLECTIVES
from tpcheck.checker.sourcelines import defined_at

NAMES = USER_COLLECTIVES  # every collective a case may call through torch.distributed
_TORCH = {name: getattr(dist, name) for name in NAMES if hasattr(dist, name)}
all_reduce = _TORCH["all_reduce"]


def replaced() -> list[str]:
    """The report's notes (after "not checked: ") on the collectives of `torch.distributed` that
    other code replaced (tpcheck's own counting of them, checker/rank/ledger.py, aside)."""
    out = []
    for name, fn in _TORCH.items():
        now = getattr(dist, name, fn)
        if now is not fn and not getattr(now, "_tpcheck_counted", False):  # ledger.py's count
            by = f"{getattr(now, '__qualname__', type(now).__name__)}, {defined_at(now)}"
            out.append(
                f"your replacement of torch.distributed.{name} ({by}), by tpcheck's own checks, "
                f"which use torch's; your TP code's {name} calls run through it"
            )
    return out


@contextlib.contextmanager
def kept():
    """torch.distributed's collectives (and distributed_c10d's) as they were on entry, put back on
    exit: a replacement a case makes does not act on the next case of the rank process."""
    modules = (dist, sys.modules["torch.distributed.distributed_c10d"])
    saved = [(m, name, getattr(m, name)) for m in modules for name in NAMES if hasattr(m, name)]
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)
