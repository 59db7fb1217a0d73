"""A DTensor trainer's clipping, as DTensor trainers write it, over the Llama of
examples/dtensor_llama.py parallelized by `parallelize_module` (its sequence-parallel plan):
torch's own `clip_grad_norm_(model.parameters(), max_norm)` over the DTensor parameters (the
norm is reduced over the mesh), the torchtitan way (the total norm of the DTensor gradients made
whole with `full_tensor()`, then `clip_grads_with_norm_`), and a bug: each rank's local
gradients clipped by their own norm (`to_local()` first). Checked by
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
