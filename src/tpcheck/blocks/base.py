"""What a built-in block declares, and how a Case is made from it.

A `Block` is data: how to build the dense module and its TP twin from a `ModelConfig`, the plan that
maps one to the other, the batch, the inputs/outputs placements and losses, and the collectives the
TP twin must issue. `Block.case(spec, cfg)` assembles the checker's `Case`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpcheck.checker.case import Case, CaseSpec
from tpcheck.errors import UsageError
from tpcheck.models.config import SHARDED, ModelConfig, preset
from tpcheck.parallel.cross_entropy import vocab_parallel_cross_entropy
from tpcheck.parallel.group import TPGroup
from tpcheck.parallel.losses import sp_mse_loss
from tpcheck.plan import Placement, Plan, Replicate, Shard

Collective = tuple[str, str, str]  # (phase, op, site)
IGNORE_INDEX = -100


@dataclass(frozen=True, kw_only=True)
class Block:
    """dense(cfg, dtype) and tp(cfg, group, dtype, sp) build the twins; plan(cfg, sp) relates them;
    batch(cfg) -> make_batch(generator, dtype); io(cfg, sp) -> the Case's loss / placement fields;
    collectives(cfg, world, sp) -> (phase, op, site) per micro-batch (forward, backward) and per
    step (optimizer); needs: config fields the block cannot do without ("heads", "vocab");
    shards: the config dimensions its TP twin splits over the ranks (of models/config.py's
    `SHARDED`), the only ones a world size must divide;
    decode_steps: the Case's decode passes (a block that decodes is checked forward only);
    sequence_parallel: False for a block that cannot run under sequence parallelism."""

    name: str
    dense: Callable[[ModelConfig, torch.dtype], nn.Module]
    tp: Callable[[ModelConfig, TPGroup, torch.dtype, bool], nn.Module]
    plan: Callable[[ModelConfig, bool], Plan]
    batch: Callable[[ModelConfig], Callable]
    collectives: Callable[[ModelConfig, int, bool], list[Collective]]
    io: Callable[[ModelConfig, bool], dict]
    needs: tuple[str, ...] = ()
    shards: tuple[str, ...] = SHARDED
    decode_steps: int = 0
    sequence_parallel: bool = True

    def check_config(self, cfg: ModelConfig, spec: CaseSpec) -> None:
        if spec.sequence_parallel and not self.sequence_parallel:
            raise UsageError(
                f"block {self.name!r} does not run under sequence parallelism (a decode pass "
                "feeds one token per sequence, which does not split over ranks): drop --sp"
            )
        for field in self.needs:
            if not getattr(cfg, field):
                raise UsageError(
                    f"block {self.name!r} needs {field}; preset {spec.preset!r} has {field}=0: "
                    f"use preset 'tiny' or override {field}"
                )

    def case(self, spec: CaseSpec, cfg: ModelConfig) -> Case:
        self.check_config(cfg, spec)
        sp = spec.sequence_parallel
        return Case(
            name=spec.name,
            build_dense=lambda dtype: self.dense(cfg, dtype),
            build_tp=lambda group, dtype: self.tp(cfg, group, dtype, sp),
            plan=self.plan(cfg, sp),
            make_batch=self.batch(cfg),
            expected_collectives=tuple(self.collectives(cfg, spec.world_size, sp)),
            decode_steps=self.decode_steps,
            run=spec.settings,
            **self.io(cfg, sp),
        )


def config_for(spec: CaseSpec, shards: tuple[str, ...] = SHARDED) -> ModelConfig:
    """The preset's config with the spec's overrides, checked against the world size on the
    dimensions in `shards` (a block's own: `Block.shards`)."""
    cfg = preset(spec.preset)
    if spec.overrides:
        try:
            cfg = cfg.replace(**dict(spec.overrides))
        except TypeError as e:
            raise UsageError(f"bad config override {dict(spec.overrides)}: {e}") from None
    cfg.check_world_size(spec.world_size, sequence_parallel=spec.sequence_parallel, dims=shards)
    return cfg


# ---------------------------------------------------------------------------- shared pieces


def seq_or_rep(sp: bool) -> Placement:
    """Replicated activations become sequence-sharded under sequence parallelism."""
    return Shard(0) if sp else Replicate()


def prefixed(prefix: str, placements: dict) -> dict:
    return {prefix + name: p for name, p in placements.items()}


def hidden_batch(cfg: ModelConfig):
    """x and an MSE target, both [s, b, h], drawn in the seed's order; `cfg.outlier`, where set, in
    one element of x and the same of the target (the middle token of the last sequence, a third
    into the hidden dim): the outlier rides the residual stream, and the loss is not its square."""

    def make(g: torch.Generator, dtype: torch.dtype):
        x = torch.randn(cfg.seq, cfg.batch, cfg.hidden, generator=g)
        target = torch.randn(cfg.seq, cfg.batch, cfg.hidden, generator=g)
        if cfg.outlier:  # in the target too: a residual stream carries it, the loss does not
            x[cfg.seq // 2, cfg.batch - 1, cfg.hidden // 3] = cfg.outlier
            target[cfg.seq // 2, cfg.batch - 1, cfg.hidden // 3] = cfg.outlier
        return {"x": x.to(dtype)}, target.to(dtype)

    return make


def x_io(cfg: ModelConfig, sp: bool) -> dict:
    """A block fed x [s, b, h] with an MSE target: everything sequence-sharded under SP."""
    if not sp:
        return {}
    return {
        "input_placements": {"x": Shard(0)},
        "output_placement": Shard(0),
        "target_placement": Shard(0),
        "tp_loss": sp_mse_loss,
    }


def sp_loss(sp: bool) -> list[Collective]:
    """The SP MSE loss's all-reduce (sp_mse_loss)."""
    return [("forward", "all_reduce", "loss")] if sp else []


def token_labels(cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    """Random labels [s, b] in the global vocabulary, every 5th one `IGNORE_INDEX`."""
    labels = torch.randint(0, cfg.vocab, (cfg.seq, cfg.batch), generator=g)
    labels.view(-1)[::5] = IGNORE_INDEX
    return labels


def dense_ce(smoothing: float):
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            label_smoothing=smoothing,
        )

    return loss


def tp_ce(smoothing: float):
    def loss(logits_local: torch.Tensor, labels: torch.Tensor, group: TPGroup) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            logits_local,
            labels,
            group,
            ignore_index=IGNORE_INDEX,
            label_smoothing=smoothing,
            site="loss",
        )

    return loss


CE_LOSS: list[Collective] = [
    ("forward", "all_gather", "loss.max"),
    ("forward", "all_reduce", "loss.sum"),
]


def named(module: nn.Module, site: str) -> nn.Module:
    """Give a bare parallel layer the collective site name its case expects."""
    module.site = site
    return module
