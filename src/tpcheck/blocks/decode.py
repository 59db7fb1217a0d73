"""Incremental decoding: the tiny LM with a KV cache in its attention's buffers, as inference code
writes it (Meta's llama, gpt-fast): forward(tokens `[b, s]`, start_pos) -> logits `[b, s, V]`
(vocab-sharded on the TP side). The batch is a prompt of `cfg.batch` different sequences at
start_pos 0; the case decodes `DECODE_STEPS` greedy tokens after it, so it is checked forward only
(checker/rank/forward_only.py): the prefill and every decode pass compared, each step from an empty
cache. Each rank caches its own kv heads. No sequence parallelism: a decode pass feeds one token
per sequence."""

from __future__ import annotations

import torch

from tpcheck.blocks.base import Block, Collective
from tpcheck.blocks.embedding import embed_parts
from tpcheck.blocks.layer import layer_parts
from tpcheck.blocks.lm import lm_plan
from tpcheck.models.config import ModelConfig
from tpcheck.models.dense import DenseDecoder
from tpcheck.models.parallel import ParallelDecoder
from tpcheck.plan import Plan, Replicate, Shard

DECODE_STEPS = 3


def cache_len(cfg: ModelConfig) -> int:
    """The prompt, the decode passes and one position more (a cache is sized for the longest
    sequence it may hold, not exactly for the one decoded)."""
    return cfg.seq + DECODE_STEPS + 1


def decode_plan(cfg: ModelConfig, sp: bool = False) -> Plan:
    """The tiny LM's plan (the same parameter and module names; the caches hold no parameter)."""
    return lm_plan(cfg, sp)


def decode_collectives(cfg: ModelConfig, world: int, sp: bool) -> list[Collective]:
    """Per forward call (the prefill and each decode pass): the embedding's all-reduce, then o's
    and down's in every layer. Nothing is differentiated: no backward or optimizer phase."""
    out = embed_parts(sp)
    for i in range(cfg.layers):
        out += layer_parts(cfg, world, sp, f"layers.{i}.")
    return [c for c in out if c[0] == "forward"]


def prompt_batch(cfg: ModelConfig):
    """tokens `[b, s]` (batch-first: `cfg.batch` different prompts) at start_pos 0; no target."""

    def make(g: torch.Generator, dtype: torch.dtype):
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
        return {"tokens": tokens, "start_pos": torch.tensor(0)}, None

    return make


def decode_io(cfg: ModelConfig, sp: bool) -> dict:
    """tokens and start_pos replicated -> vocab-sharded logits `[b, s, V/tp]`; no loss."""
    return {"output_placement": Shard(-1), "target_placement": Replicate(), "grad_inputs": ()}


BLOCK = Block(
    name="decode",
    shards=("ffn", "heads", "vocab"),
    dense=lambda cfg, dtype: DenseDecoder(cfg, cache_len(cfg), dtype),
    tp=lambda cfg, group, dtype, sp: ParallelDecoder(cfg, group, cache_len(cfg), dtype=dtype),
    plan=decode_plan,
    batch=prompt_batch,
    collectives=decode_collectives,
    io=decode_io,
    needs=("heads", "vocab"),
    decode_steps=DECODE_STEPS,
    sequence_parallel=False,
)
