"""The tensor-parallel group as a value.

A `TPGroup` is passed to every parallel layer; nothing reads global state. That lets a dense
reference and TP models of several world sizes live in one process, and lets the checker observe
(ledger) or perturb (fault interceptor) every collective without touching the layers.

Every collective a layer issues goes through `TPGroup.collective`, which hands it to the
interceptor, if one is installed (the fault catalogue uses this to drop, repeat or misplace a
collective), else performs it. What is performed is recorded in the ledger (phase, op, site, bytes).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# The three phases of a training step in which a collective can run.
PHASES = ("forward", "backward", "optimizer")

# (op, site, phase, tensor, perform) -> tensor. `perform` does the real collective.
Interceptor = Callable[[str, str, str, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]


@dataclass
class LedgerEntry:
    rank: int
    phase: str
    op: str
    site: str
    nbytes: int


@dataclass
class TPGroup:
    """rank/world_size within the TP group, and the torch process group (None when world_size == 1)."""

    rank: int
    world_size: int
    pg: dist.ProcessGroup | None = None
    ledger: list[LedgerEntry] | None = None
    interceptor: Interceptor | None = None
    # (op, site, phase) of the collective most recently entered: names the spot of a hang.
    last_collective: tuple[str, str, str] | None = None
    # The rendezvous store, used by the checker to compare ledgers without a collective.
    store: dist.Store | None = None
    timeout_s: float = 20.0
    syncs: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a TP group of world size {self.world_size}")

    @classmethod
    def single(cls) -> TPGroup:
        """A one-rank group: every collective is the identity and nothing is communicated."""
        return cls(rank=0, world_size=1)

    @classmethod
    def from_process_group(cls, pg: dist.ProcessGroup | None = None) -> TPGroup:
        pg = pg if pg is not None else dist.group.WORLD
        return cls(rank=dist.get_rank(pg), world_size=dist.get_world_size(pg), pg=pg)

    def collective(self, op: str, x: torch.Tensor, *, site: str, phase: str) -> torch.Tensor:
        """Run collective `op` ("all_reduce", "all_gather", "reduce_scatter", the last two along dim 0)
        on `x`; the shapes are in collectives.py."""
        assert phase in PHASES, phase

        def perform(t: torch.Tensor) -> torch.Tensor:
            self.last_collective = (op, site, phase)
            if self.ledger is not None:
                self.ledger.append(LedgerEntry(self.rank, phase, op, site, t.numel() * t.element_size()))
            return _OPS[op](t, self)

        if self.interceptor is not None:
            return self.interceptor(op, site, phase, x, perform)
        return perform(x)


def _all_reduce(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    # Reduce into a fresh contiguous buffer and return *that* buffer: reducing into a temporary
    # and returning the input is the silent bug Megatron once had with non-contiguous inputs.
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group.pg)
    return out


def _all_gather(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """[n, ...] per rank -> [world * n, ...], rank-major."""
    x = x.contiguous()
    out = torch.empty((group.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _ALL_GATHER(out, x, group=group.pg)
    return out


def _reduce_scatter(x: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """[world * n, ...] per rank -> [n, ...]: rank r gets the sum over ranks of block r."""
    x = x.contiguous()
    if x.shape[0] % group.world_size:
        raise ValueError(f"reduce_scatter: dim 0 ({x.shape[0]}) does not divide by world size {group.world_size}")
    out = torch.empty((x.shape[0] // group.world_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _REDUCE_SCATTER(out, x, op=dist.ReduceOp.SUM, group=group.pg)
    return out


# torch 2.13 renamed the tensor variants; keep working on the older names (torch >= 2.4).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_OPS = {"all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter}
