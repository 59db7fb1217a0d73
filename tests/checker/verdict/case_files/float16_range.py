"""A float16 block whose first module output reaches past half of float16's range, written as TP
codebases write it: an input scale (`amp`), a Llama-style RMSNorm that normalizes in float32, then a
column + row parallel MLP over plain torch.distributed calls.

`near_range`: one element of `amp`'s output is about 4e4 (above 32752, half of 65504), the rest
about 1e4; every tensor stays finite. `overflowing`: `amp` scales 100 times as much, so the dense
float16 model itself overflows to inf (bad input, not a TP bug).
"""

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


class Amplify(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class RMSNorm(nn.Module):
    def __init__(self, dim, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * normed.to(x.dtype)


class Block(nn.Module):
    """Dense (group None) or TP: the same parameter names, fc1 FFN/tp rows, fc2 FFN/tp columns."""

    def __init__(self, factor, group=None, dtype=None):
        super().__init__()
        self.pg = group.pg if group is not None else None
        ffn = FFN // (group.world_size if group is not None else 1)
        self.amp, self.norm = Amplify(factor), RMSNorm(HIDDEN, dtype)
        self.fc1 = nn.Linear(HIDDEN, ffn, dtype=dtype)
        self.fc2 = nn.Linear(ffn, HIDDEN, bias=False, dtype=dtype)

    def forward(self, x):
        h = self.norm(self.amp(x))
        if self.pg is not None:
            h = CopyToTP.apply(h, self.pg)
        out = self.fc2(F.gelu(self.fc1(h)))
        return ReduceFromTP.apply(out, self.pg) if self.pg is not None else out


def init(module, g):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name != "norm.weight":
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def make_batch(g, dtype):
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g).clamp(-2, 2)
    x[0, 0, 0] = 4.0  # x 1e4: about 4e4, past half of float16's range
    return {"x": x.to(dtype)}, torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dtype)


PLAN = Plan(
    params={
        "norm.weight": Replicate(),
        "fc1.weight": Shard(0),
        "fc1.bias": Shard(0),
        "fc2.weight": Shard(1),
    },
    activations={"amp": Replicate(), "norm": Replicate()},
)


def _case(name, factor):
    return Case(
        name=name,
        build_dense=lambda dtype: Block(factor, dtype=dtype),
        build_tp=lambda group, dtype: Block(factor, group, dtype),
        plan=PLAN,
        make_batch=make_batch,
        init=init,
        run=RunSettings(dtype="float16", steps=2),
    )


near_range = _case("float16_near_range", 1e4)
overflowing = _case("float16_overflowing", 1e6)
