"""A training MLP whose dense model is not its own float64 twin: its activation is a fused
bias-GeLU kernel with the tanh approximation (as Megatron's `bias_gelu` is) for the dtypes the
kernel supports, and the exact GeLU for float64, which it does not. In a float32 run the float64
run then computes another function; its gap (about 1e-3 on the activations) is no rounding, and
every gradient bound made of it is that wide.

TP as Megatron writes it: column-parallel `up` (its input's gradient all-reduced), row-parallel
`down` (its output all-reduced, identity backward), `down`'s bias added after the all-reduce.

    tpcheck verify tests/checker/rank/case_files/fused_gelu.py:fused_gelu --world-size 2

Planted bug (`down_grad_in_bfloat16`): the TP side keeps `down.weight`'s gradient in bfloat16 (a
gradient hook that rounds it), about 4e-3 relative: under a bound made from the float64 run's other
path, over one made from rounding.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

DIM, FFN, BATCH, SEQ = 16, 64, 4, 8
FUSED = (torch.float16, torch.bfloat16, torch.float32)  # what the kernel supports


def bias_gelu(x, bias):
    """The fused kernel where it exists (tanh approximation), the exact GeLU elsewhere."""
    if x.dtype in FUSED:
        return F.gelu(x + bias, approximate="tanh")
    return F.gelu(x + bias)


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
    def __init__(self, group=None, dtype=None, bug=False):
        super().__init__()
        world = 1 if group is None else group.world_size
        self.pg = None if group is None else group.pg
        self.up = nn.Linear(DIM, FFN // world, bias=False, dtype=dtype)
        self.up_bias = nn.Parameter(torch.zeros(FFN // world, dtype=dtype))
        self.down = nn.Linear(FFN // world, DIM, bias=False, dtype=dtype)
        self.down_bias = nn.Parameter(torch.zeros(DIM, dtype=dtype))
        if bug:
            self.down.weight.register_hook(lambda g: g.to(torch.bfloat16).to(g.dtype))

    def forward(self, x):
        h = x if self.pg is None else _CopyToRanks.apply(x, self.pg)
        y = self.down(bias_gelu(self.up(h), self.up_bias))
        y = y if self.pg is None else _SumFromRanks.apply(y, self.pg)
        return x + y + self.down_bias


def make_batch(g, dtype):
    x = torch.randn(BATCH, SEQ, DIM, generator=g, dtype=dtype)
    return {"x": x}, torch.randn(BATCH, SEQ, DIM, generator=g, dtype=dtype)


PLAN = Plan(
    params={
        "up.weight": Shard(0),
        "up_bias": Shard(0),
        "down.weight": Shard(1),
        "down_bias": Replicate(),
    },
    activations={"up": Shard(2)},
)


def _case(name, bug=False):
    return Case(
        name=name,
        build_dense=lambda dtype: Mlp(None, dtype),
        build_tp=lambda group, dtype: Mlp(group, dtype, bug),
        plan=PLAN,
        make_batch=make_batch,
        loss=lambda out, target: F.mse_loss(out, target),
        run=RunSettings(steps=2),
    )


fused_gelu = _case("fused_gelu")
down_grad_in_bfloat16 = _case("fused_gelu_down_grad_in_bfloat16", bug=True)
