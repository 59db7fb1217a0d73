"""A top-2 mixture-of-experts layer after a TP block, written the way public MoE code writes one
(Mistral's reference `MoeLayer`, torchtitan's TP experts): the block is x + fc2(gelu(fc1(x))) with
fc1 column-parallel and fc2 row-parallel (plain torch.distributed all-reduces in autograd
functions); then a router `nn.Linear` gives the logits, `torch.topk(logits, 2)` picks two experts,
a float32 softmax over the two picked logits weighs them, and every expert's hidden dimension is
split over the ranks (up column-parallel, down row-parallel, the routed output all-reduced), the
router replicated.

`correct`: the case as it should be. Three TP routers with a systematic selection bias, each
small enough to pass for rounding in bfloat16 under a near-tie allowance of twice the logits'
calibrated bound (forward only, 10 seeds at tp 2: 9, 10 and 9 runs "equivalent"):

- `bias` adds 0.2 to expert 0's logit before the top-k (what `logits[..., 0] += 0.2` does), the
  softmax weights then coming from the biased logits too;
- `bias_select` adds it to the scores the top-k picks from only, the weights coming from the
  unbiased logits (the shape of an auxiliary-loss-free load-balancing correction, DeepSeek-V3's
  `e_score_correction_bias`): with the dense decision replayed, nothing but the decision itself
  differs;
- `bias_all` adds a per-expert constant, 0.05 x the expert's index, to every logit.

Checked forward-only in the tests (`RunSettings(train=False)`), where the decisions are: in
training, the backward of this top-2 layer also meets the calibrated bounds of its gradients.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

SEQ, BATCH, HIDDEN, FFN, EXPERTS, EXPERT_FFN, TOP_K = 16, 4, 32, 64, 8, 32, 2


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


def _copy(x, pg):
    return CopyToTP.apply(x, pg) if pg is not None else x


def _reduce(x, pg):
    return ReduceFromTP.apply(x, pg) if pg is not None else x


class Expert(nn.Module):
    """A SwiGLU-free expert (up, silu, down), no biases; `world` ranks each hold 1/world of its
    hidden dimension."""

    def __init__(self, dtype=None, world=1):
        super().__init__()
        self.up = nn.Linear(HIDDEN, EXPERT_FFN // world, bias=False, dtype=dtype)
        self.down = nn.Linear(EXPERT_FFN // world, HIDDEN, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class MoE(nn.Module):
    """Mistral-style: gate -> topk(logits, k) -> softmax over the k -> weighted experts."""

    def __init__(self, dtype=None, pg=None, world=1, bias=None, select_only=False):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False, dtype=dtype)
        self.experts = nn.ModuleList(Expert(dtype, world) for _ in range(EXPERTS))
        self.pg, self.bias, self.select_only = pg, bias, select_only

    def forward(self, h):  # [s, b, h]
        tokens = h.reshape(-1, HIDDEN)  # [n, h]
        logits = self.gate(tokens)  # [n, E]
        if self.bias is not None and not self.select_only:  # the bug: before the decision
            logits = logits + self.bias.to(logits.dtype)
        if self.bias is not None and self.select_only:  # the bug, in the selection only
            _, selected = torch.topk(logits + self.bias.to(logits.dtype), TOP_K, dim=-1)
            weights = logits.gather(-1, selected)
        else:
            weights, selected = torch.topk(logits, TOP_K, dim=-1)  # [n, k] each
        weights = F.softmax(weights, dim=-1, dtype=torch.float).to(tokens.dtype)
        x = _copy(tokens, self.pg)
        routed = tokens.new_zeros(tokens.shape[0], TOP_K, HIDDEN)  # each pick's expert output
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(selected == e)
            if rows.numel():
                routed = routed.index_put((rows, slot), expert(x[rows]))
        out = (_reduce(routed, self.pg) * weights[..., None]).sum(1)  # weighed after the reduce
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
    """Same parameter names as DenseModel; fc1 and each expert's up hold 1/tp of their rows, fc2
    and each expert's down 1/tp of their columns; the router is whole on every rank."""

    def __init__(self, group, dtype=None, bias=None, select_only=False):
        super().__init__()
        self.pg, world = group.pg, group.world_size
        self.fc1 = nn.Linear(HIDDEN, FFN // world, dtype=dtype)
        self.fc2 = nn.Linear(FFN // world, HIDDEN, dtype=dtype)
        self.moe = MoE(dtype, self.pg, world, bias, select_only)

    def forward(self, x):
        partial = F.linear(F.gelu(self.fc1(_copy(x, self.pg))), self.fc2.weight)  # partial sums
        return self.moe(x + _reduce(partial, self.pg) + self.fc2.bias)


def init(module, g):
    """Seeded weights (the router's scaled so that its logits spread over a few units)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


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
        "moe.gate.weight": Replicate(),
        **{f"moe.experts.{e}.up.weight": Shard(0) for e in range(EXPERTS)},
        **{f"moe.experts.{e}.down.weight": Shard(1) for e in range(EXPERTS)},
    }
)


def _case(name, bias=None, select_only=False):
    return Case(
        name=name,
        build_dense=DenseModel,
        build_tp=lambda group, dtype: TPModel(group, dtype, bias, select_only),
        plan=PLAN,
        make_batch=make_batch,
        init=init,
        run=RunSettings(steps=1, dtype="bfloat16", float64_run="off"),
    )


correct = _case("moe_top2")
EXPERT0 = torch.tensor([0.2] + [0.0] * (EXPERTS - 1))
bias = _case("moe_top2_expert0_bias", EXPERT0)
bias_select = _case("moe_top2_expert0_bias_in_selection", EXPERT0, select_only=True)
bias_all = _case("moe_top2_per_expert_bias", 0.05 * torch.arange(EXPERTS, dtype=torch.float32))
