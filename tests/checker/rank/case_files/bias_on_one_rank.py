"""A row-parallel bias that exists on one TP rank only, written the way TP layer libraries write it:
the row-parallel linear creates its bias on rank 0 (`nn.Parameter(...) if rank == 0`, and
`register_parameter("bias", None)` on the other ranks) and adds it to rank 0's partial sum before
the all-reduce, so the sum holds it once. The checkpoint loader copies the bias where the module
has one.

Cases (each with its own loader, `load_tp`):
  - `no_plan`: no plan written; the bias's placement is inferred as `OnRank(0)`;
  - `written`: the same with the plan written, `OnRank(0)`;
  - `on_rank1` / `on_rank1_no_plan`: the bias lives on rank 1 (its bound comes from rank 0);
Planted bugs:
  - `grad_doubled`: a hook doubles the bias's gradient on rank 0 (caught at `grad:fc2.bias`);
  - `added_after_reduce`: rank 0 adds its bias after the all-reduce, so only rank 0's output holds
    it (caught at the forward output, on the other ranks);
  - `on_two_ranks` (world 4): ranks 0 and 1 both create the bias and add it to their partial sums,
    while the plan says `OnRank(0)` (caught at the weights stage: `held_off_rank`; with no plan
    written, refused: a parameter lives on every rank or on one).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, OnRank, Plan, Replicate, Shard

HIDDEN, FFN = 16, 32


class Dense(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN, dtype=dtype)
        self.fc2 = nn.Linear(FFN, HIDDEN, dtype=dtype)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.pg)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce; backward: identity."""

    @staticmethod
    def forward(ctx, x, pg):
        x = x.clone()
        dist.all_reduce(x, group=pg)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, pg, dtype=None):
        super().__init__()
        world = dist.get_world_size(group=pg)
        self.pg = pg
        self.weight = nn.Parameter(torch.empty(out_features // world, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features // world, dtype=dtype))

    def forward(self, x):
        return F.linear(_CopyToTP.apply(x, self.pg), self.weight, self.bias)  # [s, b, out/tp]


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b, the bias created on `bias_ranks` only and added to their
    partial sums before the all-reduce (after it with `after_reduce`)."""

    def __init__(self, in_features, out_features, pg, dtype=None, bias_ranks=(0,), after=False):
        super().__init__()
        world, rank = dist.get_world_size(group=pg), dist.get_rank(group=pg)
        self.pg, self.after = pg, after
        self.weight = nn.Parameter(torch.empty(out_features, in_features // world, dtype=dtype))
        if rank in bias_ranks:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x_local):
        if self.after:  # the bug: the bias joins rank 0's output after the sum, not the sum
            out = _ReduceFromTP.apply(F.linear(x_local, self.weight), self.pg)
            return out + self.bias if self.bias is not None else out
        partial = F.linear(x_local, self.weight, self.bias)  # [s, b, hidden], partial sum
        return _ReduceFromTP.apply(partial, self.pg)


class TPMLP(nn.Module):
    def __init__(self, group, dtype=None, bias_ranks=(0,), after=False, grad_scale=1.0):
        super().__init__()
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, group.pg, dtype)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, group.pg, dtype, bias_ranks, after)
        if grad_scale != 1.0 and self.fc2.bias is not None:
            self.fc2.bias.register_hook(lambda g: g * grad_scale)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def load_tp(tp, state, group):
    """A checkpoint loader: this rank's slices; the row-parallel bias where the module has one."""
    rank, world = group.rank, group.world_size
    tp.fc1.weight.copy_(state["fc1.weight"].chunk(world, dim=0)[rank])
    tp.fc1.bias.copy_(state["fc1.bias"].chunk(world, dim=0)[rank])
    tp.fc2.weight.copy_(state["fc2.weight"].chunk(world, dim=1)[rank])
    if tp.fc2.bias is not None:
        tp.fc2.bias.copy_(state["fc2.bias"])


def make_batch(g, dtype):
    x = torch.randn(4, 2, HIDDEN, generator=g).to(dtype)  # [s, b, h]
    return {"x": x}, torch.randn(4, 2, HIDDEN, generator=g).to(dtype)


def plan(owner=0):
    return Plan(
        params={
            "fc1.weight": Shard(0),
            "fc1.bias": Shard(0),
            "fc2.weight": Shard(1),
            "fc2.bias": OnRank(owner),
        }
    )


def _case(name, plan=None, **tp):
    return Case(
        name=name,
        build_dense=Dense,
        build_tp=lambda group, dtype: TPMLP(group, dtype, **tp),
        plan=plan,
        make_batch=make_batch,
        load_tp=load_tp,
    )


no_plan = _case("bias_on_rank0_no_plan")
written = _case("bias_on_rank0", plan())
on_rank1 = _case("bias_on_rank1", plan(1), bias_ranks=(1,))
on_rank1_no_plan = _case("bias_on_rank1_no_plan", bias_ranks=(1,))
grad_doubled = _case("bias_on_rank0_grad_doubled", plan(), grad_scale=2.0)
grad_doubled_on_rank1 = _case(
    "bias_on_rank1_grad_doubled", plan(1), bias_ranks=(1,), grad_scale=2.0
)
added_after_reduce = _case("bias_on_rank0_after_reduce", plan(), after=True)
on_two_ranks = _case("bias_on_two_ranks", plan(), bias_ranks=(0, 1))
on_two_ranks_no_plan = _case("bias_on_two_ranks_no_plan", bias_ranks=(0, 1))
# the same module planned as if every rank held the bias: refused, naming the fix
planned_replicate = _case(
    "bias_on_rank0_planned_replicate",
    Plan(params={**plan().params, "fc2.bias": Replicate()}),
)
