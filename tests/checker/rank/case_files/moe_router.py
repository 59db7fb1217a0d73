"""A mixture-of-experts layer with a top-1 router after a TP block, written the way public codebases
write one: the block is x + fc2(gelu(fc1(x))) with fc1 column-parallel and fc2 row-parallel (plain
torch.distributed all-reduces in autograd functions), then a router (Megatron-style: a weight, a
float32 softmax, `torch.topk`) and Mixtral-style expert dispatch (`torch.where` per expert,
`index_add`), router and experts replicated on every rank.

Two of the router's rows are the same up to 1e-3 of their scale (`init`): experts 0 and 1 then
tie to within bfloat16 rounding on many tokens, and a correct TP block (whose sums round otherwise
than the dense one's) makes the router pick the other of the two on some of them.

`correct`: the case as it should be. `local_shard`: the router computes its logits from this rank's
slice of the hidden state (its columns of the router's weight), as if the hidden dim were sharded,
without the all-reduce: a real routing bug. `offset_by_rank`: the router decides right, then each
rank adds its rank to the chosen expert ids (local ids taken for global ones): the decision is the
dense one, the bug is in what is done with it, and the values after it show it.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

SEQ, BATCH, HIDDEN, FFN, EXPERTS, EXPERT_FFN, TOP_K = 8, 4, 16, 32, 4, 16, 1


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


class Router(nn.Module):
    """Top-k router: (the chosen experts' probabilities [n, k], their indices [n, k])."""

    def __init__(self, dtype=None, pg=None, local_shard=False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(EXPERTS, HIDDEN, dtype=dtype))
        self.pg, self.local_shard = pg, local_shard

    def forward(self, tokens):  # [n, h]
        if self.local_shard:  # the bug: this rank's slice of the hidden state only
            world, rank = dist.get_world_size(self.pg), dist.get_rank(self.pg)
            cols = slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
            logits = F.linear(tokens[:, cols], self.weight[:, cols])  # [n, E], partial
        else:
            logits = F.linear(tokens, self.weight)  # [n, E]
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        return torch.topk(probs, TOP_K, dim=-1)


class Expert(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.up = nn.Linear(HIDDEN, EXPERT_FFN, dtype=dtype)
        self.down = nn.Linear(EXPERT_FFN, HIDDEN, dtype=dtype)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class MoE(nn.Module):
    def __init__(self, dtype=None, pg=None, local_shard=False, offset_by_rank=False):
        super().__init__()
        self.gate = Router(dtype, pg, local_shard)
        self.experts = nn.ModuleList(Expert(dtype) for _ in range(EXPERTS))
        self.pg, self.offset_by_rank = pg, offset_by_rank

    def forward(self, h):  # [s, b, h]
        tokens = h.reshape(-1, HIDDEN)  # [n, h]
        weights, selected = self.gate(tokens)  # [n, k] each
        if self.offset_by_rank:  # the bug: local expert ids taken for global ones
            selected = (selected + dist.get_rank(self.pg)) % EXPERTS
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(selected == e)
            if rows.numel():
                routed = expert(tokens[rows]) * weights[rows, slot, None].to(tokens.dtype)
                out = out.index_add(0, rows, routed)
        return h + out.reshape(h.shape)


class DenseModel(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN, dtype=dtype)
        self.fc2 = nn.Linear(FFN, HIDDEN, dtype=dtype)
        self.moe = MoE(dtype)

    def forward(self, x):
        return self.moe(x + self.fc2(F.gelu(self.fc1(x))))  # [s, b, h]


class TPModel(nn.Module):
    """Same parameter names as DenseModel; fc1 holds FFN/tp rows, fc2 FFN/tp columns, the MoE
    layer is whole on every rank."""

    def __init__(self, group, dtype=None, local_shard=False, offset_by_rank=False):
        super().__init__()
        self.pg = group.pg
        self.fc1 = nn.Linear(HIDDEN, FFN // group.world_size, dtype=dtype)
        self.fc2 = nn.Linear(FFN // group.world_size, HIDDEN, dtype=dtype)
        self.moe = MoE(dtype, self.pg, local_shard, offset_by_rank)

    def forward(self, x):
        x_tp = CopyToTP.apply(x, self.pg) if self.pg is not None else x  # [s, b, h]
        partial = F.linear(F.gelu(self.fc1(x_tp)), self.fc2.weight)  # [s, b, h], partial sums
        out = ReduceFromTP.apply(partial, self.pg) if self.pg is not None else partial
        return self.moe(x + out + self.fc2.bias)


def init(module, g):
    """Seeded weights; the router's row 1 is row 0 moved by 1e-3 of its scale (a near-tie)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        w = module.moe.gate.weight
        w[1] = w[0] + 1e-3 * torch.randn(HIDDEN, generator=g).to(w.dtype)


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
        **{
            name: Replicate()
            for name, _ in DenseModel().named_parameters()
            if name.startswith("moe.")
        },
    }
)


def _case(name, **bug):
    return Case(
        name=name,
        build_dense=DenseModel,
        build_tp=lambda group, dtype: TPModel(group, dtype, **bug),
        plan=PLAN,
        make_batch=make_batch,
        init=init,
        run=RunSettings(steps=1, dtype="bfloat16"),
    )


correct = _case("moe_top1_router")
local_shard = _case("moe_router_on_local_shard", local_shard=True)
offset_by_rank = _case("moe_expert_index_offset_by_rank", offset_by_rank=True)
