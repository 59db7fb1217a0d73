"""A sequence-parallel batch norm, written with torch.distributed as TP codebases write one.

The block is bn(fc(x)) over activations [seq, batch, hidden], the batch norm over the channels
(hidden) of every token. Under sequence parallelism each rank holds seq/tp tokens: the TP batch
norm all-reduces its batch statistics (sum, then the sum of squared deviations: two passes, as
torch's own) so that every rank normalizes with the whole batch's mean and variance, and the
replicated parameters' partial gradients are all-reduced after the backward (`finalize_grads`).

`correct`: the running statistics are updated from the all-reduced statistics (as torch's
SyncBatchNorm does). `local_stats`: the planted bug, seen in ports of batch norm to sequence
parallelism: the running statistics are updated from the local shard's own mean and variance. The
training forward is right (it normalizes with the all-reduced statistics), every rank's
running_mean differs, and `model.eval()` normalizes with them.

`rotary`: a column + row parallel MLP fed a rotary-rotated input, whose only buffers are the cos/sin
caches (non-persistent), computed in each module's constructor; the TP module keeps one more buffer
(a scratch counter) that the dense one has not. `rotary_misfit`: its TP module keeps the caches for
its own shard of the sequence only (a shape no placement of the dense cache has).

`dropout_eval`: the same MLP with dropout on its (replicated) output, `nn.Dropout` on both sides.
`dropout_always`: its TP module calls `F.dropout(..., training=True)`, as code that forgot to pass
`self.training` does: right in training, it still drops in eval mode.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

SEQ, BATCH, HIDDEN, FFN = 8, 2, 16, 32


class AllReduce(torch.autograd.Function):
    """forward: all-reduce (sum); backward: all-reduce (every rank's statistics feed every rank's
    loss)."""

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


class DenseBlock(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)  # the norm has the bias
        self.bn = nn.BatchNorm1d(HIDDEN, dtype=dtype)

    def forward(self, x):  # [s, b, h]
        h = self.fc(x)
        return self.bn(h.reshape(-1, HIDDEN)).reshape(h.shape)


class SequenceParallelBatchNorm(nn.BatchNorm1d):
    """Batch norm over tokens sharded on the sequence: the batch statistics all-reduced."""

    def __init__(self, channels, pg, world, local_stats=False, dtype=None):
        super().__init__(channels, dtype=dtype)
        self.pg, self.world, self.local_stats = pg, world, local_stats

    def forward(self, x_local):  # [tokens/tp, c]
        if not self.training:
            return F.batch_norm(
                x_local,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        n = x_local.shape[0] * self.world  # tokens over every rank
        mean = AllReduce.apply(x_local.sum(0), self.pg) / n
        var = AllReduce.apply(((x_local - mean) ** 2).sum(0), self.pg) / n  # biased
        with torch.no_grad():
            if self.local_stats:  # the planted bug: this rank's shard only
                batch_mean, batch_var = x_local.mean(0), x_local.var(0, unbiased=True)
            else:
                batch_mean, batch_var = mean, var * n / (n - 1)
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * batch_mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * batch_var)
            self.num_batches_tracked.add_(1)
        return (x_local - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class TPBlock(nn.Module):
    """Sequence parallel: x and the output hold seq/tp tokens; every parameter replicated."""

    def __init__(self, group, dtype=None, local_stats=False):
        super().__init__()
        self.pg = group.pg
        self.fc = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)  # the norm has the bias
        self.bn = SequenceParallelBatchNorm(
            HIDDEN, group.pg, group.world_size, local_stats, dtype=dtype
        )

    def forward(self, x):  # [s/tp, b, h]: this rank's tokens
        h = self.fc(x)
        return self.bn(h.reshape(-1, HIDDEN)).reshape(h.shape)

    def finalize_grads(self):
        """Each rank's gradients of the replicated parameters are its tokens' share: summed."""
        for p in self.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.pg)


def sp_mse(out_local, target_local, group):
    """The dense MSE from sequence shards: the local squared errors over every token, summed."""
    n = out_local.numel() * group.world_size
    return ReduceFromTP.apply(((out_local - target_local) ** 2).sum() / n, group.pg)


def init(module, g):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def make_batch(g, dtype):
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g) + 0.5
    target = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    return {"x": x.to(dtype)}, target.to(dtype)


BN_PLAN = Plan(params={n: Replicate() for n in ("fc.weight", "bn.weight", "bn.bias")})


def _bn_case(name, local_stats):
    return Case(
        name=name,
        build_dense=DenseBlock,
        build_tp=lambda group, dtype: TPBlock(group, dtype, local_stats),
        plan=BN_PLAN,
        make_batch=make_batch,
        init=init,
        tp_loss=sp_mse,
        input_placements={"x": Shard(0)},
        output_placement=Shard(0),
        target_placement=Shard(0),
        run=RunSettings(steps=2),
    )


correct = _bn_case("sp_batchnorm", local_stats=False)
local_stats = _bn_case("sp_batchnorm_local_stats", local_stats=True)


# ------------------------------------------------------------------ rotary caches only


def rotary_cache(seq, dim, dtype):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)  # [s, h/2]
    emb = torch.cat([angles, angles], dim=-1)  # [s, h]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x, cos, sin):  # x [s, b, h], cos/sin [s, h]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]


class DenseRotaryMLP(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN, dtype=dtype)
        self.fc2 = nn.Linear(FFN, HIDDEN, dtype=dtype)
        cos, sin = rotary_cache(SEQ, HIDDEN, dtype or torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x):  # [s, b, h]
        x = rotate(x, self.rope_cos, self.rope_sin)
        return x + self.fc2(F.gelu(self.fc1(x)))


class TPRotaryMLP(nn.Module):
    """fc1 column-parallel, fc2 row-parallel; the rotary caches whole on every rank (`misfit`: the
    rank's own sequence shard of them, never used)."""

    def __init__(self, group, dtype=None, misfit=False):
        super().__init__()
        self.pg = group.pg
        ffn_local = FFN // group.world_size
        self.fc1 = nn.Linear(HIDDEN, ffn_local, dtype=dtype)
        self.fc2 = nn.Linear(ffn_local, HIDDEN, dtype=dtype)
        cos, sin = rotary_cache(SEQ, HIDDEN, dtype or torch.float32)
        # what the forward rotates with (a plain attribute: a misfit buffer is kept, never used)
        self.cos = None
        if misfit:  # a layout of its own: the rank's rows of the cache, and one more column
            self.cos, rows = cos, cos.chunk(group.world_size)[group.rank]
            cos = torch.cat([rows, rows[:, :1]], dim=1)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, x):  # [s, b, h]
        self.calls += 1
        x = rotate(x, self.rope_cos if self.cos is None else self.cos, self.rope_sin)
        x_tp = CopyToTP.apply(x, self.pg)
        partial = F.linear(F.gelu(self.fc1(x_tp)), self.fc2.weight)  # [s, b, h], partial sums
        return x + ReduceFromTP.apply(partial, self.pg) + self.fc2.bias


MLP_PLAN = Plan(
    params={
        "fc1.weight": Shard(0),
        "fc1.bias": Shard(0),
        "fc2.weight": Shard(1),
        "fc2.bias": Replicate(),
    }
)


def _rotary_case(name, misfit):
    return Case(
        name=name,
        build_dense=DenseRotaryMLP,
        build_tp=lambda group, dtype: TPRotaryMLP(group, dtype, misfit),
        plan=MLP_PLAN,
        make_batch=make_batch,
        init=init,
        run=RunSettings(steps=2),
    )


rotary = _rotary_case("rotary_caches", misfit=False)
rotary_misfit = _rotary_case("rotary_cache_misfit", misfit=True)


# ------------------------------------------------------------------ dropout in eval mode


class DenseDropoutMLP(DenseRotaryMLP):
    def __init__(self, dtype=None):
        super().__init__(dtype)
        self.drop = nn.Dropout(0.25)

    def forward(self, x):  # [s, b, h]
        x = rotate(x, self.rope_cos, self.rope_sin)
        return x + self.drop(self.fc2(F.gelu(self.fc1(x))))


class TPDropoutMLP(TPRotaryMLP):
    """Dropout after the all-reduce: a replicated region, the same mask on every rank."""

    def __init__(self, group, dtype=None, always=False):
        super().__init__(group, dtype)
        self.drop, self.always = nn.Dropout(0.25), always

    def forward(self, x):
        x = rotate(x, self.rope_cos, self.rope_sin)
        partial = F.linear(F.gelu(self.fc1(CopyToTP.apply(x, self.pg))), self.fc2.weight)
        out = ReduceFromTP.apply(partial, self.pg) + self.fc2.bias  # [s, b, h]
        if self.always:  # the planted bug: drops in eval mode too
            return x + F.dropout(out, 0.25, training=True)
        return x + self.drop(out)


def _dropout_case(name, always):
    return Case(
        name=name,
        build_dense=DenseDropoutMLP,
        build_tp=lambda group, dtype: TPDropoutMLP(group, dtype, always),
        plan=MLP_PLAN,
        make_batch=make_batch,
        init=init,
        run=RunSettings(steps=2),
    )


dropout_eval = _dropout_case("dropout_eval", always=False)
dropout_always = _dropout_case("dropout_always", always=True)
