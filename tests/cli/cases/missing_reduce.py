"""A row-parallel MLP whose down projection forgets its all-reduce (and its correct twin)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

SEQ, BATCH, HIDDEN, FFN = 4, 2, 16, 32


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
    def forward(ctx, x, pg):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Linear):
    def __init__(self, n_in, n_out, group):
        super().__init__(n_in, n_out // group.world_size)
        self.pg = group.pg

    def forward(self, x):
        return super().forward(CopyToTP.apply(x, self.pg))


class RowParallelLinear(nn.Linear):
    def __init__(self, n_in, n_out, group, reduce=True):
        super().__init__(n_in // group.world_size, n_out, bias=False)
        self.pg, self.reduce = group.pg, reduce

    def forward(self, x):
        partial = super().forward(x)
        return ReduceFromTP.apply(partial, self.pg) if self.reduce else partial


class MLP(nn.Module):
    def __init__(self, up, down):
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = mlp

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def dense(dtype):
    return Block(MLP(nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN, bias=False))).to(dtype)


def tp(reduce):
    def build(group, dtype):
        mlp = MLP(
            ColumnParallelLinear(HIDDEN, FFN, group), RowParallelLinear(FFN, HIDDEN, group, reduce)
        )
        return Block(mlp).to(dtype)

    return build


def make_batch(g, dtype):
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    return {"x": x.to(dtype)}, torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dtype)


PLAN = Plan(
    params={
        "norm.weight": Replicate(),
        "norm.bias": Replicate(),
        "mlp.up.weight": Shard(0),
        "mlp.up.bias": Shard(0),
        "mlp.down.weight": Shard(1),
    },
)
WRITTEN = Plan(params=PLAN.params, activations={"mlp.down": Replicate()})
common = dict(build_dense=dense, plan=PLAN, make_batch=make_batch, run=RunSettings(steps=2))
correct = Case(name="mlp", build_tp=tp(True), **common)
missing_reduce = Case(name="mlp_missing_reduce", build_tp=tp(False), **common)
common["plan"] = WRITTEN
written = Case(name="mlp_missing_reduce_written", build_tp=tp(False), **common)
