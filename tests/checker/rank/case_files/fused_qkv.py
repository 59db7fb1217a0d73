"""GQA attention with a fused [q; k; v] projection, as inference engines and Megatron write it: one
column-parallel `qkv` linear whose local output is split into the rank's q, k and v heads by local
sizes, attention over the local heads, a row-parallel `o` (its all-reduce in an autograd
function). No plan is written: the user's loader shards the checkpoint, tpcheck infers the plan.

The checkpoint holds the dense `qkv.weight` as [q; k; v] (8 query heads, 4 KV heads, head dim 8).
The correct loader takes each rank's block of every part ([q_r; k_r; v_r]); the buggy one
(`contiguous_qkv`) takes contiguous rows of the whole, the classic mistake: the weight it loads
is a fine `Shard(0)` of the dense one, so nothing is wrong until the attention code splits the
local output into q, k and v, where each rank's parts are not the parts' shards.

With a written plan instead (`in_plan(placement)`: tpcheck loads the checkpoint by it), the same
mistake is the plan line `"attn.qkv.weight": Shard(0)`.

    tpcheck verify tests/checker/rank/case_files/fused_qkv.py --world-size 2
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, RunSettings, Shard

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BATCH, SEQ = 32, 8, 4, 8, 2, 6


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


class Attention(nn.Module):
    """`pg` None: the dense attention; else this rank's heads (KV heads sharded, world <= 4)."""

    def __init__(self, group=None, dtype=None):
        super().__init__()
        world = 1 if group is None else group.world_size
        self.pg = None if group is None else group.pg
        self.heads, self.kv_heads = HEADS // world, KV_HEADS // world
        self.q_size, self.kv_size = self.heads * HEAD_DIM, self.kv_heads * HEAD_DIM
        fused = self.q_size + 2 * self.kv_size
        self.qkv = nn.Linear(HIDDEN, fused, bias=False, dtype=dtype)
        self.o = nn.Linear(self.q_size, HIDDEN, bias=False, dtype=dtype)

    def forward(self, x):
        b, s, _ = x.shape
        h = x if self.pg is None else _CopyToRanks.apply(x, self.pg)
        qkv = self.qkv(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(b, s, self.heads, HEAD_DIM).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, HEAD_DIM).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, HEAD_DIM).transpose(1, 2)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = self.o(att.transpose(1, 2).reshape(b, s, self.q_size))
        return out if self.pg is None else _SumFromRanks.apply(out, self.pg)


class Block(nn.Module):
    def __init__(self, group=None, dtype=None):
        super().__init__()
        self.attn = Attention(group, dtype)

    def forward(self, x):
        return x + self.attn(x)


def _parts(weight, rank, world):
    """Each part's block of rows for `rank`: [q_r; k_r; v_r]."""
    q, k, v = weight.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM])
    return torch.cat([t.chunk(world)[rank] for t in (q, k, v)])


def load(tp, state, group, contiguous=False):
    rank, world = group.rank, group.world_size
    with torch.no_grad():
        qkv = state["attn.qkv.weight"]
        tp.attn.qkv.weight.copy_(qkv.chunk(world)[rank] if contiguous else _parts(qkv, rank, world))
        tp.attn.o.weight.copy_(state["attn.o.weight"].chunk(world, dim=1)[rank])


def make_batch(g, dtype):
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=g, dtype=dtype)
    return {"x": x}, torch.randn(BATCH, SEQ, HIDDEN, generator=g, dtype=dtype)


def _case(name, contiguous=False, plan=None):
    return Case(
        name=name,
        build_dense=lambda dtype: Block(None, dtype),
        build_tp=lambda group, dtype: Block(group, dtype),
        plan=plan,
        load_tp=None if plan else lambda tp, state, group: load(tp, state, group, contiguous),
        make_batch=make_batch,
        loss=lambda out, target: F.mse_loss(out, target),
        run=RunSettings(steps=1),
    )


def in_plan(qkv_placement, name="fused_qkv_in_plan"):
    """The case with a written plan, `attn.qkv.weight` placed `qkv_placement`."""
    params = {"attn.qkv.weight": qkv_placement, "attn.o.weight": Shard(1)}
    return _case(name, plan=Plan(params=params))


fused_qkv = _case("fused_qkv")
contiguous_qkv = _case("fused_qkv_contiguous", contiguous=True)
contiguous_in_plan = in_plan(Shard(0), "fused_qkv_contiguous_in_plan")
