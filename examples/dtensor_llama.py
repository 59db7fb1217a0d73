"""A 2-layer Llama-style model, tensor-parallelized with a torchtitan-style DTensor plan.

    tpcheck verify examples/dtensor_llama.py:case_tp --world-size 2 4
    tpcheck verify examples/dtensor_llama.py:case_sp --world-size 2 4  # + SequenceParallel, norms
    tpcheck verify examples/dtensor_llama.py:buggy --world-size 2      # exits 1: the planted bug

The model knows nothing of parallelism (separate q/k/v projections, causal attention, SwiGLU FFN,
RMSNorm, activations [seq, batch, hidden]); TP is the table `tp_plan(sp)`, as in torchtitan's
Llama plan: attention wq/wk/wv colwise, wo rowwise, feed_forward w1/w3 colwise, w2 rowwise; with
sequence parallelism the norms are SequenceParallel on dim 0 and attention/feed_forward gather the
sequence first (PrepareModuleInput).

Planted bug (`buggy`): the attention reshapes q/k/v with the *global* head count,
`view(s, b, HEADS, -1)`, instead of `view(s, b, -1, head_dim)`. Dense, the two are the same; under
TP each rank holds DIM/tp columns, so the view silently makes HEADS heads of head_dim/tp channels
and attention mixes the wrong channels. No shape error, no hang: tpcheck flags the output of
layers.0.attention.wo (the module after the reshape) in the forward of step 1.
"""

import torch
import torch.nn.functional as F
from torch import nn

from tpcheck import RunSettings
from tpcheck.adapters.dtensor import dtensor_case
from tpcheck.parallel.losses import sp_mse_loss
from tpcheck.plan import Shard

SEQ, BATCH, DIM, HEADS, FFN, LAYERS = 8, 2, 32, 4, 64, 2


class RMSNorm(nn.Module):
    def __init__(self, dim, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, dtype=None, global_heads=False):
        super().__init__()
        self.head_dim, self.global_heads = DIM // HEADS, global_heads
        self.wq = nn.Linear(DIM, DIM, bias=False, dtype=dtype)
        self.wk = nn.Linear(DIM, DIM, bias=False, dtype=dtype)
        self.wv = nn.Linear(DIM, DIM, bias=False, dtype=dtype)
        self.wo = nn.Linear(DIM, DIM, bias=False, dtype=dtype)

    def forward(self, x):  # [s, b, dim]
        s, b, _ = x.shape
        # -1 heads: under TP each rank holds HEADS/tp of them (torchtitan's trick)
        # the planted bug
        shape = (s, b, HEADS, -1) if self.global_heads else (s, b, -1, self.head_dim)
        q, k, v = (w(x).view(shape).permute(1, 2, 0, 3) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, hd]
        return self.wo(out.permute(2, 0, 1, 3).reshape(s, b, -1))


class FeedForward(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False, dtype=dtype)
        self.w2 = nn.Linear(FFN, DIM, bias=False, dtype=dtype)
        self.w3 = nn.Linear(DIM, FFN, bias=False, dtype=dtype)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dtype=None, global_heads=False):
        super().__init__()
        self.attention_norm = RMSNorm(DIM, dtype)
        self.attention = Attention(dtype, global_heads)
        self.ffn_norm = RMSNorm(DIM, dtype)
        self.feed_forward = FeedForward(dtype)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, dtype=None, global_heads=False):
        super().__init__()
        self.layers = nn.ModuleList(Block(dtype, global_heads) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def init(model, g):
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.05 if name.endswith("norm.weight") else p.shape[-1] ** -0.5
            p.copy_(
                (1.0 if name.endswith("norm.weight") else 0.0)
                + scale * torch.randn(p.shape, generator=g)
            )


def make_batch(g, dtype):
    x = torch.randn(SEQ, BATCH, DIM, generator=g)
    target = torch.randn(SEQ, BATCH, DIM, generator=g)
    return {"x": x.to(dtype)}, target.to(dtype)


def tp_plan(sp: bool) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    row_out = {"output_layouts": DShard(0)} if sp else {}
    plan = {}
    for i in range(LAYERS):
        p = f"layers.{i}."
        plan.update(
            {
                p + "attention.wq": ColwiseParallel(),
                p + "attention.wk": ColwiseParallel(),
                p + "attention.wv": ColwiseParallel(),
                p + "attention.wo": RowwiseParallel(**row_out),
                p + "feed_forward.w1": ColwiseParallel(),
                p + "feed_forward.w2": RowwiseParallel(**row_out),
                p + "feed_forward.w3": ColwiseParallel(),
            }
        )
        if sp:
            gather = PrepareModuleInput(
                input_layouts=(DShard(0),), desired_input_layouts=(Replicate(),)
            )
            plan.update(
                {
                    p + "attention_norm": SequenceParallel(sequence_dim=0),
                    p + "attention": gather,
                    p + "ffn_norm": SequenceParallel(sequence_dim=0),
                    p + "feed_forward": gather,
                }
            )
    return plan


def _case(name: str, sp: bool, build_dense=Llama):
    fields = (
        {
            "input_placements": {"x": Shard(0)},
            "output_placement": Shard(0),
            "target_placement": Shard(0),
            "tp_loss": sp_mse_loss,
        }
        if sp
        else {}
    )
    return dtensor_case(
        name=name,
        build_dense=build_dense,
        tp_plan=tp_plan(sp),
        make_batch=make_batch,
        init=init,
        run=RunSettings(steps=2),
        **fields,
    )


def case_tp(spec):
    return _case("dtensor_llama", sp=False)


def case_sp(spec):
    return _case("dtensor_llama_sp", sp=True)


def case_buggy(spec):
    return _case(
        "dtensor_llama_global_heads",
        sp=False,
        build_dense=lambda dtype: Llama(dtype, global_heads=True),
    )
