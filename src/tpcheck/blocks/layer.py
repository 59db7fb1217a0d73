"""A transformer layer: attention + MLP, each with its residual."""

from __future__ import annotations

from tpcheck.blocks.attention import attention_parts, attention_plan
from tpcheck.blocks.base import Block, Collective, hidden_batch, prefixed, seq_or_rep, sp_loss, x_io
from tpcheck.blocks.mlp import mlp_parts, mlp_plan
from tpcheck.models.config import ModelConfig
from tpcheck.models.dense import DenseLayer
from tpcheck.models.parallel import ParallelLayer
from tpcheck.plan import Plan


def layer_plan(cfg: ModelConfig, sp: bool = False, prefix: str = "") -> Plan:
    att, mlp = attention_plan(cfg, sp), mlp_plan(cfg, sp)
    return Plan(
        params={
            **prefixed(prefix + "attention.", att.params),
            **prefixed(prefix + "mlp.", mlp.params),
        },
        activations={
            **prefixed(prefix + "attention.", att.activations),
            **prefixed(prefix + "mlp.", mlp.activations),
            prefix + "attention": seq_or_rep(sp),
            prefix + "mlp": seq_or_rep(sp),
        },
    )


def layer_parts(cfg: ModelConfig, world: int, sp: bool, prefix: str = "") -> list[Collective]:
    return attention_parts(cfg, world, sp, prefix + "attention.") + mlp_parts(sp, prefix + "mlp.")


BLOCK = Block(
    name="layer",
    shards=("ffn", "heads"),
    dense=lambda cfg, dtype: DenseLayer(cfg, dtype),
    tp=lambda cfg, group, dtype, sp: ParallelLayer(cfg, group, sequence_parallel=sp, dtype=dtype),
    plan=layer_plan,
    batch=hidden_batch,
    io=x_io,
    needs=("heads",),
    collectives=lambda cfg, world, sp: layer_parts(cfg, world, sp) + sp_loss(sp),
)
