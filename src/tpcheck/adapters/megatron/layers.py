"""Single Megatron-Core layers against their dense twins: `column_case`, `row_case`,
`embedding_case`, `cross_entropy_case`, `gated_mlp_case`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpcheck.adapters.megatron import runtime as mc
from tpcheck.adapters.megatron.runtime import Unpack, _fields, config, hidden_batch, init_megatron
from tpcheck.checker.case import Case
from tpcheck.plan import Fused, Plan, Replicate, Shard


def column_case(hidden: int = 16, out: int = 32, seq: int = 4, batch: int = 2, **kw) -> Case:
    """ColumnParallelLinear(bias, gather_output=True):
    weight and bias Shard(0), output replicated."""

    def build_tp(group, dtype):
        init_megatron(group)
        cfg = config(group.world_size, dtype, hidden, out)
        return Unpack(
            mc.mtp.ColumnParallelLinear(
                hidden, out, config=cfg, init_method=cfg.init_method, bias=True, gather_output=True
            )
        )

    return Case(
        name="megatron_column",
        build_dense=lambda dtype: Unpack(nn.Linear(hidden, out, dtype=dtype)),
        build_tp=build_tp,
        plan=Plan(params={"layer.weight": Shard(0), "layer.bias": Shard(0)}),
        make_batch=hidden_batch(seq, batch, hidden, out),
        **_fields(kw),
    )


def row_case(hidden: int = 32, out: int = 16, seq: int = 4, batch: int = 2, **kw) -> Case:
    """RowParallelLinear(bias, input_is_parallel=False): weight Shard(1), bias replicated."""

    def build_tp(group, dtype):
        init_megatron(group)
        cfg = config(group.world_size, dtype, out, hidden)
        return Unpack(
            mc.mtp.RowParallelLinear(
                hidden,
                out,
                config=cfg,
                init_method=cfg.init_method,
                bias=True,
                input_is_parallel=False,
                skip_bias_add=False,
            )
        )

    return Case(
        name="megatron_row",
        build_dense=lambda dtype: Unpack(nn.Linear(hidden, out, dtype=dtype)),
        build_tp=build_tp,
        plan=Plan(params={"layer.weight": Shard(1), "layer.bias": Replicate()}),
        make_batch=hidden_batch(seq, batch, hidden, out),
        **_fields(kw),
    )


def embedding_case(vocab: int = 64, hidden: int = 16, seq: int = 4, batch: int = 2, **kw) -> Case:
    """VocabParallelEmbedding: weight Shard(0) (a vocab
    range per rank, masked lookup + all-reduce)."""

    def build_tp(group, dtype):
        init_megatron(group)
        cfg = config(group.world_size, dtype, hidden, 4 * hidden)
        return mc.mtp.VocabParallelEmbedding(vocab, hidden, init_method=cfg.init_method, config=cfg)

    def make(g, dtype):
        tokens = torch.randint(0, vocab, (batch, seq), generator=g)
        return {"input_": tokens}, torch.randn(batch, seq, hidden, generator=g).to(dtype)

    return Case(
        name="megatron_vocab_embedding",
        build_dense=lambda dtype: _Embedding(vocab, hidden, dtype),
        build_tp=build_tp,
        plan=Plan(params={"weight": Shard(0)}),
        make_batch=make,
        grad_inputs=(),
        **_fields(kw),
    )


class _Embedding(nn.Embedding):
    def __init__(self, vocab, hidden, dtype):
        super().__init__(vocab, hidden, dtype=dtype)

    def forward(self, input_):  # Megatron's argument name
        return super().forward(input_)


class _Head(nn.Module):
    """Dense twin of a column-parallel LM head: logits [s, b, vocab]."""

    def __init__(self, hidden, vocab, dtype, parallel=None):
        super().__init__()
        self.layer = (
            parallel if parallel is not None else nn.Linear(hidden, vocab, bias=False, dtype=dtype)
        )

    def forward(self, x):
        out = self.layer(x)
        return out[0] if isinstance(out, tuple) else out


def cross_entropy_case(
    hidden: int = 16, vocab: int = 64, seq: int = 4, batch: int = 2, **kw
) -> Case:
    """vocab_parallel_cross_entropy on column-parallel
    logits [s, b, vocab/tp] vs F.cross_entropy."""

    def build_tp(group, dtype):
        init_megatron(group)
        cfg = config(group.world_size, dtype, hidden, 4 * hidden)
        return _Head(
            hidden,
            vocab,
            dtype,
            mc.mtp.ColumnParallelLinear(
                hidden,
                vocab,
                config=cfg,
                init_method=cfg.init_method,
                bias=False,
                gather_output=False,
            ),
        )

    def make(g, dtype):
        x = torch.randn(seq, batch, hidden, generator=g)
        return {"x": x.to(dtype)}, torch.randint(0, vocab, (seq, batch), generator=g)

    def loss(logits, target):
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    def tp_loss(logits_local, target, group):
        return mc.mtp.vocab_parallel_cross_entropy(logits_local, target).mean()

    return Case(
        name="megatron_vocab_cross_entropy",
        build_dense=lambda dtype: _Head(hidden, vocab, dtype),
        build_tp=build_tp,
        plan=Plan(params={"layer.weight": Shard(0)}),
        make_batch=make,
        loss=loss,
        tp_loss=tp_loss,
        output_placement=Shard(2),
        **_fields(kw),
    )


class DenseGatedMLP(nn.Module):
    """Dense twin of Megatron's gated MLP: fc1 [gate;
    up] = [2*ffn, h], silu(gate) * up, fc2 [h, ffn]."""

    def __init__(self, hidden: int, ffn: int, dtype=None) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, 2 * ffn, bias=False, dtype=dtype)
        self.linear_fc2 = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x):
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)  # [s, b, ffn] each
        return self.linear_fc2(F.silu(gate) * up)


def gated_mlp_case(hidden: int = 16, ffn: int = 32, seq: int = 4, batch: int = 2, **kw) -> Case:
    """megatron.core MLP with gated_linear_unit=True: rank r's fc1 holds [gate_r; up_r] (Fused)."""

    def build_tp(group, dtype):
        init_megatron(group)
        cfg = config(
            group.world_size,
            dtype,
            hidden,
            ffn,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
        )
        subs = mc.MLPSubmodules(
            linear_fc1=mc.mtp.ColumnParallelLinear, linear_fc2=mc.mtp.RowParallelLinear
        )
        return Unpack(mc.MLP(cfg, subs))

    plan = Plan(
        params={
            "layer.linear_fc1.weight": Fused(0, (ffn, ffn)),
            "layer.linear_fc2.weight": Shard(1),
        }
    )
    return Case(
        name="megatron_gated_mlp",
        build_dense=lambda dtype: Unpack(DenseGatedMLP(hidden, ffn, dtype)),
        build_tp=build_tp,
        plan=plan,
        make_batch=hidden_batch(seq, batch, hidden),
        **_fields(kw),
    )
