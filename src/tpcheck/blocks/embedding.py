"""The vocab-parallel embedding alone: tokens [s, b] -> [s, b, h] (sequence-sharded under SP), MSE
target; checks the masking of ids outside each rank's vocab block."""

from __future__ import annotations

import torch

from tpcheck.blocks.base import Block, Collective, named, sp_loss, x_io
from tpcheck.models.config import ModelConfig
from tpcheck.models.dense import Embedding
from tpcheck.parallel.embedding import VocabParallelEmbedding
from tpcheck.plan import Plan, Shard


def embed_parts(sp: bool) -> list[Collective]:
    if sp:
        return [("forward", "reduce_scatter", "embed"), ("backward", "all_gather", "embed")]
    return [("forward", "all_reduce", "embed")]


def embedding_batch(cfg: ModelConfig):
    def make(g: torch.Generator, dtype: torch.dtype):
        tokens = torch.randint(0, cfg.vocab, (cfg.seq, cfg.batch), generator=g)
        return {"tokens": tokens}, torch.randn(cfg.seq, cfg.batch, cfg.hidden, generator=g).to(
            dtype
        )

    return make


def embedding_io(cfg: ModelConfig, sp: bool) -> dict:
    fields = x_io(cfg, sp)
    fields.pop("input_placements", None)  # tokens stay replicated; the output is sequence-sharded
    return {**fields, "grad_inputs": ()}


BLOCK = Block(
    name="embedding",
    shards=("vocab",),
    dense=lambda cfg, dtype: Embedding(cfg.vocab, cfg.hidden, dtype),
    tp=lambda cfg, group, dtype, sp: named(
        VocabParallelEmbedding(cfg.vocab, cfg.hidden, group, sequence_parallel=sp, dtype=dtype),
        "embed",
    ),
    plan=lambda cfg, sp: Plan(params={"weight": Shard(0)}),
    batch=embedding_batch,
    io=embedding_io,
    collectives=lambda cfg, world, sp: embed_parts(sp) + sp_loss(sp),
    needs=("vocab",),
)
