"""A Megatron-Core TransformerLayer (GQA self-attention and a gated MLP, optionally sequence
parallel) and a tiny GPTModel with its vocab-parallel cross-entropy, each against a dense twin with
the same parameter names: `transformer_layer_case`, `gpt_model_case`."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from tpcheck.adapters.megatron import runtime as mc
from tpcheck.adapters.megatron.layers import DenseGatedMLP
from tpcheck.adapters.megatron.runtime import Finalized, Keep, init_megatron
from tpcheck.checker.case import Case
from tpcheck.checker.settings import RunSettings
from tpcheck.parallel.losses import sp_mse_loss
from tpcheck.plan import Fused, Plan, Replicate, Shard

# -------------------------------------------------------------- a transformer layer and a GPT model


class CPUNorm:
    """The layer specs' norm on CPU under SP. Megatron's CPU norm (`WrappedTorchNorm`, torch's
    RMSNorm/LayerNorm) refuses `sequence_parallel`; the SP-capable ones (TENorm, FusedLayerNorm)
    need Transformer Engine or apex. This is torch's norm with its parameters marked
    `sequence_parallel=config.sequence_parallel`, as TENorm and FusedLayerNorm mark theirs: the mark
    that Megatron's finalize_model_grads reduces by (see `Finalized`)."""

    def __new__(cls, config: mc.TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        norm = (nn.RMSNorm if config.normalization == "RMSNorm" else nn.LayerNorm)(
            hidden_size, eps=eps
        )
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


def layer_config(
    world: int,
    dtype: torch.dtype,
    hidden: int,
    ffn: int,
    heads: int,
    groups: int,
    sequence_parallel: bool = False,
    layers: int = 1,
    dropout: float = 0.0,
    **kw,
) -> mc.TransformerConfig:
    """GQA attention, gated SiLU MLP, RMSNorm, no biases; `dropout` for both the hidden and the
    attention dropout (0 by default). Megatron refuses SP without TP, so at world 1 SP is off (a
    Shard(0) over one rank is the whole tensor: the case is unchanged)."""
    return mc.TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=groups,
        tensor_model_parallel_size=world,
        sequence_parallel=sequence_parallel and world > 1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=dropout,
        attention_dropout=dropout,
        **kw,
    )


def layer_spec(cfg: mc.TransformerConfig):
    """Megatron's local (no Transformer Engine) GPT layer spec: ColumnParallelLinear QKV and fc1,
    RowParallelLinear proj and fc2, DotProductAttention with a causal mask; `CPUNorm` under SP."""
    spec = mc.get_gpt_layer_local_spec(normalization="RMSNorm")
    if cfg.sequence_parallel:
        subs = dataclasses.replace(
            spec.submodules, input_layernorm=CPUNorm, pre_mlp_layernorm=CPUNorm
        )
        spec = dataclasses.replace(spec, submodules=subs)
    return spec


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's attention mask [1, 1, s, s], True = masked (above the diagonal). Passed
    explicitly: with attention_mask=None, DotProductAttention makes this mask on device "cuda"."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def rope_freqs(seq: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """RotaryEmbedding's angles for positions 0..s-1
    (not interleaved): [s, 1, 1, head_dim], float32."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    f = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.cat((f, f), dim=-1)[:, None, None, :]


def apply_rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    x1, x2 = t.chunk(2, dim=-1)
    return t * freqs.cos().to(t.dtype) + torch.cat((-x2, x1), dim=-1) * freqs.sin().to(t.dtype)


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """Where Megatron computes in float32 (softmax,
    cross-entropy): float32, or float64 for the truth."""
    return torch.promote_types(dtype, torch.float32)


class DenseSelfAttention(nn.Module):
    """Dense twin of Megatron's SelfAttention with GQA. linear_qkv [(heads + 2*groups) * d, h] is in
    Megatron's layout, interleaved per query group: group g's rows are [its heads/groups q heads;
    its k head; its v head]. Rank r's ColumnParallelLinear holds the r-th contiguous block of rows:
    a plain `Shard(0)` of this layout (whole groups when groups >= tp; with fewer groups than ranks,
    Megatron all-gathers the QKV output and each rank picks its group). Causal softmax(q k^T /
    sqrt(d)) (in float32 for 16-bit inputs, as attention_softmax_in_fp32), k/v repeated per group;
    rope (when given) on q and k; linear_proj [h, heads*d]."""

    def __init__(
        self, hidden: int, heads: int, groups: int, dtype=None, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.heads, self.groups, self.d, self.dropout = heads, groups, hidden // heads, dropout
        self.linear_qkv = nn.Linear(hidden, (heads + 2 * groups) * self.d, bias=False, dtype=dtype)
        self.linear_proj = nn.Linear(heads * self.d, hidden, bias=False, dtype=dtype)

    def forward(self, x, attention_mask, rotary=None):
        s, b, _ = x.shape
        per, d = self.heads // self.groups, self.d
        qkv = self.linear_qkv(x).view(s, b, self.groups, (per + 2) * d)
        q, k, v = qkv.split([per * d, d, d], dim=-1)
        q = q.reshape(s, b, self.heads, d)  # [s, b, heads, d]; k, v: [s, b, groups, d]
        if rotary is not None:
            q, k = apply_rope(q, rotary), apply_rope(k, rotary)
        k, v = k.repeat_interleave(per, dim=2), v.repeat_interleave(per, dim=2)
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) * d**-0.5
        scores = scores.masked_fill(attention_mask, float("-inf"))
        probs = scores.softmax(-1, dtype=_at_least_float32(x.dtype)).to(x.dtype)
        # [b, heads, s, s], as DotProductAttention
        probs = F.dropout(probs, self.dropout, self.training)
        return self.linear_proj(torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(s, b, -1))


class DenseTransformerLayer(nn.Module):
    """Dense twin of TransformerLayer (pre-norm): h = x + dropout(attn(norm(x))); out = h +
    dropout(mlp(norm(h))) (Megatron's bias-dropout-add, no bias; the attention
    probabilities dropped too)."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        heads: int,
        groups: int,
        dtype=None,
        eps: float = 1e-5,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.dropout = dropout
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.self_attention = DenseSelfAttention(hidden, heads, groups, dtype, dropout)
        self.pre_mlp_layernorm = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.mlp = DenseGatedMLP(hidden, ffn, dtype)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb=None):
        attn = self.self_attention(
            self.input_layernorm(hidden_states), attention_mask, rotary_pos_emb
        )
        h = hidden_states + F.dropout(attn, self.dropout, self.training)
        return h + F.dropout(self.mlp(self.pre_mlp_layernorm(h)), self.dropout, self.training)


def layer_plan(prefix: str, ffn: int) -> dict:
    """A TransformerLayer's parameters: QKV Shard(0) (whole query groups per rank), proj and fc2
    Shard(1), fc1 Fused [gate_r; up_r], norms replicated."""
    return {
        f"{prefix}input_layernorm.weight": Replicate(),
        f"{prefix}self_attention.linear_qkv.weight": Shard(0),
        f"{prefix}self_attention.linear_proj.weight": Shard(1),
        f"{prefix}pre_mlp_layernorm.weight": Replicate(),
        f"{prefix}mlp.linear_fc1.weight": Fused(0, (ffn, ffn)),
        f"{prefix}mlp.linear_fc2.weight": Shard(1),
    }


def _sp_fields(sequence_parallel: bool) -> dict:
    """Under SP the layer's input and output are sequence shards ([s, b, h] dim 0)."""
    if not sequence_parallel:
        return {}
    return {
        "input_placements": {"hidden_states": Shard(0)},
        "output_placement": Shard(0),
        "target_placement": Shard(0),
        "tp_loss": sp_mse_loss,
    }


def transformer_layer_case(
    hidden: int = 32,
    ffn: int = 64,
    heads: int = 8,
    groups: int = 4,
    seq: int = 8,
    batch: int = 2,
    sequence_parallel: bool = False,
    dropout: float = 0.0,
    **kw,
) -> Case:
    """A TransformerLayer from Megatron's local spec: GQA (8 heads, 4 query groups: whole groups per
    rank at world 1, 2, 4), gated SiLU MLP, RMSNorm, the explicit causal mask. Input hidden_states
    [s, b, h]. With `sequence_parallel`, the input and output are Shard(0) and the norm weights'
    partial grads are summed by `Finalized.finalize_grads` (Megatron's own finalize code). The TP
    module is cast to the working dtype, as Megatron's Float16Module does (WrappedTorchNorm makes
    float32 weights). `dropout`: hidden and attention dropout. A bare layer under SP relies on
    TransformerBlock to fork its draws (Megatron forks the whole layer stack there), so with dropout
    use `gpt_model_case` for SP."""

    def build_tp(group, dtype):
        init_megatron(group)
        cfg = layer_config(
            group.world_size, dtype, hidden, ffn, heads, groups, sequence_parallel, dropout=dropout
        )
        return Finalized(mc.build_module(layer_spec(cfg), config=cfg, layer_number=1), cfg).to(
            dtype
        )

    def make(g, dtype):
        x = torch.randn(seq, batch, hidden, generator=g).to(dtype)
        return {"hidden_states": x, "attention_mask": causal_mask(seq)}, torch.randn(
            seq, batch, hidden, generator=g
        )

    name = (
        "megatron_transformer_layer"
        + ("_sp" if sequence_parallel else "")
        + (f"_drop{dropout:g}" if dropout else "")
    )
    return Case(
        name=name,
        build_dense=lambda dtype: Keep(
            DenseTransformerLayer(hidden, ffn, heads, groups, dtype, dropout=dropout)
        ),
        build_tp=build_tp,
        plan=Plan(params=layer_plan("layer.", ffn)),
        make_batch=make,
        **_sp_fields(sequence_parallel),
        **{"run": RunSettings(steps=2), **kw},
    )


class DenseGPT(nn.Module):
    """Dense twin of GPTModel (rope, untied output layer, final RMSNorm) called with labels: the
    per-token cross-entropy [b, s], computed in float32 as Megatron's vocab-parallel cross-entropy.

    label_smoothing: Megatron's definition (its docstring, from NeMo): the target puts 1 - a on the
    label and a/(V-1) on every other token; torch's `label_smoothing=e` puts 1 - e + e/V and e/V,
    the same distribution when e = a*V/(V-1). So the twin calls
    F.cross_entropy(label_smoothing=a*V/(V-1))."""

    def __init__(
        self,
        vocab: int,
        hidden: int,
        ffn: int,
        heads: int,
        groups: int,
        layers: int,
        dtype=None,
        label_smoothing: float = 0.0,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.dropout = dropout
        self.embedding, self.decoder = nn.Module(), nn.Module()
        self.embedding.word_embeddings = nn.Embedding(vocab, hidden, dtype=dtype)
        self.decoder.layers = nn.ModuleList(
            DenseTransformerLayer(hidden, ffn, heads, groups, dtype, dropout=dropout)
            for _ in range(layers)
        )
        self.decoder.final_layernorm = nn.RMSNorm(hidden, eps=1e-5, dtype=dtype)
        self.output_layer = nn.Linear(hidden, vocab, bias=False, dtype=dtype)
        self.head_dim, self.smoothing = hidden // heads, label_smoothing * vocab / (vocab - 1)

    def forward(self, input_ids, position_ids, attention_mask, labels):
        x = self.embedding.word_embeddings(input_ids).transpose(0, 1)  # [s, b, h]
        x = F.dropout(x, self.dropout, self.training)  # LanguageModelEmbedding's embedding_dropout
        s, b, _ = x.shape
        # positions 0..s-1, as GPTModel's rope (position_ids unused)
        rotary = rope_freqs(s, self.head_dim)
        for layer in self.decoder.layers:
            x = layer(x, attention_mask, rotary)
        logits = self.output_layer(self.decoder.final_layernorm(x))  # [s, b, V]
        logits = logits.to(_at_least_float32(logits.dtype))
        loss = F.cross_entropy(
            logits.flatten(0, 1),
            labels.transpose(0, 1).flatten(),
            reduction="none",
            label_smoothing=self.smoothing,
        )
        return loss.view(s, b).transpose(0, 1)


def _smoothed(model: nn.Module, label_smoothing: float) -> nn.Module:
    """GPTModel's loss with label smoothing: TransformerConfig has none, so the model's
    compute_language_model_loss is given one that passes it to vocab_parallel_cross_entropy (as a
    trainer that smooths does); otherwise identical ([b, s] labels, [s, b, V/tp]
    logits -> [b, s])."""

    def compute_language_model_loss(labels, logits):
        loss = mc.mtp.vocab_parallel_cross_entropy(
            logits, labels.transpose(0, 1).contiguous(), label_smoothing
        )
        return loss.transpose(0, 1).contiguous()

    model.compute_language_model_loss = compute_language_model_loss
    return model


def gpt_model_case(
    vocab: int = 64,
    hidden: int = 32,
    ffn: int = 64,
    heads: int = 8,
    groups: int = 4,
    layers: int = 2,
    seq: int = 8,
    batch: int = 2,
    sequence_parallel: bool = False,
    label_smoothing: float = 0.0,
    dropout: float = 0.0,
    **kw,
) -> Case:
    """A tiny GPTModel (local spec, rope, untied embeddings, parallel_output=True) called as in
    training: forward(input_ids, position_ids, attention_mask, labels) returns the per-token loss
    [b, s] of its vocab-parallel cross-entropy (replicated); the loss is its mean. The word
    embedding and the output layer are Shard(0) over the vocab. With `sequence_parallel` the
    embedding scatters the sequence and the output layer gathers it: inputs and output stay
    replicated; the norms' partial grads are summed by `Finalized.finalize_grads`.

    label_smoothing > 0 is passed to vocab_parallel_cross_entropy (`_smoothed`); in megatron-core
    0.16.1 that is equivalent at world 1 only (NVIDIA/Megatron-LM#737, see
    docs/findings/megatron-label-smoothing.md). In float64 the case is not equivalent either:
    Megatron's cross-entropy computes in float32 (`.float()`), 2.5e-7 against a
    float64 bound of 1.3e-9.

    `dropout`: embedding, hidden and attention dropout,
    Megatron drawing each mask where it forks."""

    def build_tp(group, dtype):
        init_megatron(group)
        cfg = layer_config(
            group.world_size,
            dtype,
            hidden,
            ffn,
            heads,
            groups,
            sequence_parallel,
            layers=layers,
            dropout=dropout,
        )
        spec = layer_spec(cfg)
        norm = spec.submodules.input_layernorm
        model = mc.GPTModel(
            cfg,
            mc.TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=norm),
            vocab,
            seq,
            position_embedding_type="rope",
            share_embeddings_and_output_weights=False,
        )
        return Finalized(_smoothed(model, label_smoothing) if label_smoothing else model, cfg).to(
            dtype
        )

    def make(g, dtype):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        positions = torch.arange(seq).expand(batch, seq).contiguous()
        inputs = {
            "input_ids": tokens[:, :-1],
            "position_ids": positions,
            "attention_mask": causal_mask(seq),
            "labels": tokens[:, 1:],
        }
        return inputs, tokens[:, 1:]

    params = {
        "layer.embedding.word_embeddings.weight": Shard(0),
        "layer.decoder.final_layernorm.weight": Replicate(),
        "layer.output_layer.weight": Shard(0),
    }
    for i in range(layers):
        params.update(layer_plan(f"layer.decoder.layers.{i}.", ffn))
    name = (
        "megatron_gpt"
        + ("_sp" if sequence_parallel else "")
        + (f"_ls{label_smoothing:g}" if label_smoothing else "")
    )
    name += f"_drop{dropout:g}" if dropout else ""
    return Case(
        name=name,
        build_dense=lambda dtype: Keep(
            DenseGPT(vocab, hidden, ffn, heads, groups, layers, dtype, label_smoothing, dropout)
        ),
        build_tp=build_tp,
        plan=Plan(params=params),
        make_batch=make,
        loss=lambda out, target: out.mean(),
        **{"run": RunSettings(steps=2), **kw},
    )
