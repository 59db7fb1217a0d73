"""A user's own TP module, written with torch.distributed directly, checked against its dense twin.

    tpcheck verify examples/own_module.py:correct --world-size 2 4
    tpcheck verify examples/own_module.py:buggy --world-size 2     # exits 1: the planted bug

The block is x + fc2(gelu(fc1(x))), activations [seq, batch, hidden]. The TP version is the classic
column + row pair: fc1 column-parallel (weight and bias Shard(0)), fc2 row-parallel (weight
Shard(1), bias replicated). Two hand-written autograd functions carry the collectives.

Planted bug (`buggy`): fc2's bias is added on every rank *before* the all-reduce, so it is counted
world_size times. tpcheck flags the forward output of step 1 as the first divergent tensor.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

SEQ, BATCH, HIDDEN, FFN = 4, 2, 16, 32


class CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce (each rank holds a partial input grad)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.pg)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce of the partial sums; backward: identity."""

    @staticmethod
    def forward(ctx, x, pg):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class DenseBlock(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN, dtype=dtype)
        self.fc2 = nn.Linear(FFN, HIDDEN, dtype=dtype)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))  # [s, b, h]


class TPBlock(nn.Module):
    """Same parameter names as DenseBlock; fc1 holds FFN/tp rows, fc2 FFN/tp columns."""

    def __init__(self, group, dtype=None, bias_before_reduce=False):
        super().__init__()
        self.pg, self.bias_before_reduce = group.pg, bias_before_reduce
        ffn_local = FFN // group.world_size
        self.fc1 = nn.Linear(HIDDEN, ffn_local, dtype=dtype)
        self.fc2 = nn.Linear(ffn_local, HIDDEN, dtype=dtype)

    def forward(self, x):
        x_tp = CopyToTP.apply(x, self.pg) if self.pg is not None else x  # [s, b, h]
        h_local = F.gelu(self.fc1(x_tp))  # [s, b, ffn/tp]
        if self.bias_before_reduce:  # the planted bug: the bias is summed world_size times
            partial = F.linear(h_local, self.fc2.weight, self.fc2.bias)
            out = ReduceFromTP.apply(partial, self.pg) if self.pg is not None else partial
        else:
            partial = F.linear(h_local, self.fc2.weight)  # [s, b, h], partial sums
            out = ReduceFromTP.apply(partial, self.pg) if self.pg is not None else partial
            out = out + self.fc2.bias
        return x + out


def init(module, g):
    """Seeded weights for the dense model; the TP one is filled from it through the plan."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def make_batch(g, dtype):
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    target = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    return {"x": x.to(dtype)}, target.to(dtype)


PLAN = Plan(
    params={
        "fc1.weight": Shard(0),
        "fc1.bias": Shard(0),  # column-parallel
        "fc2.weight": Shard(1),
        "fc2.bias": Replicate(),  # row-parallel, bias added after the reduction
    }
)

correct = Case(
    name="own_mlp",
    build_dense=DenseBlock,
    build_tp=lambda group, dtype: TPBlock(group, dtype),
    plan=PLAN,
    make_batch=make_batch,
    init=init,
    run=RunSettings(steps=2),
)

buggy = Case(
    name="own_mlp_bias_before_reduce",
    build_dense=DenseBlock,
    build_tp=lambda group, dtype: TPBlock(group, dtype, bias_before_reduce=True),
    plan=PLAN,
    make_batch=make_batch,
    init=init,
    run=RunSettings(steps=2),
)
