"""Losses for TP outputs that are sharded over the sequence (vocab-parallel cross-entropy is in
cross_entropy.py)."""

from __future__ import annotations

import torch

from tpcheck.parallel.collectives import reduce_from_tp_region
from tpcheck.parallel.group import TPGroup


def sp_mse_loss(
    out_local: torch.Tensor, target_local: torch.Tensor, group: TPGroup
) -> torch.Tensor:
    """MSE over the whole sequence when each rank holds a sequence shard: local sum / global count,
    summed over ranks (forward all-reduce at site "loss", backward identity)."""
    sq = (out_local - target_local).pow(2).sum() / (out_local.numel() * group.world_size)
    return reduce_from_tp_region(sq, group, "loss")
