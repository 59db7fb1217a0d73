"""Small injectors the catalogue is built from. Each returns a `tamper(tp_module, group)` callable."""
from __future__ import annotations

from tpcheck.parallel.group import TPGroup


def drop_collective(op: str, site: str, phase: str, ranks=lambda rank, world: True):
    """The collective `op` at `site` in `phase` is not issued (on the ranks `ranks` selects): its input
    passes through unchanged."""

    def tamper(module, group: TPGroup) -> None:
        def intercept(op_, site_, phase_, x, perform):
            if (op_, site_, phase_) == (op, site, phase) and ranks(group.rank, group.world_size):
                return x
            return perform(x)

        group.interceptor = intercept

    return tamper
