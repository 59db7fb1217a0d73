"""A DTensor trainer's clipping, as DTensor trainers write it, over the Llama of
examples/dtensor_llama.py parallelized by `parallelize_module` (its sequence-parallel plan):
torch's own `clip_grad_norm_(model.parameters(), max_norm)` over the DTensor parameters (the
norm is reduced over the mesh), the torchtitan way (the total norm of the DTensor gradients made
whole with `full_tensor()`, then `clip_grads_with_norm_`), and a bug: each rank's local
gradients clipped by their own norm (`to_local()` first). The trainer's own optimizer too, as
DTensor trainers build it over `model.parameters()`: torch's fused AdamW, the same with a wrong
weight decay (a bug), and one that groups its parameters by their DTensor placements. Checked by
tests/training/test_dtensor_clipping.py.

    tpcheck verify tests/training/case_files/dtensor_trainer.py:torch_clip --world-size 2
"""

import dataclasses
import sys
from pathlib import Path

import torch

from tpcheck import RunSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import dtensor_llama as L  # noqa: E402

MAX_NORM = 0.05


def torch_clip(model, max_norm, group):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def titan_clip(model, max_norm, group):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total)
    return total


def local_clip(model, max_norm, group):
    """Each rank clips its own shards by their own norm: the DTensors taken apart first."""
    grads = [getattr(p.grad, "to_local", lambda g=p.grad: g)() for p in model.parameters()]
    total = torch.nn.utils.get_total_norm(grads)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def _case(name, clip):
    """The sequence-parallel plan: every parameter a DTensor (the norms under SequenceParallel),
    as torch's clipping needs (a plain tensor beside DTensors makes its foreach norm raise)."""
    case = L._case(name, sp=True)
    return dataclasses.replace(
        case,
        run=RunSettings(steps=2, clip_grad_norm=MAX_NORM),
        tp_clip_grad_norm=clip,
    )


def case_torch_clip(spec):
    return _case("dtensor_torch_clip", torch_clip)


def case_titan_clip(spec):
    return _case("dtensor_titan_clip", titan_clip)


def case_local_clip(spec):
    return _case("dtensor_local_clip", local_clip)


def fused_adamw(model, group):
    """The trainer's optimizer as DTensor trainers build it: torch's fused AdamW over the model's
    parameters (the rule's own hyperparameters: lr 1e-3, torch's defaults otherwise)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def case_torch_clip_fused_adamw(spec):
    """torch's clipping and a fused AdamW of the trainer's own."""
    return dataclasses.replace(
        _case("dtensor_torch_clip_fused_adamw", torch_clip), tp_optimizer=fused_adamw
    )


def case_torch_clip_fused_adamw_decay(spec):
    """Bug: the trainer's fused AdamW with a weight decay of 0.1 against the rule's 0.01."""
    return dataclasses.replace(
        _case("dtensor_fused_adamw_decay", torch_clip),
        tp_optimizer=lambda model, group: torch.optim.AdamW(
            model.parameters(), lr=1e-3, weight_decay=0.1, fused=True
        ),
    )


def decay_by_placement(model, group):
    """A trainer that reads its DTensor parameters' placements: weight decay on the sharded ones
    (the projections), none on the replicated ones (the norms), fused AdamW. On plain local
    shards `p.placements` does not exist."""
    params = list(model.parameters())
    replicated = [p for p in params if all(pl.is_replicate() for pl in p.placements)]
    sharded = [p for p in params if not any(p is q for q in replicated)]
    groups = [
        {"params": sharded, "weight_decay": 0.01},
        {"params": replicated, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-3, fused=True)


def decay_by_ndim(named):
    """The dense rule the same trainer means: decay on the matrices, none on the vectors."""
    params = [p for _, p in named]
    matrices = [p for p in params if p.dim() >= 2]
    vectors = [p for p in params if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": 0.01}, {"params": vectors, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3)


def case_decay_by_placement(spec):
    return dataclasses.replace(
        _case("dtensor_decay_by_placement", torch_clip),
        tp_optimizer=decay_by_placement,
        dense_optimizer=decay_by_ndim,
    )
