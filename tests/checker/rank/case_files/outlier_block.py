"""A pre-norm MLP block whose input holds one "massive activation" (one element of OUTLIER, as LLM
residual streams have), written the way public TP code writes it: an RMSNorm with a replicated
weight, fc1 column-parallel and fc2 row-parallel through two hand-written autograd functions on
torch.distributed.

    correct        the block as it should be
    averaged       the row-parallel all-reduce averages instead of summing (ReduceOp.AVG written as
                   SUM / world): the MLP branch is divided by the world size
    partial_x1_3   the last rank's partial sum enters the all-reduce ×1.3
    partial_5e_4   the last rank's partial sum enters the all-reduce ×(1 + 5e-4)

`*_plain` twins: the same without the outlier. Each case's own outlier and fault come from
`_case(...)`; the dtype is the test's (file_spec(..., dtype=...)).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

SEQ, BATCH, HIDDEN, FFN = 8, 2, 32, 64


class CopyToTP(torch.autograd.Function):
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
    @staticmethod
    def forward(ctx, x, pg, fault, scale):
        out = x.contiguous().clone()
        if fault == "scaled" and dist.get_rank(pg) == dist.get_world_size(pg) - 1:
            out = out * scale
        dist.all_reduce(out, group=pg)
        if fault == "averaged":
            out = out / dist.get_world_size(pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class RMSNorm(nn.Module):
    def __init__(self, dim, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(
            x.dtype
        ) * self.weight


class DenseBlock(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.norm = RMSNorm(HIDDEN, dtype)
        self.fc1 = nn.Linear(HIDDEN, FFN, bias=False, dtype=dtype)
        self.fc2 = nn.Linear(FFN, HIDDEN, bias=False, dtype=dtype)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TPBlock(nn.Module):
    def __init__(self, group, dtype=None, fault=None, scale=1.0):
        super().__init__()
        self.pg, self.fault, self.scale = group.pg, fault, scale
        self.norm = RMSNorm(HIDDEN, dtype)
        self.fc1 = nn.Linear(HIDDEN, FFN // group.world_size, bias=False, dtype=dtype)
        self.fc2 = nn.Linear(FFN // group.world_size, HIDDEN, bias=False, dtype=dtype)

    def forward(self, x):
        h = CopyToTP.apply(self.norm(x), self.pg)
        partial = self.fc2(F.gelu(self.fc1(h)))
        return x + ReduceFromTP.apply(partial, self.pg, self.fault, self.scale)


def init(module, g):
    with torch.no_grad():
        module.fc1.weight.copy_(torch.randn(module.fc1.weight.shape, generator=g) * HIDDEN**-0.5)
        module.fc2.weight.copy_(torch.randn(module.fc2.weight.shape, generator=g) * FFN**-0.5)


def _batch(outlier):
    def make_batch(g, dtype):
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        if outlier:
            x[1, 0, 3] = outlier  # one massive activation in one token's residual stream
        target = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        return {"x": x.to(dtype)}, target.to(dtype)

    return make_batch


PLAN = Plan(params={"norm.weight": Replicate(), "fc1.weight": Shard(0), "fc2.weight": Shard(1)})


def _case(name, outlier, fault=None, scale=1.0):
    return Case(
        name=name,
        build_dense=DenseBlock,
        build_tp=lambda group, dtype: TPBlock(group, dtype, fault, scale),
        plan=PLAN,
        make_batch=_batch(outlier),
        init=init,
        run=RunSettings(steps=1),
    )


correct = _case("outlier_correct", 1e3)
averaged = _case("outlier_averaged", 1e3, "averaged")
partial_x1_3 = _case("outlier_partial_x1_3", 1e3, "scaled", 1.3)
correct_1e4 = _case("outlier_1e4_correct", 1e4)
partial_5e_4 = _case("outlier_1e4_partial_5e_4", 1e4, "scaled", 1 + 5e-4)
averaged_plain = _case("plain_averaged", 0.0, "averaged")
partial_x1_3_plain = _case("plain_partial_x1_3", 0.0, "scaled", 1.3)
