"""Tensors held on every rank but applied on one (`AppliedOnRank(r)`: a row-parallel bias added
before the all-reduce, on rank r only).

Only rank r compares such a tensor's gradient and update, whole (`ALONE`: no replica check across
ranks); the other ranks hold its gradient to being absent or zero, and have nothing to compare after
the step (their optimizer does not step it; each step restarts from the dense weights). Its bound
needs the float64 truth, which only rank 0 holds: rank 0 computes it and sends it through the store.
"""

from __future__ import annotations

import dataclasses
import json

import torch

from tpcheck.checker.checkid import CheckId
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.rank.optimizer import AdaptiveSlack
from tpcheck.checker.rank.tolerance import Bound
from tpcheck.checker.sync import Rendezvous
from tpcheck.plan import Placement


class _Alone(Placement):
    """The whole tensor on this rank, compared here only (no replica check across ranks): the
    gradient and update of a tensor applied on one rank (AppliedOnRank)."""

    def shard(self, dense, rank, world):
        return dense

    def may_share(self, world: int) -> bool:
        return False

    def __str__(self) -> str:
        return "this rank only"


ALONE = _Alone()


def owner_bound(
    cmp: Comparator,
    rendezvous: Rendezvous,
    slack: AdaptiveSlack | None,
    step: int,
    stage: str,
    name: str,
    owner: int,
    p,
    truth_p,
    dense_val,
    truth_val,
) -> Bound | None:
    """The bound for a tensor applied on a rank other than 0 (AppliedOnRank(r)): only rank r
    compares its gradient and update, only rank 0 holds the float64 truth that bounds them. Rank 0
    computes the bound as rank r would (the truth relaxed by the optimizer's allowance, as rank r
    relaxes its own side) and sends it through the store; rank r gets it, the others None."""
    text = ""
    if truth_val is not None:
        truth = truth_val.detach()
        if stage == "optimizer" and slack is not None:
            truth = slack.relax_truth(p, truth_p, truth)
        text = json.dumps(
            dataclasses.asdict(cmp.calibrated(dense_val.detach(), truth, dense_val.dtype))
        )
    said = rendezvous.exchange("bound", text, label=f"the bound of {name} ({stage}, step {step})")
    # else: no verdict
    return Bound(**json.loads(said[0])) if cmp.group.rank == owner and said[0] else None


def not_applied_here(
    cmp: Comparator,
    dtype: torch.dtype,
    step: int,
    stage: str,
    name: str,
    tp_val,
    dense_val,
    owner: int,
) -> None:
    """A tensor held on every rank but applied on `owner` only, on another rank: its gradient must
    be absent or zero (else it was applied here too); its weight is not stepped by the optimizer
    here, so it has nothing to compare after the step (each step restarts from
    the dense weights)."""
    if stage != "grads" or dense_val is None:
        return
    zeros = torch.zeros_like(dense_val)
    mine = tp_val.detach() if tp_val is not None else zeros.to(dtype)
    cmp.compare_local(
        stage,
        step,
        CheckId("grad", name),
        mine,
        zeros.to(mine.dtype),
        ALONE,
        f"bitwise: zero, the tensor is applied on rank {owner} only",
    )
