"""A tpcheck case file: your dense module, your TP module, and how they relate. Check it with

    tpcheck verify THIS_FILE --world-size 2 4

It verifies as written (a column-parallel + row-parallel MLP written with torch.distributed);
replace the two modules with yours. docs/case-files.md has every field.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

SEQ, BATCH, HIDDEN, FFN = 4, 2, 16, 32


class Dense(nn.Module):
    """The reference: no parallel code. Activations [seq, batch, hidden]."""

    def __init__(self, dtype=None):
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN, dtype=dtype)
        self.down = nn.Linear(FFN, HIDDEN, dtype=dtype)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce (each rank holds a partial input gradient)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.pg)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce of the partial sums; backward: identity."""

    @staticmethod
    def forward(ctx, x, pg):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TP(nn.Module):
    """Your TP module. Parameters named as in Dense; each rank holds its part: `up` column-parallel
    (FFN/tp rows), `down` row-parallel (FFN/tp columns, the bias added once,
    after the all-reduce)."""

    def __init__(self, group, dtype=None):
        super().__init__()
        self.pg = group.pg
        local = FFN // group.world_size
        self.up = nn.Linear(HIDDEN, local, dtype=dtype)
        self.down = nn.Linear(local, HIDDEN, dtype=dtype)

    def forward(self, x):
        if self.pg is None:  # world size 1
            return self.down(F.gelu(self.up(x)))
        h = F.gelu(self.up(_CopyToTP.apply(x, self.pg)))
        return _ReduceFromTP.apply(F.linear(h, self.down.weight), self.pg) + self.down.bias


def make_batch(generator, dtype):
    """({forward argument: tensor}, target), drawn from `generator`."""
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    target = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    return {"x": x.to(dtype)}, target.to(dtype)


case = Case(
    name="my_tp_mlp",
    build_dense=lambda dtype: Dense(dtype),
    build_tp=lambda group, dtype: TP(
        group, dtype
    ),  # group: rank, world_size, pg (the process group)
    # How each dense parameter lives on the ranks. Leave it out (plan=None) and give your own
    # loader, load_tp=lambda tp, state_dict, group: ..., and tpcheck infers it
    # (--print-plan prints it).
    plan=Plan(
        params={
            "up.weight": Shard(0),
            "up.bias": Shard(0),  # column-parallel
            "down.weight": Shard(1),
            "down.bias": Replicate(),  # row-parallel
        }
    ),
    make_batch=make_batch,
    run=RunSettings(steps=3, optimizer="adamw"),  # also: dtype="bfloat16", micro_batches, lr, seed
)
