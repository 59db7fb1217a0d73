"""torchtitan's own Qwen3 MoE, tensor-parallelized by torchtitan (tpcheck[torchtitan]).

    tpcheck verify examples/torchtitan_qwen3_moe.py:moe --world-size 2   # bfloat16 (see below)

The model is torchtitan 0.3.0's `Qwen3Model` with its MoE layers (`_build_qwen3_moe_layers`: fused
QKV with q/k norms, a softmax top-2 router over 4 experts, grouped-matmul routed experts), 2 layers
of width 32; the TP side is `set_qwen3_sharding_config(config, enable_sp=False, enable_ep=False)`
then `model.parallelize(parallel_dims)`: with TP and no expert parallelism every expert's hidden
dimension is split over the ranks (w1/w3 on F, w2 on F, the router replicated) and the routed
output all-reduced. Attention is torchtitan's `ScaledDotProductAttention` on the CPU (FlexAttention
has no CPU backward).

Checked in bfloat16: torchtitan's routed experts compute in bfloat16 whatever the model's dtype
(`x.bfloat16()` and `w.bfloat16()` before each `torch._grouped_mm`, torchtitan/models/common/moe.py
`GroupedExperts`), so in a float32 run each rank's partial expert output is rounded to bfloat16
before the all-reduce while the dense model rounds the whole sum once. That is bfloat16 rounding,
~7e-3 at this size, far above a float32 bound: tpcheck reports it as a `mismatch` at
`layers.0.moe`. In a bfloat16 run the bound is bfloat16's and the model is equivalent.
"""

import torch

from tpcheck import RunSettings
from tpcheck.adapters import torchtitan as tt

if not tt.available():
    raise ImportError(tt.TORCHTITAN_ERROR)

DIM, HEADS, KV_HEADS, HEAD_DIM, EXPERT_FFN, EXPERTS, TOP_K, LAYERS = 32, 4, 2, 8, 16, 4, 2, 2
VOCAB, SEQ, BATCH = 64, 8, 2


def qwen3_moe_config():
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    config = Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=RMSNorm.Config(normalized_shape=DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_qwen3_moe_layers(
            n_layers=LAYERS,
            dim=DIM,
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            moe_hidden_dim=EXPERT_FFN,
            num_experts=EXPERTS,
            top_k=TOP_K,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=4 * SEQ, theta=1e6),
        ),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_qwen3_sharding_config(config, enable_sp=False, enable_ep=False)
    return config


def build(dtype: torch.dtype):
    from torchtitan.tools.utils import set_default_dtype

    with set_default_dtype(dtype):
        model = qwen3_moe_config().build()
        model.init_states(buffer_device=None)  # the RoPE cache
    return model


def init(model, g):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(p.shape[-1] ** -0.5 * torch.randn(p.shape, generator=g))


def make_batch(g, dtype):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"tokens": tokens}, labels


def case_moe(spec):
    return tt.torchtitan_case(
        name="torchtitan_qwen3_moe",
        build_dense=build,
        make_batch=make_batch,
        init=init,
        run=RunSettings(steps=2, dtype="bfloat16"),
    )
