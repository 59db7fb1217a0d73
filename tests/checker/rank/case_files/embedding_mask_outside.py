"""A vocab-parallel embedding written as Megatron-style code writes it: each rank an `nn.Embedding`
(named as the dense one) over its rows of the vocabulary, the token ids shifted into the shard and
clamped, the rows of tokens outside the shard zeroed by the model *after* the embedding's lookup,
then summed over the ranks. The embedding's own output has the dense shape, differs across ranks
and does not add up to the dense lookup (it holds row 0 of the shard where the token is
elsewhere): each of its rows is the dense one on the rank that owns the token. `no_mask`: the
model forgets the mask, so the sum counts the other ranks' rows."""

import torch
import torch.distributed as dist
from torch import nn

from tpcheck import Case, RunSettings

VOCAB, DIM, SEQ, BATCH = 32, 16, 6, 2


class Dense(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, dtype=dtype)
        self.proj = nn.Linear(DIM, DIM, dtype=dtype)

    def forward(self, ids):
        return self.proj(self.emb(ids))


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        out = x.clone()
        dist.all_reduce(out, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TP(nn.Module):
    """The dense model's own modules, `emb` holding this rank's rows of the vocabulary; the model's
    forward shifts the ids into the shard, masks the rows outside it and sums over the ranks."""

    def __init__(self, group, dtype=None, mask=True):
        super().__init__()
        self.pg, self.mask = group.pg, mask
        rows = VOCAB // group.world_size
        self.lo, self.hi = group.rank * rows, (group.rank + 1) * rows
        self.emb = nn.Embedding(rows, DIM, dtype=dtype)
        self.proj = nn.Linear(DIM, DIM, dtype=dtype)

    def forward(self, ids):
        outside = (ids < self.lo) | (ids >= self.hi)
        h = self.emb((ids - self.lo).clamp(0, self.hi - self.lo - 1))
        if self.mask:
            h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.proj(_Reduce.apply(h, self.pg))


def load(tp, state, group):
    tp.emb.weight.copy_(state["emb.weight"][tp.lo : tp.hi])
    tp.proj.weight.copy_(state["proj.weight"])
    tp.proj.bias.copy_(state["proj.bias"])


def make_batch(g, dtype):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"ids": ids}, torch.randn(BATCH, SEQ, DIM, generator=g).to(dtype)


def _case(name, mask):
    return Case(
        name=name,
        build_dense=Dense,
        build_tp=lambda group, dtype: TP(group, dtype, mask),
        plan=None,
        load_tp=load,
        make_batch=make_batch,
        run=RunSettings(steps=2),
    )


def case_masked(spec):
    return _case("embedding_mask_outside", True)


def case_no_mask(spec):
    return _case("embedding_no_mask", False)
