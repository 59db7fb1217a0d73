"""A training MLP whose dense model is not its own float64 twin: its activation is a fused
bias-GeLU kernel with the tanh approximation (as Megatron's `bias_gelu` is) for the dtypes the
kernel supports, and the exact GeLU for float64, which it does not. In a float32 run the float64
run then computes another function; its gap (about 1e-3 on the activations) is no rounding, and
every gradient bound made of it is that wide.

TP as Megatron writes it: column-parallel `up` (its input's gradient all-reduced), row-parallel
`down` (its output all-reduced, identity backward), `down`'s bias added after the all-reduce.

    tpcheck verify tests/checker/rank/case_files/fused_gelu.py:fused_gelu --world-size 2

Planted bug (`down_grad_in_float16`): the TP side sends `down.weight`'s gradient in float16 (a
gradient hook that rounds it, as a float16 compression hook does), about 5e-4 relative: under a
bound made from the float64 run's other path (1.2e-4), over one made from rounding (2.5e-7).
`input_grad_in_float16`: the input's gradient all-reduced in float16 (`up`'s backward), the same
at the input's gradient (`grad:x`).

With gradient clipping (`clipped`: Megatron's norm, tensor-parallel squares summed over the ranks,
the replicated bias's once), the planted bug `clip_coef_in_float16` rounds the clip coefficient to
float16 (up to 5e-4 relative on every clipped gradient; the total norm it returns is right): under
the clipped gradients' bound from the float64 run's path, over one from rounding.
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
    def forward(ctx, x, pg, wire=None):
        ctx.pg, ctx.wire = pg, wire
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        sent = g.clone() if ctx.wire is None else g.to(ctx.wire)  # `wire`: the all-reduce's dtype
        dist.all_reduce(sent, group=ctx.pg)
        return sent.to(g.dtype), None, None


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
    def __init__(self, group=None, dtype=None, bug=None):
        super().__init__()
        world = 1 if group is None else group.world_size
        self.pg = None if group is None else group.pg
        self.up = nn.Linear(DIM, FFN // world, bias=False, dtype=dtype)
        self.up_bias = nn.Parameter(torch.zeros(FFN // world, dtype=dtype))
        self.down = nn.Linear(FFN // world, DIM, bias=False, dtype=dtype)
        self.down_bias = nn.Parameter(torch.zeros(DIM, dtype=dtype))
        if bug == "down_grad":
            self.down.weight.register_hook(lambda g: g.to(torch.float16).to(g.dtype))
        self.wire = torch.float16 if bug == "input_grad" else None

    def forward(self, x):
        h = x if self.pg is None else _CopyToRanks.apply(x, self.pg, self.wire)
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


SHARDED = ("up.weight", "up_bias", "down.weight")


def clip_megatron(model, max_norm, group, coef_dtype=torch.float32):
    """The total norm over the ranks (sharded squares summed, the replicated bias's once), every
    gradient scaled by max_norm / norm (clip coefficient in `coef_dtype`)."""
    sharded, replicated = torch.zeros(()), torch.zeros(())
    for name, p in model.named_parameters():
        if p.grad is not None:
            sq = p.grad.float().pow(2).sum()
            if name in SHARDED:
                sharded = sharded + sq
            else:
                replicated = replicated + sq
    dist.all_reduce(sharded, group=group.pg)
    total = (sharded + replicated).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).to(coef_dtype)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return total


def _case(name, bug=None, clip=None):
    return Case(
        name=name,
        build_dense=lambda dtype: Mlp(None, dtype),
        build_tp=lambda group, dtype: Mlp(group, dtype, bug),
        plan=PLAN,
        make_batch=make_batch,
        loss=lambda out, target: F.mse_loss(out, target),
        run=RunSettings(steps=2, clip_grad_norm=None if clip is None else 0.05),
        tp_clip_grad_norm=clip,
    )


fused_gelu = _case("fused_gelu")
down_grad_in_float16 = _case("fused_gelu_down_grad_in_float16", bug="down_grad")
input_grad_in_float16 = _case("fused_gelu_input_grad_in_float16", bug="input_grad")
clipped = _case("fused_gelu_clipped", clip=clip_megatron)
clip_coef_in_float16 = _case(
    "fused_gelu_clip_coef_in_float16",
    clip=lambda model, max_norm, group: clip_megatron(model, max_norm, group, torch.float16),
)
