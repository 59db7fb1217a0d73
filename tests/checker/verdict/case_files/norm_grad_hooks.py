"""Per-head q/k norms (Qwen3-style) in a column-parallel attention, their weights replicated and
their gradients reduced by hooks that the TP code's own plan installs, as public TP code writes it
(transformers' `replicated_with_grad_allreduce`, with plain torch.distributed calls).

Each rank holds heads/tp heads, and the norm weight (one value per head dimension) sees only this
rank's heads: its gradient is partial and must be summed over the ranks. The TP code reads a plan
of rules, pattern -> style, with `*` for a layer index, and installs per module:

  replicated_with_grad_allreduce  `p.register_post_accumulate_grad_hook` that all-reduces the
                    accumulated `p.grad` after every backward: with n micro-batches the gradient is
                    W^(n-1)·G_1 + ... + G_n, not G_1 + ... + G_n (the bug, with 2+ micro-batches)
  reduce_grad_on_arrival  `p.register_hook` that all-reduces each micro-batch's gradient as it
                    arrives, before accumulation (correct)
  colwise / rowwise names only: the projections are built local (their collectives are the
                    attention's own)

Cases:
  accumulated   q_norm and k_norm under replicated_with_grad_allreduce (wrong with micro-batches)
  on_arrival    both under reduce_grad_on_arrival (correct)
  unruled       the plan has a rule for k_norm but none for q_norm: q_norm's partial gradient is
                never reduced (wrong with one micro-batch too)
  ruled         the same plan with q_norm's rule (correct)
Every case passes its plan to tpcheck as `plan_rules`, for the diagnosis to name.
"""

import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

SEQ, BATCH, HEADS, HEAD_DIM = 4, 2, 4, 4
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
    """forward: all-reduce of the partial sums; backward: identity."""

    @staticmethod
    def forward(ctx, x, pg):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class RMSNorm(nn.Module):
    def __init__(self, dim, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


class Attention(nn.Module):
    """heads: this rank's heads (all of them on the dense side); pg: the TP group, None dense."""

    def __init__(self, heads, dtype=None, pg=None):
        super().__init__()
        self.heads, self.pg = heads, pg
        local = heads * HEAD_DIM
        self.q_proj = nn.Linear(HIDDEN, local, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(HIDDEN, local, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(HIDDEN, local, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(local, HIDDEN, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(HEAD_DIM, dtype)  # per head: one weight for every head
        self.k_norm = RMSNorm(HEAD_DIM, dtype)

    def forward(self, x):  # [b, s, h]
        b, s, _ = x.shape
        x_in = CopyToTP.apply(x, self.pg) if self.pg is not None else x

        def heads(t):
            return t.view(b, s, self.heads, HEAD_DIM).transpose(1, 2)

        q = self.q_norm(heads(self.q_proj(x_in)))
        k = self.k_norm(heads(self.k_proj(x_in)))
        out = F.scaled_dot_product_attention(q, k, heads(self.v_proj(x_in)), is_causal=True)
        out = self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * HEAD_DIM))
        return ReduceFromTP.apply(out, self.pg) if self.pg is not None else out


class Model(nn.Module):
    def __init__(self, heads=HEADS, dtype=None, pg=None):
        super().__init__()
        self.layers = nn.ModuleList([Attention(heads, dtype, pg)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def style_of(name, rules):
    """The rule for a module, as transformers matches it: the name with its layer numbers as `*`."""
    return rules.get(re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name))


def parallelize(model, rules, pg):
    """Install the plan's gradient hooks on the modules its rules name."""
    for name, module in model.named_modules():
        style = style_of(name, rules)
        for p in module.parameters(recurse=False):
            if style == "replicated_with_grad_allreduce":
                p.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad, group=pg))
            elif style == "reduce_grad_on_arrival":

                def reduce(grad):
                    grad = grad.clone()
                    dist.all_reduce(grad, group=pg)
                    return grad

                p.register_hook(reduce)
    return model


def make_batch(g, dtype):
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    return {"x": x.to(dtype)}, torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(dtype)


PLAN = Plan(
    params={
        "layers.0.q_proj.weight": Shard(0),
        "layers.0.k_proj.weight": Shard(0),
        "layers.0.v_proj.weight": Shard(0),
        "layers.0.o_proj.weight": Shard(1),
        "layers.0.q_norm.weight": Replicate(),
        "layers.0.k_norm.weight": Replicate(),
    },
    activations={"": Replicate()},
)
PROJECTIONS = {
    "layers.*.q_proj": "colwise",
    "layers.*.k_proj": "colwise",
    "layers.*.v_proj": "colwise",
    "layers.*.o_proj": "rowwise",
}


def rules_with(q_norm, k_norm):
    out = dict(PROJECTIONS)
    for module, style in (("q_norm", q_norm), ("k_norm", k_norm)):
        if style is not None:
            out[f"layers.*.{module}"] = style
    return out


def _case(name, rules, micro_batches):
    return Case(
        name=name,
        build_dense=lambda dtype: Model(dtype=dtype),
        build_tp=lambda group, dtype: parallelize(
            Model(HEADS // group.world_size, dtype, group.pg), rules, group.pg
        ),
        plan=PLAN,
        make_batch=make_batch,
        plan_rules=rules,
        run=RunSettings(dtype="float32", steps=1, micro_batches=micro_batches),
    )


accumulated = _case(
    "norm_grad_accumulated",
    rules_with("replicated_with_grad_allreduce", "replicated_with_grad_allreduce"),
    2,
)
on_arrival = _case(
    "norm_grad_on_arrival", rules_with("reduce_grad_on_arrival", "reduce_grad_on_arrival"), 2
)
unruled = _case("norm_grad_unruled", rules_with(None, "reduce_grad_on_arrival"), 1)
ruled = _case("norm_grad_ruled", rules_with("reduce_grad_on_arrival", "reduce_grad_on_arrival"), 1)
