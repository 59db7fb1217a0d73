"""A case whose TP forward spins on rank 1 asking torch.distributed a query (`dist.get_rank`, no
collective) while rank 0 waits in an all-reduce: rank 1 is computing, the culprit."""

import torch
import torch.distributed as dist
from torch import nn

from tpcheck import Case, Plan, Replicate


class Dense(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.fc = nn.Linear(8, 8, dtype=dtype)

    def forward(self, x):
        return self.fc(x)


class TP(Dense):
    def __init__(self, group, dtype=None):
        super().__init__(dtype)
        self.rank, self.pg = group.rank, group.pg

    def forward(self, x):
        if self.rank == 1:
            while dist.get_rank(self.pg) >= 0:  # QUERY SPIN
                pass
        dist.all_reduce(torch.ones(3), group=self.pg)
        return self.fc(x)


def init(module, g):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def make_batch(g, dtype):
    return {"x": torch.randn(4, 8, generator=g).to(dtype)}, torch.randn(4, 8, generator=g).to(dtype)


query_spin = Case(
    name="query_spin",
    build_dense=Dense,
    build_tp=lambda group, dtype: TP(group, dtype),
    plan=Plan(params={"fc.weight": Replicate(), "fc.bias": Replicate()}),
    make_batch=make_batch,
    init=init,
)
