"""The seed's SwiGLU MLP: pre-RMSNorm -> fused gate/up (column-parallel) -> SwiGLU -> down
(row-parallel) -> residual add."""

from __future__ import annotations

from tpcheck.blocks.base import Block, Collective, hidden_batch, seq_or_rep, sp_loss, x_io
from tpcheck.models.config import ModelConfig
from tpcheck.models.dense import DenseMLP
from tpcheck.models.parallel import ParallelMLP
from tpcheck.plan import Fused, Plan, Replicate, Shard


def gate_up_placement(cfg: ModelConfig):
    return Shard(1) if cfg.gate_up_layout == "stacked" else Fused(0, (cfg.ffn, cfg.ffn))


def mlp_plan(cfg: ModelConfig, sp: bool = False) -> Plan:
    """Weights: gate/up column-parallel, down row-parallel, norm weight and down bias replicated.
    Activations: the SwiGLU output is sharded on the last dim; the norm and down outputs are
    replicated (sequence-sharded under SP)."""
    return Plan(
        params={
            "norm.weight": Replicate(),
            "gate_up.weight": gate_up_placement(cfg),
            "down.weight": Shard(1),
            "down.bias": Replicate(),
        },
        activations={"norm": seq_or_rep(sp), "gate_up": Shard(-1), "down": seq_or_rep(sp)},
    )


def mlp_parts(sp: bool, prefix: str = "") -> list[Collective]:
    """The MLP's own collectives (without the loss's), with sites under `prefix`."""
    if not sp:
        parts = [("forward", "all_reduce", "down"), ("backward", "all_reduce", "gate_up")]
    else:
        parts = [
            ("forward", "all_gather", "gate_up"),
            ("forward", "reduce_scatter", "down"),
            ("backward", "all_gather", "down"),
            ("backward", "reduce_scatter", "gate_up"),
            ("optimizer", "all_reduce", "norm.weight"),
            ("optimizer", "all_reduce", "down.bias"),
        ]
    return [(phase, op, prefix + site) for phase, op, site in parts]


def mlp_collectives(cfg: ModelConfig, world: int, sp: bool) -> list[Collective]:
    return mlp_parts(sp) + sp_loss(sp)


BLOCK = Block(
    name="mlp",
    shards=("ffn",),
    dense=lambda cfg, dtype: DenseMLP(cfg, dtype),
    tp=lambda cfg, group, dtype, sp: ParallelMLP(cfg, group, sequence_parallel=sp, dtype=dtype),
    plan=mlp_plan,
    batch=hidden_batch,
    collectives=mlp_collectives,
    io=x_io,
)
