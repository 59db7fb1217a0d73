"""The tensor-parallel group as a value.

A `TPGroup` is passed to every parallel layer; nothing reads global state. That lets a dense
reference and TP models of several world sizes live in one process. It is frozen: rank, world size,
the torch process group, and an optional `tap`.

Every collective a layer issues goes through `TPGroup.collective`. Without a tap it is performed;
with one, the tap is handed the collective and a `perform` function and decides (the checker's tap
records a ledger entry and may hand the collective to a fault injector that drops, repeats or
misplaces it). The library defines only the shape of a tap; what a tap does is
the checker's business.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import torch
import torch.distributed as dist

# The three phases of a training step in which a collective can run: the one spelling of each
# (the checker's ledger adds its warm-up phase: checker/vocabulary.py `LEDGER_PHASES`).
Phase = Literal["forward", "backward", "optimizer"]
PHASES: tuple[Phase, ...] = get_args(Phase)
OPS = ("all_reduce", "all_gather", "reduce_scatter")

Perform = Callable[[torch.Tensor], torch.Tensor]


class Tap(Protocol):
    """Observes (and may replace) every collective: `tap(op, site, phase, x, perform) -> tensor`,
    where `perform(x)` runs the real collective."""

    def __call__(
        self, op: str, site: str, phase: str, x: torch.Tensor, perform: Perform
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class TPGroup:
    """rank/world_size within the TP group, the torch process group (None when world_size == 1), an
    optional tap that sees every collective, and the device this rank computes on (a layer creating
    tensors or generators in its forward creates them there)."""

    rank: int
    world_size: int
    pg: dist.ProcessGroup | None = None
    tap: Tap | None = None
    device: torch.device = torch.device("cpu")

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank {self.rank} is outside a TP group of world size {self.world_size}"
            )

    @classmethod
    def single(cls) -> TPGroup:
        """A one-rank group: every collective is the identity and nothing is communicated."""
        return cls(rank=0, world_size=1)

    def collective(self, op: str, x: torch.Tensor, *, site: str, phase: str) -> torch.Tensor:
        """Run collective `op` ("all_reduce", "all_gather", "reduce_scatter", the last two along dim
        0) on `x`; the shapes are in collectives.py."""
        assert op in OPS and phase in PHASES, (op, phase)

        def perform(t: torch.Tensor) -> torch.Tensor:
            return _OPS[op](t, self)

        if self.tap is not None:
            return self.tap(op, site, phase, x, perform)
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
        raise ValueError(
            f"reduce_scatter: dim 0 ({x.shape[0]}) does not divide by world size {group.world_size}"
        )
    out = torch.empty(
        (x.shape[0] // group.world_size, *x.shape[1:]), dtype=x.dtype, device=x.device
    )
    _REDUCE_SCATTER(out, x, op=dist.ReduceOp.SUM, group=group.pg)
    return out


# torch 2.13 renamed the tensor variants; keep working on the older names (torch >= 2.4).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_OPS = {"all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter}
