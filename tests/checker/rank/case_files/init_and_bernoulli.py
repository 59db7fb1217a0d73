"""A column + row parallel block, x + fc2(drop_hidden(gelu(fc1(x)))) then drop_out, written two ways
public TP code writes it.

Its own init (no `init` in the Case: tpcheck's default init runs):
  - `init_std`: the dense block's `reset_parameters(self, init_std=None)` (Megatron/OLMo style: an
    optional std, no generator); tpcheck does not call it and draws the weights itself;
  - `own_reset`: `reset_parameters(self)` (its own init from the global RNG); likewise not called;
  - `generator_reset`: `reset_parameters(self, generator=None)`, drawing every weight from the
    generator it is given; tpcheck calls it with its own;
  - `broken_generator_reset`: `reset_parameters(self, generator: torch.Generator)` that hands the
    generator on to `nn.Linear.reset_parameters()`, which takes none: the default init fails.

A hand-written dropout (`BernoulliDropout`: `torch.bernoulli(torch.full_like(x, 1 - p),
generator=g)`, `g` a torch.Generator the module owns), in place of F.dropout, on fc1's activations
(each rank holds a shard: its generator is seeded per rank) and on the output (every rank holds the
whole tensor: its generator is seeded the same everywhere):
  - `bernoulli`: correct;
  - `bernoulli_hidden_same_seed`: drop_hidden's generator seeded the same on every rank: every
    shard gets the same mask (`rng_not_forked` at drop_hidden);
  - `bernoulli_out_seeded_by_rank`: drop_out's generator seeded per rank: the replicas get
    different masks (`rng_diverged` at drop_out).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

SEQ, BATCH, HIDDEN, FFN = 4, 2, 16, 32
P = 0.25
SEED = 1234


class BernoulliDropout(nn.Module):
    """Dropout with its mask drawn from a generator the module owns."""

    def __init__(self, p: float, seed: int) -> None:
        super().__init__()
        self.p = p
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        mask = torch.bernoulli(torch.full_like(x, 1 - self.p), generator=self.generator)
        return x * mask / (1 - self.p)


class Dense(nn.Module):
    def __init__(self, dtype=None, dropout=False):
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, FFN, dtype=dtype)
        self.fc2 = nn.Linear(FFN, HIDDEN, dtype=dtype)
        self.drop_hidden = BernoulliDropout(P, SEED) if dropout else nn.Identity()
        self.drop_out = BernoulliDropout(P, SEED) if dropout else nn.Identity()

    def forward(self, x):
        h = self.drop_hidden(F.gelu(self.fc1(x)))  # [s, b, ffn]
        return x + self.drop_out(self.fc2(h))  # [s, b, h]


class InitStdDense(Dense):
    """An optional std in place of a generator (Megatron/OLMo style)."""

    def reset_parameters(self, init_std=None):
        std = HIDDEN**-0.5 if init_std is None else init_std
        for linear in (self.fc1, self.fc2):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
            nn.init.zeros_(linear.bias)


class OwnResetDense(Dense):
    """Its own init, from the global RNG."""

    def reset_parameters(self):
        for linear in (self.fc1, self.fc2):
            nn.init.trunc_normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)


class GeneratorResetDense(Dense):
    """Every weight drawn from the generator it is given."""

    def reset_parameters(self, generator=None):
        for linear in (self.fc1, self.fc2):
            nn.init.normal_(linear.weight, std=HIDDEN**-0.5, generator=generator)
            nn.init.normal_(linear.bias, std=0.1, generator=generator)


class BrokenGeneratorResetDense(Dense):
    """Hands the generator on to nn.Linear's reset_parameters, which takes none."""

    def reset_parameters(self, generator: torch.Generator):
        for linear in (self.fc1, self.fc2):
            linear.reset_parameters(generator)


class _CopyToTP(torch.autograd.Function):
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


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce; backward: identity."""

    @staticmethod
    def forward(ctx, x, pg):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=pg)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TP(nn.Module):
    """fc1 holds FFN/tp rows, fc2 FFN/tp columns (bias replicated); `bug` seeds one dropout's
    generator against its region's rule."""

    def __init__(self, group, dtype=None, dropout=False, bug=None):
        super().__init__()
        self.pg, rank = group.pg, group.rank
        local = FFN // group.world_size
        self.fc1 = nn.Linear(HIDDEN, local, dtype=dtype)
        self.fc2 = nn.Linear(local, HIDDEN, dtype=dtype)
        hidden_seed = SEED if bug == "hidden_same_seed" else SEED + 1 + rank
        out_seed = SEED + 1 + rank if bug == "out_seeded_by_rank" else SEED
        self.drop_hidden = BernoulliDropout(P, hidden_seed) if dropout else nn.Identity()
        self.drop_out = BernoulliDropout(P, out_seed) if dropout else nn.Identity()

    def forward(self, x):
        h = self.drop_hidden(F.gelu(self.fc1(_CopyToTP.apply(x, self.pg))))  # [s, b, ffn/tp]
        out = _ReduceFromTP.apply(F.linear(h, self.fc2.weight), self.pg) + self.fc2.bias
        return x + self.drop_out(out)


PLAN = Plan(
    params={
        "fc1.weight": Shard(0),
        "fc1.bias": Shard(0),
        "fc2.weight": Shard(1),
        "fc2.bias": Replicate(),
    }
)


def make_batch(g, dtype):
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dtype)
    return {"x": x}, torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dtype)


def _case(name, dense, dropout=False, bug=None):
    return Case(
        name=name,
        build_dense=lambda dtype: dense(dtype, dropout),
        build_tp=lambda group, dtype: TP(group, dtype, dropout, bug),
        plan=PLAN,
        make_batch=make_batch,
        run=RunSettings(steps=2),
    )


init_std = _case("init_std", InitStdDense)
own_reset = _case("own_reset", OwnResetDense)
generator_reset = _case("generator_reset", GeneratorResetDense)
broken_generator_reset = _case("broken_generator_reset", BrokenGeneratorResetDense)
bernoulli = _case("bernoulli", Dense, dropout=True)
bernoulli_hidden_same_seed = _case(
    "bernoulli_hidden_same_seed", Dense, dropout=True, bug="hidden_same_seed"
)
bernoulli_out_seeded_by_rank = _case(
    "bernoulli_out_seeded_by_rank", Dense, dropout=True, bug="out_seeded_by_rank"
)
