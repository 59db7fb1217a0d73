"""Real Megatron-Core layers (pip install 'tpcheck[megatron]') checked against dense twins on CPU/gloo.

    tpcheck verify examples/megatron_mlp.py:gated_mlp --world-size 2 4
    tpcheck verify examples/megatron_mlp.py:column examples/megatron_mlp.py:row \
        examples/megatron_mlp.py:embedding examples/megatron_mlp.py:cross_entropy --world-size 2
    tpcheck verify examples/megatron_mlp.py:buggy --world-size 2    # exits 1: the planted bug

The gated MLP's fc1 is fused: the dense weight is [gate; up] but rank r holds [gate_r; up_r], so the
plan says `Fused(0, (ffn, ffn))`. Planted bug (`buggy`): a checkpoint converter that splits the dense
fc1 contiguously (`Shard(0)`), giving rank 0 [g0; g1] instead of [g0; u0]. The TP module runs fine, but
tpcheck flags `param:layer.linear_fc1.weight` at the weights stage (step 0), before any forward.
"""
import dataclasses

from tpcheck import Injection
from tpcheck.adapters import megatron as mg
from tpcheck.plan import Plan, Shard

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
    naive = Plan(params={**good.plan.params, "layer.linear_fc1.weight": Shard(0)})  # the converter's bug
    return dataclasses.replace(good, name="megatron_gated_mlp_contiguous_fc1", inject=Injection(load_plan=naive))
