"""The collective ledger: what each rank issued (count and bytes per phase, op and site), compared
with what the case's block implies. A missing, extra or rank-asymmetric collective is reported even
when the numbers happen to agree (a redundant all-reduce is a cost; a missing one a latent bug)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable

import torch

from tpcheck.checker.case import Interceptor
from tpcheck.checker.payload import LedgerEntry, ledger_diff
from tpcheck.checker.sync import CollectiveMismatch, Rendezvous, RendezvousTimeout
from tpcheck.checker.vocabulary import WARMUP
from tpcheck.parallel.group import Phase


class CollectiveTap:
    """The checker's tap on a TPGroup (see parallel/group.py): records every collective performed in
    the ledger, remembers the last one entered (it names the spot of a hang), and hands each one to
    a fault's interceptor when one is installed."""

    def __init__(self, rank: int, interceptor: Interceptor | None = None) -> None:
        self.rank, self.interceptor = rank, interceptor
        self.ledger: list[LedgerEntry] = []
        self.last: tuple[str, str, str] | None = None  # (op, site, phase) of the last one entered
        # the one being performed now (kept if it raises)
        self.inside: tuple[str, str, str] | None = None
        # the TP side's phase now (what the user's own collectives are counted in)
        self.phase: str | None = None
        self.warming = False  # the warm-up forwards run: every collective recorded as WARMUP

    def __call__(self, op: str, site: str, phase: str, x: torch.Tensor, perform) -> torch.Tensor:
        def recorded(t: torch.Tensor) -> torch.Tensor:
            self.note(op, site, phase, t.numel() * t.element_size())
            return self.performing(self.last, perform, t)

        if self.interceptor is not None:
            return self.interceptor(op, site, phase, x, recorded)
        return recorded(x)

    def note(self, op: str, site: str, phase: str, nbytes: int = 0) -> None:
        """Record a collective (adapters whose collectives
        bypass the TPGroup call this directly)."""
        phase = WARMUP if self.warming else phase
        self.last = (op, site, phase)
        self.ledger.append(LedgerEntry(self.rank, phase, op, site, nbytes))

    def performing(self, label: tuple[str, str, str], fn, *args, **kwargs):
        """`fn(*args, **kwargs)` while `inside` names the collective: what a rank stuck in it is
        waiting in. A collective that raises (timed out) leaves `inside` set, for
        the rank's report."""
        self.last = self.inside = label
        out = fn(*args, **kwargs)
        self.inside = None
        return out

    @contextlib.contextmanager
    def tp_phase(self, phase: Phase):
        """While the TP side runs `phase` (forward, backward, optimizer): direct torch.distributed
        calls of the code under test are counted in it (`count_user_collectives`)."""
        self.phase = phase
        try:
            yield
        finally:
            self.phase = None

    @contextlib.contextmanager
    def warming_up(self):
        """While the TP side runs its warm-up forwards: every collective (tpcheck's, the user's own,
        an adapter's) recorded in phase WARMUP, outside the per-step counts; a fault's interceptor
        still sees the phase the code gave."""
        self.warming, self.phase = True, WARMUP
        try:
            yield
        finally:
            self.warming, self.phase = False, None

    def lines(self) -> list[str]:
        return [e.line() for e in self.ledger]


def sync_ledgers(tap: CollectiveTap, rendezvous: Rendezvous, where: str) -> None:
    """Before the checker's own collectives, every rank must have issued the same model collectives.
    Ledgers are exchanged through the rendezvous store, not a collective, so a rank out of step
    cannot make the checker's collectives pair with the model's (gloo aborts on such
    a size mismatch)."""
    if not rendezvous.active:
        return
    mine = tap.lines()
    try:
        said = rendezvous.exchange("sync", "\n".join(mine), label=where)
    except RendezvousTimeout as e:
        raise CollectiveMismatch(
            f"hang detected: rank(s) {e.missing} did not reach the checkpoint after {where} within "
            f"{rendezvous.timeout_s:g} s; this rank had issued {len(mine)} collective(s), the last "
            f"{mine[-1] if mine else 'none'}",
            checkpoint=where,
        ) from None
    ledgers = [text.split("\n") if text else [] for text in said]
    if any(ld != ledgers[0] for ld in ledgers):
        raise CollectiveMismatch(
            f"collective mismatch after {where}: " + ledger_diff(dict(enumerate(ledgers))),
            checkpoint=where,
        )


# ----------------------------------------------------------------------- the user's own collectives

USER_SITE = "torch.distributed"  # the site of a collective the code under test issued itself
USER_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "all_gather_object",
    "broadcast_object_list",
)


def count_user_collectives(current_tap: Callable[[], CollectiveTap | None]) -> None:
    """Count, in the current case's ledger, the torch.distributed collectives the code under test
    calls directly (a case file written with torch.distributed, not through a TPGroup), while the TP
    side runs a phase: they are then compared across ranks like tpcheck's own (a collective issued
    on some ranks only shows at the next checkpoint). Installed once in a rank process (it patches
    the functions of torch.distributed and its distributed_c10d module); tpcheck's own collectives,
    made inside the tap, are not counted twice. The site is always "torch.distributed": ranks may
    legitimately issue one collective from different lines."""
    import torch.distributed as dist

    c10d = sys.modules["torch.distributed.distributed_c10d"]
    for name in USER_COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "_tpcheck_counted", False):
            continue
        counted = _counted(original, name, current_tap)
        setattr(c10d, name, counted)
        if getattr(dist, name, None) is original:
            setattr(dist, name, counted)


def _counted(func, name: str, current_tap: Callable[[], CollectiveTap | None]):
    """`func` (torch.distributed's `name`) counted in the current tap's ledger. The wrapped function
    is the closure variable `func`, as in torch's own c10d_logger wrappers: the heartbeat reads it
    from a frame of `counted` (pool/heartbeat.py), so a rank sampled here is in that collective."""

    def counted(*args, **kwargs):
        tap = current_tap()
        if tap is not None and tap.inside is None and tap.phase is not None:
            first = args[0] if args else None
            nbytes = first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0
            tap.note(name, USER_SITE, tap.phase, nbytes)
            return tap.performing((name, USER_SITE, tap.phase), func, *args, **kwargs)
        return func(*args, **kwargs)

    functools.update_wrapper(counted, func)
    counted._tpcheck_counted = True
    return counted
