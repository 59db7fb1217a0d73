"""Bugs that used to leave tpcheck without a plan to check through, written the way TP code writes
them, each beside its correct twin.

A Megatron-style MLP (fc1 column-parallel, fc2 row-parallel, hand-written autograd functions for the
collectives), no plan written (`plan=None`): the placements are inferred from what the checkpoint
loader put on each rank.
  - `megatron_mlp`: the loader slices each rank's rows or columns, `full[rank*k:(rank+1)*k]`;
  - `megatron_mlp_no_offset`: the planted bug: the loader slices `full[0:k]` on every rank (it
    forgot the rank offset), so every rank holds rank 0's shard. Caught at the weights stage,
    `param:fc1.weight`, signature `rank0_shard`.

A token embedding followed by a linear head, parallelized with torch's `parallelize_module`
(tpcheck's DTensor adapter), the embedding row-parallel (its vocabulary split over the ranks), the
head column-parallel:
  - `dtensor_embedding`: the embedding's style is `RowwiseParallel(input_layouts=Replicate())`, as
    torch's tutorial writes it: every rank holds the whole batch of token ids;
  - `dtensor_embedding_no_input_layouts`: the planted bug: `RowwiseParallel()` alone, whose default
    input layout is `Shard(-1)`: each rank's token ids are taken for its shard of the sequence and
    gathered, so the embedding returns `[batch, world * seq, hidden]`. Caught at
    `act:tok_embeddings`, signature `no_placement`.

The same embedding written by hand, no plan written:
  - `vocab_parallel_embedding`: Megatron's vocab-parallel embedding, each rank looking up the ids in
    its own rows of the vocabulary, zero elsewhere, and an all-reduce of the partial lookups;
  - `vocab_parallel_embedding_gathered`: the planted bug: the partial lookups all-gathered and
    concatenated along the batch dim instead of summed, `[world * batch, seq, hidden]`. Caught at
    `act:tok_embeddings`, signature `no_placement`.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, RunSettings

HIDDEN, FFN, VOCAB, SEQ, BATCH = 16, 32, 32, 4, 2
RUN = RunSettings(steps=2)


# ------------------------------------------------------------------ the Megatron-style MLP


class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input grad backward."""

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
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, pg):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class DenseMLP(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN, dtype=dtype)
        self.fc2 = nn.Linear(FFN, HIDDEN, dtype=dtype)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class ColumnParallelLinear(nn.Module):
    def __init__(self, n_in, n_out, world, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out // world, n_in, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(n_out // world, dtype=dtype))


class RowParallelLinear(nn.Module):
    def __init__(self, n_in, n_out, world, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in // world, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(n_out, dtype=dtype))  # added after the all-reduce


class TPMLP(nn.Module):
    def __init__(self, group, dtype=None):
        super().__init__()
        self.pg = group.pg
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, group.world_size, dtype)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, group.world_size, dtype)

    def forward(self, x):
        h = F.gelu(F.linear(CopyToTP.apply(x, self.pg), self.fc1.weight, self.fc1.bias))
        return x + ReduceFromTP.apply(F.linear(h, self.fc2.weight), self.pg) + self.fc2.bias


def mlp_batch(g, dtype):
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dtype)
    return {"x": x}, torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dtype)


def mlp_loader(offset="rank"):
    """A checkpoint loader: this rank's rows of fc1, its columns of fc2, fc2's bias whole. The
    offset of rank r's shard: r (`"rank"`), 0 on every rank (`"zero"`: the rank offset forgotten),
    or the ranks in reverse order (`"reversed"`: ranks numbered the other way round)."""

    def load_tp(tp, state_dict, group):
        k1, k2 = FFN // group.world_size, FFN // group.world_size
        start = {"rank": group.rank, "zero": 0}.get(offset, group.world_size - 1 - group.rank)
        tp.fc1.weight.copy_(state_dict["fc1.weight"][start * k1 : (start + 1) * k1])
        tp.fc1.bias.copy_(state_dict["fc1.bias"][start * k1 : (start + 1) * k1])
        tp.fc2.weight.copy_(state_dict["fc2.weight"][:, start * k2 : (start + 1) * k2])
        tp.fc2.bias.copy_(state_dict["fc2.bias"])

    return load_tp


def _mlp_case(name, offset):
    return Case(
        name=name,
        build_dense=DenseMLP,
        build_tp=TPMLP,
        plan=None,
        load_tp=mlp_loader(offset),
        make_batch=mlp_batch,
        run=RUN,
    )


megatron_mlp = _mlp_case("megatron_mlp", offset="rank")
megatron_mlp_no_offset = _mlp_case("megatron_mlp_no_offset", offset="zero")
megatron_mlp_reversed = _mlp_case("megatron_mlp_reversed", offset="reversed")


# ------------------------------------------------------------------ an embedding and a head


class EmbedHead(nn.Module):
    """Token ids [batch, seq] -> embeddings -> gelu -> a linear head [batch, seq, hidden]."""

    def __init__(self, dtype=None):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, HIDDEN, dtype=dtype)
        self.head = nn.Linear(HIDDEN, HIDDEN, dtype=dtype)

    def forward(self, ids):
        return self.head(F.gelu(self.tok_embeddings(ids)))


def ids_batch(g, dtype):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"ids": ids}, torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(dtype)


def _dtensor_case(name, input_layouts):
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from tpcheck.adapters.dtensor import dtensor_case

    emb = RowwiseParallel(input_layouts=DReplicate()) if input_layouts else RowwiseParallel()
    return dtensor_case(
        name=name,
        build_dense=EmbedHead,
        tp_plan={"tok_embeddings": emb, "head": ColwiseParallel(output_layouts=DReplicate())},
        make_batch=ids_batch,
        run=RUN,
    )


dtensor_embedding = _dtensor_case("dtensor_embedding", input_layouts=True)
dtensor_embedding_no_input_layouts = _dtensor_case(
    "dtensor_embedding_no_input_layouts", input_layouts=False
)


class GatherFromTP(torch.autograd.Function):
    """All-gather along dim 0 forward; this rank's part of the gradient backward."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg, ctx.n = pg, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(pg))]
        dist.all_gather(parts, x.contiguous(), group=pg)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.pg)
        return grad[rank * ctx.n : (rank + 1) * ctx.n].contiguous(), None


class VocabParallelEmbedding(nn.Module):
    """Megatron's: this rank's rows of the vocabulary; ids outside them look up zeros; the partial
    lookups summed over the ranks (`gather`: concatenated along the batch dim instead, the bug)."""

    def __init__(self, group, dtype=None, gather=False):
        super().__init__()
        self.pg, self.gather = group.pg, gather
        rows = VOCAB // group.world_size
        self.start, self.end = group.rank * rows, (group.rank + 1) * rows
        self.weight = nn.Parameter(torch.empty(rows, HIDDEN, dtype=dtype))

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.gather:
            return GatherFromTP.apply(partial, self.pg)
        return ReduceFromTP.apply(partial, self.pg)


class TPEmbedHead(nn.Module):
    def __init__(self, group, dtype=None, gather=False):
        super().__init__()
        self.tok_embeddings = VocabParallelEmbedding(group, dtype, gather)
        self.head = nn.Linear(HIDDEN, HIDDEN, dtype=dtype)  # replicated

    def forward(self, ids):
        return self.head(F.gelu(self.tok_embeddings(ids)))


def embedding_loader(tp, state_dict, group):
    """This rank's rows of the vocabulary; the head whole."""
    rows = VOCAB // group.world_size
    r = group.rank
    tp.tok_embeddings.weight.copy_(state_dict["tok_embeddings.weight"][r * rows : (r + 1) * rows])
    tp.head.weight.copy_(state_dict["head.weight"])
    tp.head.bias.copy_(state_dict["head.bias"])


def _embedding_case(name, gather, run=RUN, **fields):
    return Case(
        name=name,
        build_dense=EmbedHead,
        build_tp=lambda group, dtype: TPEmbedHead(group, dtype, gather),
        plan=None,
        load_tp=embedding_loader,
        make_batch=ids_batch,
        run=run,
        **fields,
    )


vocab_parallel_embedding = _embedding_case("vocab_parallel_embedding", gather=False)
vocab_parallel_embedding_gathered = _embedding_case(
    "vocab_parallel_embedding_gathered", gather=True
)
# the same two checked forward only (no loss, no backward) and with a forward without autograd
vocab_parallel_embedding_forward_only = _embedding_case(
    "vocab_parallel_embedding_forward_only", gather=False, run=RunSettings(steps=2, train=False)
)
vocab_parallel_embedding_gathered_forward_only = _embedding_case(
    "vocab_parallel_embedding_gathered_forward_only",
    gather=True,
    run=RunSettings(steps=2, train=False),
)
vocab_parallel_embedding_no_grad = _embedding_case(
    "vocab_parallel_embedding_no_grad", gather=False, no_grad_forward=True
)
vocab_parallel_embedding_gathered_no_grad = _embedding_case(
    "vocab_parallel_embedding_gathered_no_grad", gather=True, no_grad_forward=True
)
