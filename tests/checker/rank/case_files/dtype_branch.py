"""A norm whose code branches on the dtype, as fused-kernel code does: in 16 bits one path, in
float32 and float64 another, the same function on both. The float64 run only ever runs the
second, so its pass says nothing of the first.

An MLP whose hidden activation is normalised over its whole width (a norm over a dimension TP
shards, as an all-head QK norm is): column-parallel `up`, the norm's statistic all-reduced over
the ranks, row-parallel `down` (its all-reduce in an autograd function, identity backward).

    tpcheck verify tests/checker/rank/case_files/dtype_branch.py:branch --dtype bf16

Planted bug (`local_rms_in_16_bits`): the TP side's 16-bit path takes the mean square of its own
shard only (no all-reduce); its float path is right, so the float64 run passes.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

DIM, FFN, BATCH, SEQ = 16, 64, 2, 4
SIXTEEN_BITS = (torch.bfloat16, torch.float16)


class _SumFromRanks(torch.autograd.Function):
    """All-reduce forward, identity backward: the row-parallel output's partial sums."""

    @staticmethod
    def forward(ctx, x, pg):
        x = x.clone()
        dist.all_reduce(x, group=pg)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _CopyToRanks(torch.autograd.Function):
    """Identity forward, all-reduce backward: the column-parallel input's gradient."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.pg)
        return g, None


class RowLinear(nn.Linear):
    """A row-parallel linear: its partial output summed over the ranks of `pg` (None: dense)."""

    def __init__(self, fan_in, fan_out, pg=None, dtype=None):
        super().__init__(fan_in, fan_out, bias=False, dtype=dtype)
        self.pg = pg

    def forward(self, x):
        y = super().forward(x)
        return y if self.pg is None else _SumFromRanks.apply(y, self.pg)


class WideNorm(nn.Module):
    """RMS norm over the last dimension, `width` wide in all (the shard's all-reduced with `pg`)."""

    def __init__(self, local, width, pg=None, bug=False, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local, dtype=dtype))
        self.width, self.pg, self.bug = width, pg, bug

    def _total(self, sq):
        return sq if self.pg is None else funcol.all_reduce(sq, "sum", self.pg)

    def forward(self, h):
        if h.dtype in SIXTEEN_BITS:  # the "fused" path: float32 statistic, one kernel
            h32 = h.to(torch.float32)
            sq = torch.linalg.vector_norm(h32, dim=-1, keepdim=True).square()
            if self.bug:
                ms = sq / h.shape[-1]  # the shard's own mean square
            else:
                ms = self._total(sq) / self.width
            return (h32 * torch.rsqrt(ms + 1e-6)).to(h.dtype) * self.weight
        ms = self._total(h.pow(2).sum(-1, keepdim=True)) / self.width
        return h * torch.rsqrt(ms + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, group=None, dtype=None, bug=False):
        super().__init__()
        world = 1 if group is None else group.world_size
        self.pg = None if group is None else group.pg
        self.up = nn.Linear(DIM, FFN // world, bias=False, dtype=dtype)
        self.norm = WideNorm(FFN // world, FFN, self.pg, bug, dtype)
        self.down = RowLinear(FFN // world, DIM, self.pg, dtype)

    def forward(self, x):
        h = x if self.pg is None else _CopyToRanks.apply(x, self.pg)
        return x + self.down(torch.nn.functional.silu(self.norm(self.up(h))))


def make_batch(g, dtype):
    x = torch.randn(BATCH, SEQ, DIM, generator=g, dtype=dtype)
    return {"x": x}, torch.randn(BATCH, SEQ, DIM, generator=g, dtype=dtype)


PLAN = Plan(
    params={"up.weight": Shard(0), "norm.weight": Shard(0), "down.weight": Shard(1)},
    activations={"up": Shard(2), "norm": Shard(2), "down": Replicate()},
)


def _case(name, bug=False):
    return Case(
        name=name,
        build_dense=lambda dtype: Block(None, dtype),
        build_tp=lambda group, dtype: Block(group, dtype, bug),
        plan=PLAN,
        make_batch=make_batch,
        loss=lambda out, target: torch.nn.functional.mse_loss(out.float(), target.float()),
        run=RunSettings(steps=2),
    )


branch = _case("dtype_branch")
local_rms_in_16_bits = _case("dtype_branch_local_rms_in_16_bits", bug=True)
