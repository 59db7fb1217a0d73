"""OLMo-2-style attention: RMSNorm over the whole q and k projections (not per head), written the
way public TP code ports it, with plain torch.distributed calls.

OLMo-2 normalizes q_proj(x) and k_proj(x) over all heads together (`Olmo2RMSNorm(num_heads *
head_dim)`), in float32 as HuggingFace's norm does. Column-parallel q/k projections give each rank
the heads it owns, so the norm's statistics span every rank's shard:

  local_norm   the buggy port: each rank normalizes its own shard (its mean of squares over
               hidden/tp features) with its slice of the norm weight. A structural bug, in float64
               as in bfloat16, where at tp 2 its error is of the order of bfloat16's rounding.
  correct      the norm statistics all-reduced: each rank's sum of squares summed over the ranks
               (forward all-reduce, backward all-reduce: every shard's outputs depend on the sum).
  partial_1pct the last rank's o_proj partial sum 1% too large: structural, under bfloat16's
               rounding at tp 2.
  bf16_reduce  correct norms, but the row-parallel o_proj's partial sums are all-reduced in
               bfloat16 (to halve the bytes) and cast back: precision-specific, invisible in float64
               (and in a bfloat16 run, which reduces in bfloat16 anyway), caught in float32.
  pinned       the TP module is built in float32 whatever the dtype (a module pinned to a dtype): it
               cannot run in float64, where its matmuls meet float64 inputs.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

SEQ, BATCH, HEADS, HEAD_DIM = 4, 2, 4, 32
HIDDEN = HEADS * HEAD_DIM
EPS = 1e-6


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
    """forward: all-reduce of the partial sums (optionally in another dtype); backward: identity."""

    @staticmethod
    def forward(ctx, x, pg, wire_dtype):
        out = x.contiguous().to(wire_dtype or x.dtype).clone()
        dist.all_reduce(out, group=pg)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class AllReduceSum(torch.autograd.Function):
    """forward: all-reduce; backward: all-reduce (a statistic every rank's shard depends on)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        out = x.contiguous().clone()
        dist.all_reduce(out, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.pg)
        return grad, None


class RMSNorm(nn.Module):
    """HuggingFace's (Olmo2RMSNorm): statistics in float32, weight applied in the input dtype."""

    def __init__(self, dim, dtype=None, pg=None, full_dim=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.pg, self.full_dim = pg, full_dim  # set: the statistics span every rank's shard

    def forward(self, x):
        input_dtype = x.dtype
        x = x.to(torch.float32)
        if self.pg is None:
            variance = x.pow(2).mean(-1, keepdim=True)
        else:
            sum_sq = AllReduceSum.apply(x.pow(2).sum(-1, keepdim=True), self.pg)
            variance = sum_sq / self.full_dim
        x = x * torch.rsqrt(variance + EPS)
        return self.weight * x.to(input_dtype)


def attention(q, k, v, heads):
    """[s, b, heads * d] each -> [s, b, heads * d], causal."""
    s, b, _ = q.shape
    q, k, v = (t.reshape(s, b, heads, HEAD_DIM).permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, d]
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * HEAD_DIM)


class DenseAttention(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(HIDDEN, dtype)
        self.k_norm = RMSNorm(HIDDEN, dtype)

    def forward(self, x):  # x: [s, b, h]
        q, k = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x))
        return x + self.o_proj(attention(q, k, self.v_proj(x), HEADS))


class TPAttention(nn.Module):
    """q/k/v column-parallel (HEADS/tp heads each), o_proj row-parallel; names as the dense."""

    def __init__(self, group, dtype=None, local_norm=False, wire_dtype=None, last_off=1.0):
        super().__init__()
        self.pg, self.wire_dtype = group.pg, wire_dtype
        # the last rank's partial sum scaled (1.0: not)
        self.off = last_off if group.rank == group.world_size - 1 else 1.0
        self.heads = HEADS // group.world_size
        local = self.heads * HEAD_DIM
        self.q_proj = nn.Linear(HIDDEN, local, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(HIDDEN, local, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(HIDDEN, local, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(local, HIDDEN, bias=False, dtype=dtype)
        pg = None if local_norm else self.pg  # the bug: no statistics over the other shards
        self.q_norm = RMSNorm(local, dtype, pg, HIDDEN)
        self.k_norm = RMSNorm(local, dtype, pg, HIDDEN)

    def forward(self, x):
        x_tp = CopyToTP.apply(x, self.pg)  # [s, b, h]
        q = self.q_norm(self.q_proj(x_tp))  # [s, b, h/tp]
        k = self.k_norm(self.k_proj(x_tp))
        partial = self.o_proj(attention(q, k, self.v_proj(x_tp), self.heads))  # [s, b, h] partial
        partial = partial * self.off if self.off != 1.0 else partial
        return x + ReduceFromTP.apply(partial, self.pg, self.wire_dtype)


def make_batch(g, dtype):
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    return {"x": x.to(dtype)}, torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dtype)


PLAN = Plan(
    params={
        "q_proj.weight": Shard(0),
        "k_proj.weight": Shard(0),
        "v_proj.weight": Shard(0),
        "o_proj.weight": Shard(1),
        "q_norm.weight": Shard(0),
        "k_norm.weight": Shard(0),
    },
    activations={"": Replicate()},
)
RUN = RunSettings(dtype="bfloat16", steps=1, micro_batches=1)


def _case(name, **tp):
    return Case(
        name=name,
        build_dense=DenseAttention,
        build_tp=lambda group, dtype: TPAttention(group, dtype, **tp),
        plan=PLAN,
        make_batch=make_batch,
        run=RUN,
    )


correct = _case("olmo2_qk_norm")
local_norm = _case("olmo2_qk_norm_local", local_norm=True)
partial_1pct = _case("olmo2_qk_norm_partial_1pct", last_off=1.01)
bf16_reduce = _case("olmo2_qk_norm_bf16_reduce", wire_dtype=torch.bfloat16)
pinned = Case(
    name="olmo2_qk_norm_pinned",
    build_dense=DenseAttention,
    build_tp=lambda group, dtype: TPAttention(group, torch.float32),
    plan=PLAN,
    make_batch=make_batch,
    run=RunSettings(dtype="float32", steps=1, micro_batches=1, float64_run="on"),
)
