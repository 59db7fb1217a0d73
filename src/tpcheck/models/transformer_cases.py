"""Checker cases for the transformer blocks: attention, layer, lm (the tiny LM), embedding and
cross_entropy. Registered into `cases.BLOCKS` / `cases.COLLECTIVES` on import (cases.py imports this
module at its end).

These cases set `expected_collectives` themselves: the list depends on the config and world size
(kv heads replicated when kv_heads < world add one optimizer all-reduce per attention).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tpcheck.check.case import Case, CaseSpec
from tpcheck.errors import UsageError
from tpcheck.models.cases import (
    BLOCKS,
    COLLECTIVES,
    common_fields,
    hidden_batch,
    mlp_collectives,
    mlp_plan,
    sequence_parallel_fields,
)
from tpcheck.models.config import ModelConfig
from tpcheck.models.dense import DenseAttention, DenseLayer, DenseLM, Embedding, LMHead
from tpcheck.models.parallel import ParallelAttention, ParallelLayer, ParallelLM, ParallelLMHead
from tpcheck.parallel.cross_entropy import vocab_parallel_cross_entropy
from tpcheck.parallel.embedding import VocabParallelEmbedding
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Fused, Plan, Replicate, Shard

IGNORE_INDEX = -100
CE_SMOOTHING = 0.1  # the cross_entropy block checks label smoothing over the global vocabulary


def _require(spec: CaseSpec, cfg: ModelConfig, *, heads: bool = False, vocab: bool = False) -> None:
    if heads and not cfg.heads:
        raise UsageError(f"block {spec.block!r} needs attention heads; preset {spec.preset!r} has heads=0: "
                         "use preset 'tiny' or override heads")
    if vocab and not cfg.vocab:
        raise UsageError(f"block {spec.block!r} needs a vocabulary; preset {spec.preset!r} has vocab=0: "
                         "use preset 'tiny' or override vocab")


def _prefixed(prefix: str, placements: dict) -> dict:
    return {prefix + name: p for name, p in placements.items()}


def attention_plan(cfg: ModelConfig, sp: bool = False) -> Plan:
    """qkv: rank r holds [q_r; k_r; v_r] (`Fused` by heads; kv heads replicated when kv < tp);
    o row-parallel; norm replicated. Activations: norm and o outputs replicated (sequence-sharded
    under SP)."""
    d, seq_or_rep = cfg.head_dim, (Shard(0) if sp else Replicate())
    return Plan(params={
        "norm.weight": Replicate(),
        "qkv.weight": Fused(0, (cfg.heads, cfg.num_kv_heads, cfg.num_kv_heads), (d, d, d)),
        "o.weight": Shard(1),
    }, activations={"norm": seq_or_rep, "o": seq_or_rep})


def layer_plan(cfg: ModelConfig, sp: bool = False, prefix: str = "") -> Plan:
    att, mlp = attention_plan(cfg, sp), mlp_plan(cfg, sp)
    seq_or_rep = Shard(0) if sp else Replicate()
    return Plan(params={**_prefixed(prefix + "attention.", att.params), **_prefixed(prefix + "mlp.", mlp.params)},
                activations={**_prefixed(prefix + "attention.", att.activations),
                             **_prefixed(prefix + "mlp.", mlp.activations),
                             prefix + "attention": seq_or_rep, prefix + "mlp": seq_or_rep})


def lm_plan(cfg: ModelConfig, sp: bool = False) -> Plan:
    """Embedding and head vocab-sharded (`Shard(0)`, the same rows; one tensor when tied).
    Activations: embedding, every module of every layer, final norm and head outputs."""
    seq_or_rep = Shard(0) if sp else Replicate()
    params, acts = {"embed.weight": Shard(0)}, {"embed": seq_or_rep, "norm": seq_or_rep}
    for i in range(cfg.layers):
        layer = layer_plan(cfg, sp, prefix=f"layers.{i}.")
        params.update(layer.params)
        acts.update(layer.activations)
        acts[f"layers.{i}"] = seq_or_rep
    params["norm.weight"] = Replicate()
    if not cfg.tie_embeddings:
        params["head.weight"] = Shard(0)
        acts["head"] = Shard(-1)
    return Plan(params=params, activations=acts)


def attention_collectives(sp: bool, cfg: ModelConfig | None = None, world: int = 2,
                          prefix: str = "") -> list[tuple[str, str, str]]:
    """Per micro-batch forward/backward and per step optimizer, without the loss's."""
    p = prefix
    if sp:
        out = [("forward", "all_gather", p + "qkv"), ("forward", "reduce_scatter", p + "o"),
               ("backward", "all_gather", p + "o"), ("backward", "reduce_scatter", p + "qkv"),
               ("optimizer", "all_reduce", p + "norm.weight")]
    else:
        out = [("forward", "all_reduce", p + "o"), ("backward", "all_reduce", p + "qkv")]
    if cfg is not None and cfg.num_kv_heads < world:  # replicated kv heads: one all-reduce of their grads
        out.append(("optimizer", "all_reduce", p + "qkv.weight"))
    return out


def _mlp_parts(sp: bool, prefix: str) -> list[tuple[str, str, str]]:
    return [(ph, op, prefix + site) for ph, op, site in mlp_collectives(sp) if site != "loss"]


def layer_parts(sp: bool, cfg: ModelConfig | None, world: int, prefix: str = "") -> list[tuple[str, str, str]]:
    return attention_collectives(sp, cfg, world, prefix + "attention.") + _mlp_parts(sp, prefix + "mlp.")


def _sp_loss(sp: bool) -> list[tuple[str, str, str]]:
    return [("forward", "all_reduce", "loss")] if sp else []


CE_LOSS = [("forward", "all_gather", "loss.max"), ("forward", "all_reduce", "loss.sum")]


def _head_parts(sp: bool) -> list[tuple[str, str, str]]:
    if sp:
        return [("forward", "all_gather", "head"), ("backward", "reduce_scatter", "head")]
    return [("backward", "all_reduce", "head")]


def _embed_parts(sp: bool) -> list[tuple[str, str, str]]:
    if sp:
        return [("forward", "reduce_scatter", "embed"), ("backward", "all_gather", "embed")]
    return [("forward", "all_reduce", "embed")]


def lm_collectives(sp: bool, cfg: ModelConfig | None = None, world: int = 2) -> list[tuple[str, str, str]]:
    layers = cfg.layers if cfg is not None else 1
    out = _embed_parts(sp)
    for i in range(layers):
        out += layer_parts(sp, cfg, world, f"layers.{i}.")
    out += [("optimizer", "all_reduce", "norm.weight")] if sp else []
    return out + _head_parts(sp) + CE_LOSS


def _x_case(spec: CaseSpec, cfg: ModelConfig, dense, tp, plan: Plan, collectives) -> Case:
    """A block fed x [s, b, h] with an MSE target (sequence-sharded under SP)."""
    sp = spec.sequence_parallel
    return Case(name=spec.name, build_dense=dense, build_tp=tp, plan=plan, make_batch=hidden_batch(cfg),
                expected_collectives=tuple(collectives), **sequence_parallel_fields(sp), **common_fields(spec))


def attention_case(spec: CaseSpec, cfg: ModelConfig) -> Case:
    _require(spec, cfg, heads=True)
    sp, w = spec.sequence_parallel, spec.world_size
    return _x_case(spec, cfg, lambda dtype: DenseAttention(cfg, dtype),
                   lambda group, dtype: ParallelAttention(cfg, group, sequence_parallel=sp, dtype=dtype),
                   attention_plan(cfg, sp), attention_collectives(sp, cfg, w) + _sp_loss(sp))


def layer_case(spec: CaseSpec, cfg: ModelConfig) -> Case:
    _require(spec, cfg, heads=True)
    sp, w = spec.sequence_parallel, spec.world_size
    return _x_case(spec, cfg, lambda dtype: DenseLayer(cfg, dtype),
                   lambda group, dtype: ParallelLayer(cfg, group, sequence_parallel=sp, dtype=dtype),
                   layer_plan(cfg, sp), layer_parts(sp, cfg, w) + _sp_loss(sp))


def token_labels(cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    """Random labels [s, b] in the global vocabulary, every 5th one `IGNORE_INDEX`."""
    labels = torch.randint(0, cfg.vocab, (cfg.seq, cfg.batch), generator=g)
    labels.view(-1)[::5] = IGNORE_INDEX
    return labels


def dense_ce(smoothing: float):
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, label_smoothing=smoothing)
    return loss


def tp_ce(smoothing: float):
    def loss(logits_local: torch.Tensor, labels: torch.Tensor, group: TPGroup) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_local, labels, group, ignore_index=IGNORE_INDEX,
                                            label_smoothing=smoothing, site="loss")
    return loss


def lm_case(spec: CaseSpec, cfg: ModelConfig) -> Case:
    """tokens [s, b] (replicated, also under SP) -> vocab-sharded logits [s, b, V/tp]; vocab-parallel CE."""
    _require(spec, cfg, heads=True, vocab=True)
    sp = spec.sequence_parallel

    def make_batch(g: torch.Generator, dtype: torch.dtype):
        tokens = torch.randint(0, cfg.vocab, (cfg.seq, cfg.batch), generator=g)
        return {"tokens": tokens}, token_labels(cfg, g)

    return Case(name=spec.name, build_dense=lambda dtype: DenseLM(cfg, dtype),
                build_tp=lambda group, dtype: ParallelLM(cfg, group, sequence_parallel=sp, dtype=dtype),
                plan=lm_plan(cfg, sp), make_batch=make_batch, loss=dense_ce(0.0), tp_loss=tp_ce(0.0),
                output_placement=Shard(-1), target_placement=Replicate(), grad_inputs=(),
                expected_collectives=tuple(lm_collectives(sp, cfg, spec.world_size)), **common_fields(spec))


def _named(module, site: str):
    module.site = site
    return module


def embedding_case(spec: CaseSpec, cfg: ModelConfig) -> Case:
    """tokens [s, b] -> [s, b, h] (sequence-sharded under SP), MSE target; checks masking of ids
    outside each rank's vocab block."""
    _require(spec, cfg, vocab=True)
    sp = spec.sequence_parallel

    def make_batch(g: torch.Generator, dtype: torch.dtype):
        tokens = torch.randint(0, cfg.vocab, (cfg.seq, cfg.batch), generator=g)
        return {"tokens": tokens}, torch.randn(cfg.seq, cfg.batch, cfg.hidden, generator=g).to(dtype)

    fields = sequence_parallel_fields(sp)
    fields.pop("input_placements", None)  # tokens stay replicated; the output is sequence-sharded
    return Case(name=spec.name, build_dense=lambda dtype: Embedding(cfg.vocab, cfg.hidden, dtype),
                build_tp=lambda group, dtype: _named(VocabParallelEmbedding(
                    cfg.vocab, cfg.hidden, group, sequence_parallel=sp, dtype=dtype), "embed"),
                plan=Plan(params={"weight": Shard(0)}), make_batch=make_batch, grad_inputs=(),
                expected_collectives=tuple(_embed_parts(sp) + _sp_loss(sp)), **fields, **common_fields(spec))


def cross_entropy_case(spec: CaseSpec, cfg: ModelConfig) -> Case:
    """x [s, b, h] -> column-parallel head -> vocab-sharded logits -> vocab-parallel CE with label
    smoothing and ignored labels."""
    _require(spec, cfg, vocab=True)
    sp = spec.sequence_parallel

    def make_batch(g: torch.Generator, dtype: torch.dtype):
        x = torch.randn(cfg.seq, cfg.batch, cfg.hidden, generator=g)
        return {"x": x.to(dtype)}, token_labels(cfg, g)

    return Case(name=spec.name, build_dense=lambda dtype: LMHead(cfg.hidden, cfg.vocab, dtype),
                build_tp=lambda group, dtype: _named(ParallelLMHead(
                    cfg.hidden, cfg.vocab, group, sequence_parallel=sp, dtype=dtype), "head"),
                plan=Plan(params={"weight": Shard(0)}), make_batch=make_batch,
                loss=dense_ce(CE_SMOOTHING), tp_loss=tp_ce(CE_SMOOTHING),
                input_placements={"x": Shard(0)} if sp else {}, output_placement=Shard(-1),
                expected_collectives=tuple(_head_parts(sp) + CE_LOSS), **common_fields(spec))


BLOCKS.update({"attention": attention_case, "layer": layer_case, "lm": lm_case, "embedding": embedding_case,
               "cross_entropy": cross_entropy_case})
COLLECTIVES.update({
    "attention": lambda sp, cfg=None, world=2: attention_collectives(sp, cfg, world) + _sp_loss(sp),
    "layer": lambda sp, cfg=None, world=2: layer_parts(sp, cfg, world) + _sp_loss(sp),
    "lm": lm_collectives,
    "embedding": lambda sp, cfg=None, world=2: _embed_parts(sp) + _sp_loss(sp),
    "cross_entropy": lambda sp, cfg=None, world=2: _head_parts(sp) + CE_LOSS,
})
