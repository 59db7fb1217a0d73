"""A Llama-like decoder layer written Megatron-style with plain torch.distributed; its dense twin.

The TP layer is the classic column + row pair in both sublayers: q/k/v and gate/up are
column-parallel (weight `Shard(0)`, this rank's heads / FFN columns), o and down row-parallel
(weight `Shard(1)`, all-reduced). Megatron's two operators are hand-written autograd Functions:

  f (`CopyToTP`): forward identity, backward all-reduce -- before the column-parallel linears;
  g (`ReduceFromTP`): forward all-reduce, backward identity -- after the row-parallel ones.

Planted bugs: f replaced by a plain identity (`Identity`, no backward all-reduce) before the MLP
(`f_missing="mlp"`) or before the attention (`f_missing="attn"`): the forward is right, the input
gradient of the sublayer is then one rank's partial sum. `flat=True`: the MLP's down_proj returns
its tokens flattened, `[s*b, h]`, and the MLP unflattens them in the wrong order.

Cases: `written` / `written_no_f_mlp` / `written_no_f_attn` -- a written `Plan(params=...)` with no
activations; `no_plan` / `no_plan_no_f_mlp` / `no_plan_no_f_attn` -- `plan=None` and a loader;
`written_flat_down` / `no_plan_flat_down` -- the layout bug.
Activations `[seq, batch, hidden]`.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard

SEQ, BATCH, HIDDEN, HEADS, FFN = 6, 2, 32, 4, 64
HEAD_DIM = HIDDEN // HEADS


class CopyToTP(torch.autograd.Function):
    """f -- forward: identity; backward: all-reduce (each rank holds a partial input grad)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.pg)
        return grad, None


class Identity(torch.autograd.Function):
    """The bug: f without its backward all-reduce -- forward: identity; backward: identity."""

    @staticmethod
    def forward(ctx, x, pg):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """g -- forward: all-reduce of the partial sums; backward: identity."""

    @staticmethod
    def forward(ctx, x, pg):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class RMSNorm(nn.Module):
    def __init__(self, dim, dtype=None, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class ColumnParallelLinear(nn.Linear):
    """y_local = f(x) @ W_r^T: weight [out/tp, in]."""

    def __init__(self, in_features, out_features, pg, world, dtype=None, f=CopyToTP):
        super().__init__(in_features, out_features // world, bias=False, dtype=dtype)
        self.pg, self.f = pg, f

    def forward(self, x):
        return F.linear(self.f.apply(x, self.pg), self.weight)  # [s, b, out/tp]


class RowParallelLinear(nn.Linear):
    """y = g(x_local @ W_r^T): weight [out, in/tp]."""

    def __init__(self, in_features, out_features, pg, world, dtype=None):
        super().__init__(in_features // world, out_features, bias=False, dtype=dtype)
        self.pg = pg

    def forward(self, x_local):
        return ReduceFromTP.apply(F.linear(x_local, self.weight), self.pg)  # [s, b, out]


def _attend(q, k, v, heads):
    """Causal attention over `heads` heads: q, k, v [s, b, heads * hd] -> [s, b, heads * hd]."""
    s, b, _ = q.shape
    q, k, v = (t.view(s, b, heads, HEAD_DIM).permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, hd]
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * HEAD_DIM)


class DenseAttention(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False, dtype=dtype)

    def forward(self, x):
        return self.o_proj(_attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), HEADS))


class TPAttention(nn.Module):
    def __init__(self, pg, world, dtype=None, f=CopyToTP):
        super().__init__()
        self.heads = HEADS // world  # this rank's heads
        self.q_proj = ColumnParallelLinear(HIDDEN, HIDDEN, pg, world, dtype, f)
        self.k_proj = ColumnParallelLinear(HIDDEN, HIDDEN, pg, world, dtype, f)
        self.v_proj = ColumnParallelLinear(HIDDEN, HIDDEN, pg, world, dtype, f)
        self.o_proj = RowParallelLinear(HIDDEN, HIDDEN, pg, world, dtype)

    def forward(self, x):
        return self.o_proj(_attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.heads))


class DenseMLP(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, FFN, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(HIDDEN, FFN, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(FFN, HIDDEN, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class FlatRowParallelLinear(RowParallelLinear):
    """A row-parallel linear that returns its tokens flattened, [s*b, h] (a varlen-style kernel's
    layout), where its dense twin returns [s, b, h]."""

    def forward(self, x_local):
        return super().forward(x_local).flatten(0, 1)  # [s*b, h], sequence-major


class TPMLP(nn.Module):
    """`flat`: the planted layout bug -- down_proj returns [s*b, h] and the MLP unflattens it
    batch-major (`view(b, s, h)`), which scrambles the tokens of a sequence-major flattening."""

    def __init__(self, pg, world, dtype=None, f=CopyToTP, flat=False):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(HIDDEN, FFN, pg, world, dtype, f)
        self.up_proj = ColumnParallelLinear(HIDDEN, FFN, pg, world, dtype, f)
        down = FlatRowParallelLinear if flat else RowParallelLinear
        self.down_proj = down(FFN, HIDDEN, pg, world, dtype)
        self.flat = flat

    def forward(self, x):
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.flat:  # [s*b, h] -> [b, s, h] -> [s, b, h]: the wrong order
            s, b, _ = x.shape
            out = out.view(b, s, HIDDEN).transpose(0, 1)
        return out  # [s, b, h]


class DenseLayer(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.input_layernorm = RMSNorm(HIDDEN, dtype)
        self.self_attn = DenseAttention(dtype)
        self.post_attention_layernorm = RMSNorm(HIDDEN, dtype)
        self.mlp = DenseMLP(dtype)

    def forward(self, hidden_states):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states))
        return h + self.mlp(self.post_attention_layernorm(h))


class TPLayer(DenseLayer):
    """Same parameter names as DenseLayer; `f_missing`: "mlp" or "attn", the sublayer whose f has no
    backward all-reduce (the planted bug), None for the correct layer; `flat`: the MLP's layout
    bug (TPMLP)."""

    def __init__(self, group, dtype=None, f_missing=None, flat=False):
        nn.Module.__init__(self)
        pg, world = group.pg, group.world_size
        self.input_layernorm = RMSNorm(HIDDEN, dtype)
        self.self_attn = TPAttention(
            pg, world, dtype, Identity if f_missing == "attn" else CopyToTP
        )
        self.post_attention_layernorm = RMSNorm(HIDDEN, dtype)
        self.mlp = TPMLP(pg, world, dtype, Identity if f_missing == "mlp" else CopyToTP, flat)


PLAN = Plan(
    params={
        "input_layernorm.weight": Replicate(),
        "self_attn.q_proj.weight": Shard(0),
        "self_attn.k_proj.weight": Shard(0),
        "self_attn.v_proj.weight": Shard(0),
        "self_attn.o_proj.weight": Shard(1),
        "post_attention_layernorm.weight": Replicate(),
        "mlp.gate_proj.weight": Shard(0),
        "mlp.up_proj.weight": Shard(0),
        "mlp.down_proj.weight": Shard(1),
    }
)


def load_tp(tp, state, group):
    """A Megatron-style checkpoint loader: column-parallel weights split along their rows,
    row-parallel ones along their columns, the norms copied."""
    r, w = group.rank, group.world_size
    for name, p in tp.named_parameters():
        full = state[name]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            p.copy_(full.chunk(w, dim=1)[r])
        elif name.endswith("layernorm.weight"):
            p.copy_(full)
        else:
            p.copy_(full.chunk(w, dim=0)[r])


def init(module, g):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * HIDDEN**-0.5)


def make_batch(g, dtype):
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    return {"hidden_states": x.to(dtype)}, torch.randn(SEQ, BATCH, HIDDEN, generator=g).to(dtype)


def _case(name, f_missing=None, written=True, flat=False):
    return Case(
        name=name,
        build_dense=DenseLayer,
        build_tp=lambda group, dtype: TPLayer(group, dtype, f_missing, flat),
        plan=PLAN if written else None,
        load_tp=None if written else load_tp,
        make_batch=make_batch,
        init=init,
        run=RunSettings(steps=1),
    )


written = _case("written")
written_no_f_mlp = _case("written_no_f_mlp", "mlp")
written_no_f_attn = _case("written_no_f_attn", "attn")
no_plan = _case("no_plan", written=False)
no_plan_no_f_mlp = _case("no_plan_no_f_mlp", "mlp", written=False)
no_plan_no_f_attn = _case("no_plan_no_f_attn", "attn", written=False)
written_flat_down = _case("written_flat_down", flat=True)
no_plan_flat_down = _case("no_plan_flat_down", written=False, flat=True)
