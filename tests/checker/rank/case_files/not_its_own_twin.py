"""An inference model whose dense twin is not its own float64 twin, written as inference engines
write their norms: `x.float()`, then the normalisation in place (`mul_`). In a float32 run
`x.float()` is `x` itself, so the norm writes into the residual stream it was handed; in the
float64 run `x.float()` is a copy and the residual is left alone. The float64 run then computes
another function: the dense model is 0.6 to 1 away from it on values of about 2, far beyond
rounding, and a bound made from that gap would hide a real bug. TP as engines write it: the MLP
column- then row-parallel (the all-reduce in a forward hook), the LM head vocab-parallel with the
logits gathered (`dist.all_gather`, then `torch.cat` in rank order).

    tpcheck verify tests/checker/rank/case_files/not_its_own_twin.py:in_place_norm --world-size 2

Planted bug (`head_gather_reversed`): the gathered vocabulary shards concatenated in reverse rank
order: the logits of each shard land on another shard's tokens.

A kernel chosen by dtype (`fast_path`): the layers' norms take, in bfloat16 only, a fast path that
normalises the residual in place; the float64 run takes the plain one. Planted bug
(`fast_path_forgets_weight`): the TP side's fast path drops the norm's weight, a bug the float64
run never sees.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

DIM, FFN, VOCAB, LAYERS, BATCH, SEQ = 32, 64, 64, 2, 2, 6


class InPlaceRMSNorm(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(DIM, dtype=dtype), requires_grad=False)

    def forward(self, x):
        h = x.float()
        h.mul_(torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
        return h.to(x.dtype) * self.weight


class FastPathRMSNorm(InPlaceRMSNorm):
    """A kernel chosen by dtype: in bfloat16 a fast path that normalises its input in place (the
    residual stream with it), elsewhere the plain one. `forgets_weight`: the planted bug, on the
    fast path only (the float64 run never takes it)."""

    def __init__(self, dtype=None, forgets_weight=False):
        super().__init__(dtype)
        self.forgets_weight = forgets_weight

    def forward(self, x):
        if x.dtype != torch.bfloat16:
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(
                x.dtype
            ) * self.weight
        x.mul_(torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype))
        return x if self.forgets_weight else x * self.weight


class Layer(nn.Module):
    def __init__(self, world, pg, dtype=None, norm=InPlaceRMSNorm):
        super().__init__()
        self.norm = norm(dtype)
        self.up = nn.Linear(DIM, FFN // world, bias=False, dtype=dtype)
        self.down = nn.Linear(FFN // world, DIM, bias=False, dtype=dtype)
        if pg is not None:
            self.down.register_forward_hook(lambda m, i, out: dist.all_reduce(out, group=pg))

    def forward(self, x):
        return x + self.down(F.silu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, group=None, dtype=None, bug=None):
        super().__init__()
        world = 1 if group is None else group.world_size
        self.pg, self.world, self.bug = (None if group is None else group.pg), world, bug
        self.embed = nn.Embedding(VOCAB, DIM, dtype=dtype)
        norm = InPlaceRMSNorm
        if bug is not None and bug.startswith("fast_path"):
            forgets = bug == "fast_path_forgets_weight"
            norm = lambda dtype: FastPathRMSNorm(dtype, forgets)  # noqa: E731
        self.layers = nn.ModuleList(Layer(world, self.pg, dtype, norm) for _ in range(LAYERS))
        self.norm = InPlaceRMSNorm(dtype)
        self.head = nn.Linear(DIM, VOCAB // world, bias=False, dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        if self.pg is None:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits.contiguous(), group=self.pg)
        return torch.cat(parts[::-1] if self.bug == "head_gather_reversed" else parts, dim=-1)


def make_batch(g, dtype):
    return {"tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)}, None


PLAN = Plan(
    params={
        "embed.weight": Replicate(),
        **{f"layers.{i}.up.weight": Shard(0) for i in range(LAYERS)},
        **{f"layers.{i}.down.weight": Shard(1) for i in range(LAYERS)},
        **{f"layers.{i}.norm.weight": Replicate() for i in range(LAYERS)},
        "norm.weight": Replicate(),
        "head.weight": Shard(0),
    },
    activations={
        **{f"layers.{i}.up": Shard(2) for i in range(LAYERS)},
        **{f"layers.{i}.down": Replicate() for i in range(LAYERS)},
        "head": Shard(2),
    },
)


def _case(name, bug=None):
    dense_bug = "fast_path" if bug is not None and bug.startswith("fast_path") else None
    return Case(
        name=name,
        build_dense=lambda dtype: Model(None, dtype, dense_bug),
        build_tp=lambda group, dtype: Model(group, dtype, bug),
        plan=PLAN,
        make_batch=make_batch,
        run=RunSettings(steps=1, train=False),
    )


in_place_norm = _case("in_place_norm")
head_gather_reversed = _case("in_place_norm_head_gather_reversed", "head_gather_reversed")
# the layers' norms chosen by dtype: the bfloat16 fast path normalises the residual in place
fast_path = _case("fast_path", "fast_path")
fast_path_forgets_weight = _case("fast_path_forgets_weight", "fast_path_forgets_weight")
