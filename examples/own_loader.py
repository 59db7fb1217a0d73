"""Your TP module loads its own weights: tpcheck checks what your loader put there.

    tpcheck verify examples/own_loader.py --world-size 2 4  # every case in the file
    tpcheck verify examples/own_loader.py:correct           # equivalent
    tpcheck verify examples/own_loader.py:bias_on_rank0     # equivalent: the TGI / nano-vllm layout

The block is the one of own_module.py (fc1 column-parallel, fc2 row-parallel). With `load_tp`,
tpcheck does not fill the TP module from the plan: it hands your loader the dense state dict (full
float32 tensors), checks the loaded weights bitwise against the plan's shards, and names your loader
when they differ. The plan still says how the weights relate (it is what the loader
is checked against).

`bias_on_rank0`: fc2's bias is held on every rank but added on rank 0 only, before the all-reduce
(instead of on every rank after it). Its placement is `AppliedOnRank(0)`: weights replicated, the
gradient and the optimizer's update on rank 0 only. `bias_on_rank1`: the same on rank 1
(`AppliedOnRank(1)`); `bias_on_rank1_no_plan`: no plan written, `AppliedOnRank(1)` inferred from
where the gradient appears.

Planted bug in the rank that applies the bias: `bias_grad_doubled_on_rank1` (its gradient doubled by
a hook on rank 1: "not equivalent" at `grad:fc2.bias`, rank 1).

Planted loader bugs (each is "not equivalent" at the weights stage, step 0, naming `load_tp`):
  - `every_rank_loads_shard_0`: the rank offset is forgotten (signature `rank0_shard`);
  - `bias_broadcast_to_rank0_only`: the replicated bias is loaded on rank 0 only
    (`replicas_differ`);
  - `no_plan_shard0`: the rank offset forgotten with no plan written: each parameter's placement
    is inferred as the shard it is, and the weights stage fails it as with a written plan
    (`rank0_shard`; `--print-plan` lists it under "loaded wrong").
"""

import os
import sys

import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from own_module import PLAN, CopyToTP, DenseBlock, ReduceFromTP, TPBlock, init, make_batch  # noqa: E402
from tpcheck import AppliedOnRank, Case, Plan  # noqa: E402


def loader(bug=None):
    """A checkpoint loader: slices the dense state dict for this rank."""

    def load_tp(tp, state_dict, group):
        rank, world = group.rank, group.world_size
        src = 0 if bug == "shard0" else rank
        tp.fc1.weight.copy_(state_dict["fc1.weight"].chunk(world, dim=0)[src])
        tp.fc1.bias.copy_(state_dict["fc1.bias"].chunk(world, dim=0)[src])
        tp.fc2.weight.copy_(state_dict["fc2.weight"].chunk(world, dim=1)[src])
        if bug == "bias_rank0" and rank != 0:
            return  # the bias stays as the module built it
        tp.fc2.bias.copy_(state_dict["fc2.bias"])

    return load_tp


class BiasOnRank(TPBlock):
    """fc2's bias enters the partial sum of rank `owner` only; the all-reduce then adds it once."""

    def __init__(self, group, dtype=None, owner=0, grad_scale=1.0):
        super().__init__(group, dtype)
        self.rank, self.owner = group.rank, owner
        # the planted bug: a wrong gradient on that rank
        if grad_scale != 1.0 and self.rank == owner:
            self.fc2.bias.register_hook(lambda g: g * grad_scale)

    def forward(self, x):
        x_tp = CopyToTP.apply(x, self.pg) if self.pg is not None else x
        h_local = F.gelu(self.fc1(x_tp))
        partial = F.linear(
            h_local, self.fc2.weight, self.fc2.bias if self.rank == self.owner else None
        )
        return x + (ReduceFromTP.apply(partial, self.pg) if self.pg is not None else partial)


def _case(name, load_tp, build_tp=TPBlock, plan=PLAN):
    return Case(
        name=name,
        build_dense=DenseBlock,
        build_tp=lambda group, dtype: build_tp(group, dtype),
        plan=plan,
        make_batch=make_batch,
        init=init,
        load_tp=load_tp,
    )


correct = _case("own_loader", loader())
bias_on_rank0 = _case(
    "own_loader_bias_on_rank0",
    loader(),
    BiasOnRank,
    Plan(params={**PLAN.params, "fc2.bias": AppliedOnRank(0)}),
)
bias_on_rank1 = _case(
    "own_loader_bias_on_rank1",
    loader(),
    lambda group, dtype: BiasOnRank(group, dtype, owner=1),
    Plan(params={**PLAN.params, "fc2.bias": AppliedOnRank(1)}),
)
bias_on_rank1_no_plan = _case(
    "own_loader_bias_on_rank1_no_plan",
    loader(),
    lambda group, dtype: BiasOnRank(group, dtype, owner=1),
    None,
)
bias_grad_doubled_on_rank1 = _case(
    "own_loader_bias_grad_doubled_on_rank1",
    loader(),
    lambda group, dtype: BiasOnRank(group, dtype, owner=1, grad_scale=2.0),
    Plan(params={**PLAN.params, "fc2.bias": AppliedOnRank(1)}),
)
every_rank_loads_shard_0 = _case("own_loader_shard0", loader("shard0"))
bias_broadcast_to_rank0_only = _case("own_loader_bias_rank0_only", loader("bias_rank0"))

# No plan written: inferred from what the loader puts
# on each rank (`--print-plan` prints it as code).
no_plan = Case(
    name="own_loader_no_plan",
    build_dense=DenseBlock,
    build_tp=lambda group, dtype: TPBlock(group, dtype),
    plan=None,
    make_batch=make_batch,
    init=init,
    load_tp=loader(),
)
no_plan_shard0 = Case(
    name="own_loader_no_plan_shard0",
    build_dense=DenseBlock,
    build_tp=lambda group, dtype: TPBlock(group, dtype),
    plan=None,
    make_batch=make_batch,
    init=init,
    load_tp=loader("shard0"),
)
