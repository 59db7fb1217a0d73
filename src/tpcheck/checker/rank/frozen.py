"""Parameters the TP side keeps frozen. Inference-style TP layers and partly frozen fine-tuning
build their sliced weights with `requires_grad=False` while the dense twin (a plain `nn.Linear`)
trains them. Where a parameter is frozen on every rank of the TP side and trains on the dense
side, the dense side and the float64 truth freeze it too before the optimizers are built: it is
checked as loaded and through every forward it takes part in, never stepped, and the report says
so; the parameters that train on both sides are checked as ever. Frozen on some ranks only is
left to the grads stage, which refuses it naming the rank (params.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tpcheck.checker.rank import torch_collectives

if TYPE_CHECKING:
    from tpcheck.checker.rank.sides import Sides


def follow_tp(s: Sides) -> list[str]:
    """Freeze on the dense side (and the truth) what every TP rank froze; the report's notes. The
    ranks agree in one checker all-reduce (the least, over the ranks, of "frozen here")."""
    tp = dict(s.tp.named_parameters())
    names = [name for name, _ in s.dense.named_parameters()]
    dense = dict(s.dense.named_parameters())
    here = torch.tensor(
        [
            float(
                dense[n].requires_grad
                and (t := tp.get(s.plan.tp_name(n))) is not None
                and not t.requires_grad
            )
            for n in names
        ],
        dtype=torch.float64,
    )
    if s.group.world_size > 1:
        s.tap.performing(
            ("all_reduce", "checker:frozen", "optimizer"),
            torch_collectives.all_reduce,
            here,
            op=dist.ReduceOp.MIN,
            group=s.group.pg,
        )
    frozen = [n for n, flag in zip(names, here.tolist()) if flag]
    for model in (s.dense, s.truth):
        if model is not None:
            params = dict(model.named_parameters())
            for name in frozen:
                params[name].requires_grad_(False)
    if not frozen:
        return []
    listed = ", ".join(frozen[:6]) + (", ..." if len(frozen) > 6 else "")
    return [
        f"training of {len(frozen)} parameter(s) the TP side keeps frozen (requires_grad=False): "
        f"{listed}; the dense side froze them too (checked as loaded and in the forward)"
    ]
