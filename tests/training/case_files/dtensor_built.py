"""DTensor TP built the way trainers build it, outside `dtensor_case`: `build_tp` returns
`parallelize_module(model, init_device_mesh("cpu", (world,)), plan)` itself (DTensor parameters),
with `plan=None` and the trainer's own loader (`distribute_tensor` of each full weight onto the
parameter's placements); and `dtensor_case` with a preparation step before `parallelize_module`
(a library's `prepare_*_for_tp` that divides the attention's head count by the ranks, as
HuggingFace-style attention keeps `num_heads` and views with it). Checked by
tests/training/test_dtensor_built.py.

    tpcheck verify tests/training/case_files/dtensor_built.py:built --world-size 2
"""

import torch
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, RunSettings
from tpcheck.adapters.dtensor import dtensor_case

SEQ, BATCH, DIM, HEADS, FFN = 8, 2, 32, 4, 64


class Attention(nn.Module):
    """HuggingFace-style: the head count kept on the module and used to view q, k and v."""

    def __init__(self, dtype=None):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, DIM // HEADS
        self.q_proj = nn.Linear(DIM, DIM, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(DIM, DIM, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(DIM, DIM, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(DIM, DIM, bias=False, dtype=dtype)

    def forward(self, x):  # [b, s, dim]
        b, s, _ = x.shape
        shape = (b, s, self.num_heads, self.head_dim)
        q, k, v = (
            p(x).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class Model(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.norm = nn.LayerNorm(DIM, dtype=dtype)
        self.attn = Attention(dtype)
        self.up = nn.Linear(DIM, FFN, dtype=dtype)
        self.down = nn.Linear(FFN, DIM, dtype=dtype)

    def forward(self, x):
        h = x + self.attn(self.norm(x))
        return h + self.down(F.gelu(self.up(h)))


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
    }


def prepare_for_tp(model, group):
    """Each rank holds num_heads / world of the heads after the column-parallel projections."""
    model.attn.num_heads //= group.world_size


def make_batch(g, dtype):
    x = torch.randn(BATCH, SEQ, DIM, generator=g)
    return {"x": x.to(dtype)}, torch.randn(BATCH, SEQ, DIM, generator=g).to(dtype)


def build(group, dtype, prepare=prepare_for_tp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = Model(dtype)
    if prepare is not None:
        prepare(model, group)
    return parallelize_module(model, init_device_mesh("cpu", (group.world_size,)), tp_plan())


def load(tp, state, group):
    """The trainer's loader: each full weight distributed onto its parameter's placements."""
    from torch.distributed.tensor import distribute_tensor

    for name, p in tp.named_parameters():
        full = state[name].to(p.dtype)
        if hasattr(p, "placements"):
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
        else:
            p.copy_(full)


def _built(name, prepare=prepare_for_tp):
    return Case(
        name=name,
        build_dense=Model,
        build_tp=lambda group, dtype: build(group, dtype, prepare),
        plan=None,
        load_tp=load,
        make_batch=make_batch,
        run=RunSettings(steps=2),
    )


def case_built(spec):
    return _built("dtensor_built")


def case_built_heads_not_divided(spec):
    """The bug: the head count left global and the head width divided instead, so each rank views
    its q/k/v features as HEADS heads of head_dim / world features: the attention is wrong."""

    def keep_heads_narrow(model, group):
        model.attn.head_dim //= group.world_size

    return _built("dtensor_built_heads_not_divided", keep_heads_narrow)


def _prepared(name, prepare):
    return dtensor_case(
        name=name,
        build_dense=Model,
        tp_plan=tp_plan(),
        make_batch=make_batch,
        prepare=prepare,
        run=RunSettings(steps=2),
    )


def case_prepared(spec):
    return _prepared("dtensor_prepared", prepare_for_tp)


def case_prepared_heads_not_divided(spec):
    def keep_heads_narrow(model, group):
        model.attn.head_dim //= group.world_size

    return _prepared("dtensor_prepared_heads_not_divided", keep_heads_narrow)
