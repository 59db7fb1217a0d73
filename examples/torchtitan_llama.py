"""torchtitan's own Llama 3, tensor-parallelized by torchtitan (pip install 'tpcheck[torchtitan]').

    tpcheck verify examples/torchtitan_llama.py:tp --world-size 2
    tpcheck verify examples/torchtitan_llama.py:sp --world-size 2      # + sequence parallel
    tpcheck verify examples/torchtitan_llama.py:buggy --world-size 2   # exits 1: the planted bug

The model is torchtitan 0.3.0's `Llama3Model`, its layers built by torchtitan's own Llama 3 builder
(`_build_llama3_layers`: fused QKV, GQA, RoPE, SwiGLU, RMSNorm), shrunk to 2 layers of width 32
with a 64-token vocabulary; the TP side is what torchtitan's `parallelize_llama` does for TP:
`set_llama3_sharding_config(config, enable_sp=...)` fills every module's ShardingConfig (torchtitan
does it in `Llama3Model.Config.update_from_config`), then `model.parallelize(parallel_dims)`.
The loss is loss parallel: torchtitan's vocab-parallel cross-entropy on the lm_head's vocabulary
shards (adapters/torchtitan.py).

On the CPU, attention is torchtitan's `ScaledDotProductAttention` (its test-only SDPA backend):
the default FlexAttention has no backward on the CPU. See adapters/torchtitan.py for the mesh
device.

Planted bug (`buggy`): the token embedding's declared output is `R` (replicated) instead of `P`
(partial). torchtitan's vocab-parallel embedding runs in a `local_map` region: each rank looks up
the ids in its own vocabulary block and zeroes the others, so its output is a partial sum that the
declared `P -> R` redistribution all-reduces. Declared `R`, DTensor takes the local rows as already
whole: no all-reduce, no error, every token missing the rows of the other ranks. tpcheck flags the
output of `tok_embeddings` in the forward of step 1.
"""

import torch

from tpcheck import RunSettings
from tpcheck.adapters import torchtitan as tt

if not tt.available():
    raise ImportError(tt.TORCHTITAN_ERROR)

DIM, HEADS, KV_HEADS, FFN, LAYERS, VOCAB, SEQ, BATCH = 32, 4, 2, 64, 2, 64, 8, 2


def llama3_config(sp: bool, embedding_output: str = "P"):
    import spmd_types as spmd
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.decoder_sharding import dense_activation_placement
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_llama3_layers(
            n_layers=LAYERS,
            dim=DIM,
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            hidden_dim=FFN,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=4 * SEQ, theta=10000.0),
            attn_backend="flex",
        ),
    )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(config, enable_sp=sp)
    if embedding_output != "P":  # the planted bug
        config.tok_embeddings.sharding_config.out_src_shardings = dense_activation_placement(
            tp=getattr(spmd, embedding_output)
        )
    return config


def builder(sp: bool, embedding_output: str = "P"):
    def build(dtype: torch.dtype):
        from torchtitan.tools.utils import set_default_dtype

        # built in the working dtype (not `.to(dtype)`: that would cast the complex RoPE cache to
        # a real one)
        with set_default_dtype(dtype):
            model = llama3_config(sp, embedding_output).build()
            model.init_states(buffer_device=None)  # the RoPE cache
        return model

    return build


def init(model, g):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=g))
            elif name == "tok_embeddings.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(p.shape[-1] ** -0.5 * torch.randn(p.shape, generator=g))


def make_batch(g, dtype):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"tokens": tokens}, labels


def _case(name: str, sp: bool, embedding_output: str = "P"):
    return tt.torchtitan_case(
        name=name,
        build_dense=builder(sp, embedding_output),
        make_batch=make_batch,
        init=init,
        run=RunSettings(steps=2),
    )


def case_tp(spec):
    return _case("torchtitan_llama3", sp=False)


def case_sp(spec):
    return _case("torchtitan_llama3_sp", sp=True)


def case_buggy(spec):
    return _case("torchtitan_llama3_embedding_replicated", sp=False, embedding_output="R")
