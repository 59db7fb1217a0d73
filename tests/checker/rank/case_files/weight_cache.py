"""A TP layer whose loader derives state from the weights: a transposed copy of the column-parallel
weight, the layout its forward GEMM reads, built once the checkpoint is loaded (vLLM's
`process_weights_after_loading` hook; TransformerEngine caches its FP8 weight casts the same way).
The weight's gradient still reaches the weight (a hand-written autograd function), so the layer
trains.

- `stale_cache`: the copy is built by the loader and by nothing after it: after the first optimizer
  step the forward computes with the weights as loaded (a training loop drifts from step 2 on).
- `rebuilt_in_forward`: the forward rebuilds the copy when the weight changed since (its version
  counter, which every in-place write bumps: the optimizer's step, a load).
- `invalidated_by_hook`: a post-accumulate-grad hook on the weight marks the copy stale after each
  backward; the next forward rebuilds it.
- `loads_once`: the loader refuses to load one module twice (correct otherwise).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

SEQ, BATCH, HIDDEN, FFN = 4, 2, 8, 16


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


class LinearPretransposed(torch.autograd.Function):
    """y = x @ weight_t + bias with `weight_t` the [in, out] copy prepared ahead; the gradient goes
    to the [out, in] weight."""

    @staticmethod
    def forward(ctx, x, weight, weight_t, bias):
        ctx.save_for_backward(x, weight_t)
        return x @ weight_t + bias  # [s, b, out]

    @staticmethod
    def backward(ctx, grad):
        x, weight_t = ctx.saved_tensors
        grad_2d = grad.reshape(-1, grad.shape[-1])  # [s*b, out]
        grad_w = grad_2d.t() @ x.reshape(-1, x.shape[-1])  # [out, in]
        return grad @ weight_t.t(), grad_w, None, grad_2d.sum(0)


class ColumnParallelLinear(nn.Linear):
    """fc1: FFN/tp rows of the dense weight; forward reads the transposed copy `weight_t`."""

    def __init__(self, in_features, out_features, world, dtype=None, refresh=None):
        super().__init__(in_features, out_features // world, dtype=dtype)
        self.refresh = refresh
        self.weight_t_version = None
        self.weight_t_stale = False
        if refresh == "hook":
            self.weight.register_post_accumulate_grad_hook(self._mark_stale)

    def process_weights_after_loading(self):
        self.register_buffer("weight_t", self.weight.detach().t().contiguous(), persistent=False)
        self.weight_t_version = self.weight._version
        self.weight_t_stale = False

    def _mark_stale(self, _param):
        self.weight_t_stale = True

    def forward(self, x):
        if self.refresh == "version" and self.weight._version != self.weight_t_version:
            self.process_weights_after_loading()
        if self.refresh == "hook" and self.weight_t_stale:
            self.process_weights_after_loading()
        return LinearPretransposed.apply(x, self.weight, self.weight_t, self.bias)


class DenseBlock(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN, dtype=dtype)
        self.fc2 = nn.Linear(FFN, HIDDEN, dtype=dtype)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))  # [s, b, h]


class TPBlock(nn.Module):
    def __init__(self, group, dtype=None, refresh=None):
        super().__init__()
        self.pg, world = group.pg, group.world_size
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, world, dtype, refresh)
        self.fc2 = nn.Linear(FFN // world, HIDDEN, dtype=dtype)

    def forward(self, x):
        x_tp = CopyToTP.apply(x, self.pg)  # [s, b, h]
        h_local = F.gelu(self.fc1(x_tp))  # [s, b, ffn/tp]
        partial = F.linear(h_local, self.fc2.weight)  # [s, b, h], partial sums
        return x + ReduceFromTP.apply(partial, self.pg) + self.fc2.bias


def loader(once=False):
    """A checkpoint loader: slices the dense state dict for this rank, then prepares the weights."""

    def load_tp(tp, state_dict, group):
        if once and getattr(tp, "loaded", False):
            raise RuntimeError("load_tp was called a second time on the same module")
        tp.loaded = True
        rank, world = group.rank, group.world_size
        tp.fc1.weight.copy_(state_dict["fc1.weight"].chunk(world, dim=0)[rank])
        tp.fc1.bias.copy_(state_dict["fc1.bias"].chunk(world, dim=0)[rank])
        tp.fc2.weight.copy_(state_dict["fc2.weight"].chunk(world, dim=1)[rank])
        tp.fc2.bias.copy_(state_dict["fc2.bias"])
        tp.fc1.process_weights_after_loading()

    return load_tp


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


def _case(name, refresh=None, plan=PLAN, once=False):
    return Case(
        name=name,
        build_dense=DenseBlock,
        build_tp=lambda group, dtype: TPBlock(group, dtype, refresh),
        plan=plan,
        make_batch=make_batch,
        init=init,
        load_tp=loader(once),
        run=RunSettings(steps=3),
    )


stale_cache = _case("weight_cache_stale")
stale_cache_no_plan = _case("weight_cache_stale_no_plan", plan=None)
rebuilt_in_forward = _case("weight_cache_rebuilt_in_forward", "version")
invalidated_by_hook = _case("weight_cache_invalidated_by_hook", "hook")
loads_once = _case("weight_cache_loads_once", "version", once=True)
