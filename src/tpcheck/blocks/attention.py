"""Self-attention: pre-RMSNorm -> fused QKV (column-parallel by heads; GQA/MQA KV heads replicated
when there are fewer than ranks) -> RoPE -> causal attention -> output projection (row-parallel)."""

from __future__ import annotations

from tpcheck.blocks.base import Block, Collective, hidden_batch, seq_or_rep, sp_loss, x_io
from tpcheck.models.config import ModelConfig
from tpcheck.models.dense import DenseAttention
from tpcheck.models.parallel import ParallelAttention
from tpcheck.plan import Fused, Plan, Replicate, Shard


def attention_plan(cfg: ModelConfig, sp: bool = False) -> Plan:
    """qkv: rank r holds [q_r; k_r; v_r] (`Fused` by heads; kv heads replicated when kv < tp);
    o row-parallel; norm replicated. Activations: norm and o outputs replicated (sequence-sharded
    under SP)."""
    d = cfg.head_dim
    return Plan(
        params={
            "norm.weight": Replicate(),
            "qkv.weight": Fused(0, (cfg.heads, cfg.num_kv_heads, cfg.num_kv_heads), (d, d, d)),
            "o.weight": Shard(1),
        },
        activations={"norm": seq_or_rep(sp), "o": seq_or_rep(sp)},
    )


def attention_parts(cfg: ModelConfig, world: int, sp: bool, prefix: str = "") -> list[Collective]:
    """Per micro-batch forward/backward and per step optimizer, without the loss's."""
    p = prefix
    if sp:
        out = [
            ("forward", "all_gather", p + "qkv"),
            ("forward", "reduce_scatter", p + "o"),
            ("backward", "all_gather", p + "o"),
            ("backward", "reduce_scatter", p + "qkv"),
            ("optimizer", "all_reduce", p + "norm.weight"),
        ]
    else:
        out = [("forward", "all_reduce", p + "o"), ("backward", "all_reduce", p + "qkv")]
    if cfg.num_kv_heads < world:  # replicated kv heads: one all-reduce of their grads per step
        out.append(("optimizer", "all_reduce", p + "qkv.weight"))
    return out


BLOCK = Block(
    name="attention",
    shards=("heads",),
    dense=lambda cfg, dtype: DenseAttention(cfg, dtype),
    tp=lambda cfg, group, dtype, sp: ParallelAttention(
        cfg, group, sequence_parallel=sp, dtype=dtype
    ),
    plan=attention_plan,
    batch=hidden_batch,
    io=x_io,
    needs=("heads",),
    collectives=lambda cfg, world, sp: attention_parts(cfg, world, sp) + sp_loss(sp),
)
