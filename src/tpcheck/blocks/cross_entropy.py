"""The LM head and vocab-parallel cross-entropy alone: x [s, b, h] -> column-parallel head ->
vocab-sharded logits -> vocab-parallel CE with label smoothing and ignored labels."""

from __future__ import annotations

import torch

from tpcheck.blocks.base import CE_LOSS, Block, Collective, dense_ce, named, token_labels, tp_ce
from tpcheck.models.config import ModelConfig
from tpcheck.models.dense import LMHead
from tpcheck.models.parallel import ParallelLMHead
from tpcheck.plan import Plan, Shard

CE_SMOOTHING = 0.1  # label smoothing over the global vocabulary is part of what is checked


def head_parts(sp: bool) -> list[Collective]:
    if sp:
        return [("forward", "all_gather", "head"), ("backward", "reduce_scatter", "head")]
    return [("backward", "all_reduce", "head")]


def hidden_labels_batch(cfg: ModelConfig):
    def make(g: torch.Generator, dtype: torch.dtype):
        x = torch.randn(cfg.seq, cfg.batch, cfg.hidden, generator=g)
        return {"x": x.to(dtype)}, token_labels(cfg, g)

    return make


def cross_entropy_io(cfg: ModelConfig, sp: bool) -> dict:
    return {
        "loss": dense_ce(CE_SMOOTHING),
        "tp_loss": tp_ce(CE_SMOOTHING),
        "input_placements": {"x": Shard(0)} if sp else {},
        "output_placement": Shard(-1),
    }


BLOCK = Block(
    name="cross_entropy",
    shards=("vocab",),
    dense=lambda cfg, dtype: LMHead(cfg.hidden, cfg.vocab, dtype),
    tp=lambda cfg, group, dtype, sp: named(
        ParallelLMHead(cfg.hidden, cfg.vocab, group, sequence_parallel=sp, dtype=dtype), "head"
    ),
    plan=lambda cfg, sp: Plan(params={"weight": Shard(0)}),
    batch=hidden_labels_batch,
    io=cross_entropy_io,
    collectives=lambda cfg, world, sp: head_parts(sp) + CE_LOSS,
    needs=("vocab",),
)
