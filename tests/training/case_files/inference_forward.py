"""Inference code checked where it trains: a TP module whose forward runs under
`@torch.inference_mode()` (as inference engines decorate it) while its parameters still require
grad, so its output carries no graph. tpcheck runs it forward only and says why, instead of refusing
it; a dense forward without a graph is still refused (nothing to hold the TP side to).

    tpcheck verify tests/training/case_files/inference_forward.py:correct --world-size 2
"""

import torch
import torch.distributed as dist
from torch import nn

from tpcheck import Case, Plan, Shard


class Dense(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False, dtype=dtype)
        self.down = nn.Linear(16, 8, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class TP(nn.Module):
    """Column- then row-parallel, the all-reduce in the forward (`bug`: left out)."""

    def __init__(self, group, dtype=None, bug=False):
        super().__init__()
        self.pg, self.bug = group.pg, bug
        self.up = nn.Linear(8, 16 // group.world_size, bias=False, dtype=dtype)
        self.down = nn.Linear(16 // group.world_size, 8, bias=False, dtype=dtype)

    @torch.inference_mode()
    def forward(self, x):
        out = self.down(torch.relu(self.up(x)))
        if not self.bug:
            dist.all_reduce(out, group=self.pg)
        return out


PLAN = Plan(params={"up.weight": Shard(0), "down.weight": Shard(1)})


def make_batch(g, dtype):
    return {"x": torch.randn(2, 3, 8, generator=g).to(dtype)}, torch.randn(2, 3, 8, generator=g).to(
        dtype
    )


class DenseInInferenceMode(Dense):
    @torch.inference_mode()
    def forward(self, x):
        return super().forward(x)


def _case(name, dense=Dense, bug=False):
    return Case(
        name=name,
        build_dense=dense,
        build_tp=lambda group, dtype: TP(group, dtype, bug),
        plan=PLAN,
        make_batch=make_batch,
    )


correct = _case("inference_mode_forward")
missing_reduce = _case("inference_mode_forward_missing_reduce", bug=True)
dense_without_graph = _case("dense_inference_mode_forward", dense=DenseInInferenceMode)
