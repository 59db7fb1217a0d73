"""Your TP module trains with dropout: tpcheck checks
it exactly, and checks where each mask comes from.

    tpcheck verify examples/own_dropout.py --world-size 2 4  # every case in the file
    tpcheck verify examples/own_dropout.py:correct           # equivalent
    tpcheck verify examples/own_dropout.py:seeded_by_rank    # exits 1: rng_diverged at drop_out

The block is own_module.py's (fc1 column-parallel, fc2 row-parallel) with two dropouts:
`drop_hidden` on fc1's activations, which each rank holds a shard of (the TP region: each rank must
draw its own mask, so it draws inside `RNGTracker.fork()`, the model-parallel generator seeded per
rank), and `drop_out` after fc2's all-reduce, where every rank holds the whole tensor (a replicated
region: every rank must draw the same mask, from the default generator, seeded the same everywhere).

tpcheck draws each mask once in the dense layout and gives each rank its part, so the comparison is
as exact as without dropout; the masks the TP side draws itself are compared across ranks. The
attention cases do the same with `F.scaled_dot_product_attention(dropout_p=...)` (heads sharded),
and `bernoulli` with a hand-written dropout whose mask comes from `torch.bernoulli`.

Planted bugs (each "not equivalent" at step 1, the values themselves all equal):
  - `seeded_by_rank`: drop_out draws from the per-rank generator: replicas get different masks
    (`rng_diverged` at drop_out);
  - `not_forked`: drop_hidden draws from the default generator: every rank's shard gets the same
    mask (`rng_not_forked` at drop_hidden);
  - `attention_not_forked`: the attention dropout outside the fork (`rng_not_forked`).
"""

import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from own_module import FFN, HIDDEN, PLAN, CopyToTP, ReduceFromTP, init, make_batch  # noqa: E402
from tpcheck import Case, Plan, Shard  # noqa: E402
from tpcheck.parallel.random import RNGTracker  # noqa: E402

P = 0.2
HEADS = 4


class DenseBlock(nn.Module):
    def __init__(self, dtype=None, bernoulli=False):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN, dtype=dtype)
        self.fc2 = nn.Linear(FFN, HIDDEN, dtype=dtype)
        self.drop_hidden, self.drop_out = nn.Dropout(P), nn.Dropout(P)
        self.bernoulli = bernoulli

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        h = bernoulli_dropout(h) if self.bernoulli else self.drop_hidden(h)
        return x + self.drop_out(self.fc2(h))  # [s, b, h]


def bernoulli_dropout(h):
    """A hand-written dropout: the mask drawn with
    torch.bernoulli (tpcheck replays it like F.dropout)."""
    return h * torch.bernoulli(torch.full_like(h, 1 - P)) / (1 - P)


class TPBlock(nn.Module):
    """fc1 holds FFN/tp rows, fc2 FFN/tp columns; `bug` plants one of the RNG placement bugs."""

    def __init__(self, group, dtype=None, bug=None, bernoulli=False):
        super().__init__()
        self.pg, self.bug, self.bernoulli = group.pg, bug, bernoulli
        self.tracker = RNGTracker(group, seed=1234)  # seed + 2718 + rank: each rank its own stream
        ffn_local = FFN // group.world_size
        self.fc1 = nn.Linear(HIDDEN, ffn_local, dtype=dtype)
        self.fc2 = nn.Linear(ffn_local, HIDDEN, dtype=dtype)
        self.drop_hidden, self.drop_out = nn.Dropout(P), nn.Dropout(P)

    def forward(self, x):
        x_tp = CopyToTP.apply(x, self.pg) if self.pg is not None else x
        h_local = F.gelu(self.fc1(x_tp))  # [s, b, ffn/tp]: the TP region
        with contextlib.nullcontext() if self.bug == "not_forked" else self.tracker.fork():
            h_local = bernoulli_dropout(h_local) if self.bernoulli else self.drop_hidden(h_local)
        partial = F.linear(h_local, self.fc2.weight)
        out = (
            ReduceFromTP.apply(partial, self.pg) if self.pg is not None else partial
        ) + self.fc2.bias
        with self.tracker.fork() if self.bug == "seeded_by_rank" else contextlib.nullcontext():
            out = self.drop_out(out)  # [s, b, h]: replicated on every rank
        return x + out


class DenseAttention(nn.Module):
    """x + wo(sdpa(wq x, wk x, wv x)), causal, dropout on the attention weights."""

    def __init__(self, dtype=None):
        super().__init__()
        self.wq, self.wk, self.wv = (
            nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype) for _ in range(3)
        )
        self.wo = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)

    def heads(self, t, n):  # [s, b, n * d] -> [b, n, s, d]
        s, b, _ = t.shape
        return t.view(s, b, n, HIDDEN // HEADS).permute(1, 2, 0, 3)

    def attend(self, x, n):
        q, k, v = (self.heads(w(x), n) for w in (self.wq, self.wk, self.wv))
        ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=True)  # [b, n, s, d]
        return ctx.permute(2, 0, 1, 3).reshape(x.shape[0], x.shape[1], -1)

    def forward(self, x):
        return x + self.wo(self.attend(x, HEADS))


class TPAttention(DenseAttention):
    """wq/wk/wv column-parallel by heads, wo row-parallel; each rank attends with HEADS/tp heads."""

    def __init__(self, group, dtype=None, bug=None):
        super().__init__(dtype)
        self.pg, self.bug, self.world = group.pg, bug, group.world_size
        self.tracker = RNGTracker(group, seed=1234)
        local = HIDDEN // group.world_size
        self.wq, self.wk, self.wv = (
            nn.Linear(HIDDEN, local, bias=False, dtype=dtype) for _ in range(3)
        )
        self.wo = nn.Linear(local, HIDDEN, bias=False, dtype=dtype)

    def forward(self, x):
        x_tp = CopyToTP.apply(x, self.pg) if self.pg is not None else x
        with contextlib.nullcontext() if self.bug == "not_forked" else self.tracker.fork():
            # this rank's heads: its own dropout stream
            ctx = self.attend(x_tp, HEADS // self.world)
        partial = self.wo(ctx)
        return x + (ReduceFromTP.apply(partial, self.pg) if self.pg is not None else partial)


ATTENTION_PLAN = Plan(
    params={
        "wq.weight": Shard(0),
        "wk.weight": Shard(0),
        "wv.weight": Shard(0),
        "wo.weight": Shard(1),
    }
)


def _block(name, bug=None, bernoulli=False, **kw):
    return Case(
        name=name,
        build_dense=lambda dtype: DenseBlock(dtype, bernoulli),
        build_tp=lambda group, dtype: TPBlock(group, dtype, bug, bernoulli),
        plan=PLAN,
        make_batch=make_batch,
        init=init,
        **kw,
    )


def _attention(name, bug=None):
    return Case(
        name=name,
        build_dense=DenseAttention,
        build_tp=lambda group, dtype: TPAttention(group, dtype, bug),
        plan=ATTENTION_PLAN,
        make_batch=make_batch,
        init=init,
    )


correct = _block("own_dropout", no_grad_forward=True)
bernoulli = _block("own_dropout_bernoulli", bernoulli=True)
attention = _attention("own_dropout_attention")
seeded_by_rank = _block("own_dropout_seeded_by_rank", bug="seeded_by_rank")
not_forked = _block("own_dropout_not_forked", bug="not_forked")
attention_not_forked = _attention("own_dropout_attention_not_forked", bug="not_forked")
