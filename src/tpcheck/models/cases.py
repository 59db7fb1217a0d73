"""Checker cases for the built-in blocks: one function per block, from a CaseSpec and a config."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from tpcheck.check.case import Case, CaseSpec
from tpcheck.errors import UsageError
from tpcheck.models.config import ModelConfig, preset
from tpcheck.models.dense import DenseMLP
from tpcheck.models.parallel import ParallelMLP
from tpcheck.parallel.collectives import reduce_from_tp_region
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Fused, Plan, Replicate, Shard


def sp_mse_loss(out_local: torch.Tensor, target_local: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """MSE over the whole sequence when each rank holds a sequence shard: local sum / global count,
    summed over ranks (forward all-reduce, backward identity)."""
    sq = (out_local - target_local).pow(2).sum() / (out_local.numel() * group.world_size)
    return reduce_from_tp_region(sq, group, "loss")


def hidden_batch(cfg: ModelConfig):
    """x and an MSE target, both [s, b, h], drawn in the seed's order."""

    def make(g: torch.Generator, dtype: torch.dtype):
        x = torch.randn(cfg.seq, cfg.batch, cfg.hidden, generator=g)
        target = torch.randn(cfg.seq, cfg.batch, cfg.hidden, generator=g)
        return {"x": x.to(dtype)}, target.to(dtype)

    return make


def sequence_parallel_fields(sp: bool) -> dict:
    if not sp:
        return {}
    return {"input_placements": {"x": Shard(0)}, "output_placement": Shard(0), "target_placement": Shard(0),
            "tp_loss": sp_mse_loss}


def gate_up_placement(cfg: ModelConfig):
    return Shard(1) if cfg.gate_up_layout == "stacked" else Fused(0, (cfg.ffn, cfg.ffn))


def mlp_plan(cfg: ModelConfig, sp: bool = False) -> Plan:
    """Weights: gate/up column-parallel, down row-parallel, norm weight and down bias replicated.
    Activations: the SwiGLU output is sharded on the last dim; the norm and down outputs are replicated
    (sequence-sharded under SP)."""
    seq_or_rep = Shard(0) if sp else Replicate()
    return Plan(params={
        "norm.weight": Replicate(),
        "gate_up.weight": gate_up_placement(cfg),
        "down.weight": Shard(1),
        "down.bias": Replicate(),
    }, activations={"norm": seq_or_rep, "gate_up": Shard(-1), "down": seq_or_rep})


def mlp_case(spec: CaseSpec, cfg: ModelConfig) -> Case:
    sp = spec.sequence_parallel
    return Case(
        name=spec.name,
        build_dense=lambda dtype: DenseMLP(cfg, dtype),
        build_tp=lambda group, dtype: ParallelMLP(cfg, group, sequence_parallel=sp, dtype=dtype),
        plan=mlp_plan(cfg, sp),
        make_batch=hidden_batch(cfg),
        **sequence_parallel_fields(sp),
        **common_fields(spec),
    )


def common_fields(spec: CaseSpec) -> dict:
    lr = spec.lr if spec.lr is not None else (0.05 if spec.optimizer == "sgd" else 1e-3)
    return {"seed": spec.seed, "steps": spec.steps, "micro_batches": spec.micro_batches,
            "optimizer": spec.optimizer, "lr": lr, "dtype": spec.dtype, "capture": spec.capture}


def mlp_collectives(sp: bool, cfg: ModelConfig | None = None, world: int = 2) -> list[tuple[str, str, str]]:
    """(phase, op, site) the MLP issues per micro-batch (forward, backward) and per step (optimizer)."""
    if not sp:
        return [("forward", "all_reduce", "down"), ("backward", "all_reduce", "gate_up")]
    return [("forward", "all_gather", "gate_up"), ("forward", "reduce_scatter", "down"),
            ("forward", "all_reduce", "loss"),
            ("backward", "all_gather", "down"), ("backward", "reduce_scatter", "gate_up"),
            ("optimizer", "all_reduce", "norm.weight"), ("optimizer", "all_reduce", "down.bias")]


BLOCKS: dict[str, Callable[[CaseSpec, ModelConfig], Case]] = {"mlp": mlp_case}
# block -> fn(sp, cfg=None, world=2) -> [(phase, op, site)]; cfg and world matter where the list
# depends on them (kv heads replicated when kv_heads < world).
COLLECTIVES: dict[str, Callable[..., list[tuple[str, str, str]]]] = {"mlp": mlp_collectives}


def config_for(spec: CaseSpec) -> ModelConfig:
    cfg = preset(spec.preset)
    if spec.overrides:
        try:
            cfg = cfg.replace(**dict(spec.overrides))
        except TypeError as e:
            raise UsageError(f"bad config override {dict(spec.overrides)}: {e}") from None
    cfg.check_world_size(spec.world_size, sequence_parallel=spec.sequence_parallel)
    return cfg


def builtin_case(spec: CaseSpec) -> Case:
    try:
        make = BLOCKS[spec.block]
    except KeyError:
        raise UsageError(f"unknown block {spec.block!r}; choose one of {sorted(BLOCKS)}") from None
    case = make(spec, config_for(spec))
    if case.expected_collectives is None and spec.block in COLLECTIVES:
        case = dataclasses.replace(case, expected_collectives=tuple(COLLECTIVES[spec.block](spec.sequence_parallel)))
    return case


# The transformer blocks (attention, layer, lm, embedding, cross_entropy) register themselves into
# BLOCKS and COLLECTIVES; a plain `import` so that either module may be imported first.
import tpcheck.models.transformer_cases  # noqa: E402, F401
