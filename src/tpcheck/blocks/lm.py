"""The tiny LM: vocab-parallel embedding -> layers -> final norm -> LM head (vocab-sharded logits)
-> vocab-parallel cross-entropy. Tokens are replicated, also under SP."""

from __future__ import annotations

import torch

from tpcheck.blocks.base import (
    CE_LOSS,
    Block,
    Collective,
    dense_ce,
    seq_or_rep,
    token_labels,
    tp_ce,
)
from tpcheck.blocks.cross_entropy import head_parts
from tpcheck.blocks.embedding import embed_parts
from tpcheck.blocks.layer import layer_parts, layer_plan
from tpcheck.models.config import ModelConfig
from tpcheck.models.dense import DenseLM
from tpcheck.models.parallel import ParallelLM
from tpcheck.plan import Plan, Replicate, Shard


def lm_plan(cfg: ModelConfig, sp: bool = False) -> Plan:
    """Embedding and head vocab-sharded (`Shard(0)`, the same rows; one tensor when tied).
    Activations: embedding, every module of every layer, final norm and head outputs."""
    params, acts = {"embed.weight": Shard(0)}, {"embed": seq_or_rep(sp), "norm": seq_or_rep(sp)}
    for i in range(cfg.layers):
        layer = layer_plan(cfg, sp, prefix=f"layers.{i}.")
        params.update(layer.params)
        acts.update(layer.activations)
        acts[f"layers.{i}"] = seq_or_rep(sp)
    params["norm.weight"] = Replicate()
    if not cfg.tie_embeddings:
        params["head.weight"] = Shard(0)
        acts["head"] = Shard(-1)
    return Plan(params=params, activations=acts)


def lm_collectives(cfg: ModelConfig, world: int, sp: bool) -> list[Collective]:
    out = embed_parts(sp)
    for i in range(cfg.layers):
        out += layer_parts(cfg, world, sp, f"layers.{i}.")
    out += [("optimizer", "all_reduce", "norm.weight")] if sp else []
    return out + head_parts(sp) + CE_LOSS


def token_batch(cfg: ModelConfig):
    def make(g: torch.Generator, dtype: torch.dtype):
        tokens = torch.randint(0, cfg.vocab, (cfg.seq, cfg.batch), generator=g)
        return {"tokens": tokens}, token_labels(cfg, g)

    return make


def lm_io(cfg: ModelConfig, sp: bool) -> dict:
    """tokens [s, b] (replicated) -> vocab-sharded logits [s, b, V/tp]; vocab-parallel CE."""
    return {
        "loss": dense_ce(0.0),
        "tp_loss": tp_ce(0.0),
        "output_placement": Shard(-1),
        "target_placement": Replicate(),
        "grad_inputs": (),
    }


BLOCK = Block(
    name="lm",
    shards=("ffn", "heads", "vocab"),
    dense=lambda cfg, dtype: DenseLM(cfg, dtype),
    tp=lambda cfg, group, dtype, sp: ParallelLM(cfg, group, sequence_parallel=sp, dtype=dtype),
    plan=lm_plan,
    batch=token_batch,
    collectives=lm_collectives,
    io=lm_io,
    needs=("heads", "vocab"),
)
