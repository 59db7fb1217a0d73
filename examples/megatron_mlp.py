"""Real Megatron-Core layers (pip install
'tpcheck[megatron]') checked against dense twins on CPU/gloo.

    tpcheck verify examples/megatron_mlp.py:gated_mlp --world-size 2 4
    tpcheck verify examples/megatron_mlp.py:column examples/megatron_mlp.py:row \
        examples/megatron_mlp.py:embedding examples/megatron_mlp.py:cross_entropy --world-size 2
    tpcheck verify examples/megatron_mlp.py:buggy --world-size 2    # exits 1: the planted bug
    tpcheck verify examples/megatron_mlp.py:transformer_layer \
        examples/megatron_mlp.py:transformer_layer_sp --world-size 2 4 --dtype float32 bfloat16
    tpcheck verify examples/megatron_mlp.py:gpt examples/megatron_mlp.py:gpt_sp --world-size 2 4
    tpcheck verify examples/megatron_mlp.py:gpt_label_smoothing --world-size 1 2
        # world size 1: equivalent; 2: exits 1
    tpcheck verify examples/megatron_mlp.py:transformer_layer_buggy --world-size 2
        # exits 1: the planted bug

The gated MLP's fc1 is fused: the dense weight is [gate; up] but rank r holds [gate_r; up_r], so the
plan says `Fused(0, (ffn, ffn))`. Planted bug (`buggy`): a checkpoint converter that splits the
dense fc1 contiguously (`Shard(0)`), giving rank 0 [g0; g1] instead of [g0; u0]. The TP module runs
fine, but tpcheck flags `param:layer.linear_fc1.weight` at the weights stage (step
0), before any forward.

Beyond single layers: `transformer_layer` is a real TransformerLayer (GQA attention, gated MLP,
RMSNorm), `transformer_layer_sp` the same with sequence parallelism (input and output are sequence
shards; the norms' partial grads summed by Megatron's finalize code); `gpt` a 2-layer GPTModel
returning its per-token vocab-parallel cross-entropy (`gpt_sp`: with sequence parallelism). The
fused QKV is interleaved per query group ([q heads; k; v] of group 0, then group 1, ...), so whole
groups per rank are a plain `Shard(0)`. Planted bug (`transformer_layer_buggy`): a converter that
takes the QKV for [all q; all k; all v] and gives each rank its block of each part
(`Fused(0, (heads, groups, groups), (d, d, d))`, right for that layout, wrong for Megatron's);
flagged at `param:layer.self_attention.linear_qkv.weight`, step 0.

`gpt_label_smoothing` (label_smoothing=0.1): in megatron-core 0.16.1 vocab_parallel_cross_entropy
smooths with the local vocab size and the local mean log-probability (NVIDIA/Megatron-LM#737), so it
is equivalent at world 1 and not equivalent at world 2 and 4: see
docs/findings/megatron-label-smoothing.md.
"""

import dataclasses

from tpcheck import Injection
from tpcheck.adapters import megatron as mg
from tpcheck.plan import Fused, Plan, Shard

if not mg.available():
    raise ImportError(mg.MEGATRON_ERROR)


def case_gated_mlp(spec):
    return mg.gated_mlp_case()


def case_column(spec):
    return mg.column_case()


def case_row(spec):
    return mg.row_case()


def case_embedding(spec):
    return mg.embedding_case()


def case_cross_entropy(spec):
    return mg.cross_entropy_case()


def case_buggy(spec):
    good = mg.gated_mlp_case()
    # the converter's bug
    naive = Plan(params={**good.plan.params, "layer.linear_fc1.weight": Shard(0)})
    return dataclasses.replace(
        good, name="megatron_gated_mlp_contiguous_fc1", inject=Injection(load_plan=naive)
    )


def case_transformer_layer(spec):
    return mg.transformer_layer_case()


def case_transformer_layer_sp(spec):
    return mg.transformer_layer_case(sequence_parallel=True)


def case_gpt(spec):
    return mg.gpt_model_case()


def case_gpt_sp(spec):
    return mg.gpt_model_case(sequence_parallel=True)


def case_gpt_label_smoothing(spec):
    return mg.gpt_model_case(label_smoothing=0.1)


def case_transformer_layer_buggy(spec):
    good = mg.transformer_layer_case()
    heads, groups, d = 8, 4, 4  # the case's defaults: hidden 32 / 8 heads
    # the converter's bug: [q; k; v], not interleaved
    qkv_blocks = Fused(0, (heads, groups, groups), (d, d, d))
    naive = Plan(params={**good.plan.params, "layer.self_attention.linear_qkv.weight": qkv_blocks})
    return dataclasses.replace(
        good, name="megatron_transformer_layer_qkv_blocks", inject=Injection(load_plan=naive)
    )
