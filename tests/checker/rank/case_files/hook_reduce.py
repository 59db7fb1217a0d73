"""A row-parallel layer whose all-reduce a forward hook does, as code that parallelizes a model
from outside writes it (`module.register_forward_hook(reduce)` on the dense module class): the
layer itself is the plain `nn.Linear` of the dense model, its weight's input columns sharded.

Correct (`hook_then_bias`): the row-parallel `down` has no bias; the block adds the replicated
bias after the hook's all-reduce. Planted bug (`bias_before_hook`): `down` keeps its own bias,
added by `nn.Linear` on every rank before the hook sums the ranks' outputs, so the bias is counted
world-size times: the diagnosis reads `offset` (the bias added on each rank), as when the
all-reduce is inside the module.

    tpcheck verify tests/checker/rank/case_files/hook_reduce.py --world-size 2
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

DIM, FFN, BATCH, SEQ = 16, 64, 2, 6


class _CopyToRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.pg)
        return g, None


class _SumFromRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        x = x.clone()
        dist.all_reduce(x, group=pg)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class Mlp(nn.Module):
    """`own_bias`: `down` carries the output bias (nn.Linear's); else the block adds it."""

    def __init__(self, world=1, dtype=None, own_bias=False):
        super().__init__()
        self.up = nn.Linear(DIM, FFN // world, bias=False, dtype=dtype)
        self.down = nn.Linear(FFN // world, DIM, bias=own_bias, dtype=dtype)
        self.bias = None if own_bias else nn.Parameter(torch.zeros(DIM, dtype=dtype))
        self.pg = None

    def forward(self, x):
        h = x if self.pg is None else _CopyToRanks.apply(x, self.pg)
        y = self.down(F.gelu(self.up(h)))
        return x + (y if self.bias is None else y + self.bias)


def parallelize(model: Mlp, group) -> Mlp:
    """From outside: the input copied to the ranks in the block, `down`'s output summed by a
    hook."""
    model.pg = group.pg
    model.down.register_forward_hook(lambda module, args, out: _SumFromRanks.apply(out, group.pg))
    return model


def make_batch(g, dtype):
    x = torch.randn(BATCH, SEQ, DIM, generator=g, dtype=dtype)
    return {"x": x}, torch.randn(BATCH, SEQ, DIM, generator=g, dtype=dtype)


def _case(name, own_bias):
    bias = {"down.bias": Replicate()} if own_bias else {"bias": Replicate()}
    return Case(
        name=name,
        build_dense=lambda dtype: Mlp(1, dtype, own_bias),
        build_tp=lambda group, dtype: parallelize(Mlp(group.world_size, dtype, own_bias), group),
        plan=Plan(params={"up.weight": Shard(0), "down.weight": Shard(1), **bias}),
        make_batch=make_batch,
        loss=lambda out, target: F.mse_loss(out, target),
        run=RunSettings(steps=1),
    )


hook_then_bias = _case("hook_then_bias", own_bias=False)
bias_before_hook = _case("bias_before_hook", own_bias=True)
