"""A TP block whose path depends on how often it was called: the first FUSE_AFTER calls run the
reference path, later ones a "fused" path (as code does once a kernel autotuner or a CUDA graph
capture has warmed up).

- `fused_bias_early`: the fused path adds fc2's bias to each rank's partial sum before the
  all-reduce, so the sum holds it world_size times. With the default 3 steps x 2 micro-batches and
  the eval-mode forward of the last step the check makes 7 forwards and never reaches it; with
  `RunSettings(warmup=7)` step 1 is call 8.
- `fused_correct`: the fused path adds the bias after the all-reduce (fc1 through one addmm).
The `*_forward_only` twins run without training (one forward per step).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

SEQ, BATCH, HIDDEN, FFN = 4, 2, 8, 16
FUSE_AFTER = 7  # calls on the reference path before the fused one is taken


class CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce."""

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
    def __init__(self, group, dtype=None, bias_early=False):
        super().__init__()
        self.pg, self.bias_early = group.pg, bias_early
        self.fc1 = nn.Linear(HIDDEN, FFN // group.world_size, dtype=dtype)
        self.fc2 = nn.Linear(FFN // group.world_size, HIDDEN, dtype=dtype)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        x_tp = CopyToTP.apply(x, self.pg)  # [s, b, h]
        if self.calls <= FUSE_AFTER:
            h_local = F.gelu(self.fc1(x_tp))  # [s, b, ffn/tp]
            partial = F.linear(h_local, self.fc2.weight)  # [s, b, h], partial sums
            return x + ReduceFromTP.apply(partial, self.pg) + self.fc2.bias
        flat = x_tp.reshape(-1, HIDDEN)  # [s*b, h]
        h_local = F.gelu(torch.addmm(self.fc1.bias, flat, self.fc1.weight.t()))
        if self.bias_early:  # the bug: every rank's partial sum carries the bias
            partial = torch.addmm(self.fc2.bias, h_local, self.fc2.weight.t())
            out = ReduceFromTP.apply(partial, self.pg)
        else:
            out = ReduceFromTP.apply(h_local @ self.fc2.weight.t(), self.pg) + self.fc2.bias
        return x + out.reshape(x.shape)


def init(module, g):
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
        "fc1.bias": Shard(0),
        "fc2.weight": Shard(1),
        "fc2.bias": Replicate(),
    }
)


def _case(name, bias_early, train=True):
    return Case(
        name=name,
        build_dense=DenseBlock,
        build_tp=lambda group, dtype: TPBlock(group, dtype, bias_early),
        plan=PLAN,
        make_batch=make_batch,
        init=init,
        run=RunSettings(train=train),
    )


fused_bias_early = _case("call_count_fused_bias_early", True)
fused_correct = _case("call_count_fused_correct", False)
fused_bias_early_forward_only = _case("call_count_fused_bias_early_fo", True, train=False)
fused_correct_forward_only = _case("call_count_fused_correct_fo", False, train=False)
