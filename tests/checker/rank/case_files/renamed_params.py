"""TP modules whose parameter names are not the dense ones, with no plan written: wrappers add
segments (a DDP-like `module.` at the root, torch's real checkpoint_wrapper's
`_checkpoint_wrapped_module.` around each layer), or the TP code names its layers its own way
(`ln_1`, `up_proj`, `down_proj`, `ln_f` for the dense `norm`, `fc1`, `fc2`, `out_norm`).

Cases:
  - `checkpointed`: every layer of the TP block in `checkpoint_wrapper` (activation recomputation:
    the row-parallel all-reduce runs again in backward), the block in a DDP-like wrapper;
  - `renamed`: the layers renamed, no tp_names: matched by values (the printed plan says so);
  - `renamed_mapping` / `renamed_function`: the same with `Case(tp_names=...)`, a dict and a
    function of the dense name;
  - `ambiguous`: renamed, and the two norms initialised alike (weights ones, biases zeros, as
    LayerNorm's own reset does): their values cannot tell them apart -- refused, naming them;
    `ambiguous_named` gives tp_names for the norms and is equivalent.
Planted bug: `renamed_bias_twice` adds the row-parallel bias before the all-reduce on every rank
(caught at the forward output, with the names matched by values).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tpcheck import Case

HIDDEN, FFN = 16, 32
RENAMES = {"norm": "ln_1", "fc1": "up_proj", "fc2": "down_proj", "out_norm": "ln_f"}


class Dense(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN, dtype=dtype)
        self.fc1 = nn.Linear(HIDDEN, FFN, dtype=dtype)
        self.fc2 = nn.Linear(FFN, HIDDEN, dtype=dtype)
        self.out_norm = nn.LayerNorm(HIDDEN, dtype=dtype)

    def forward(self, x):
        return self.out_norm(x + self.fc2(F.gelu(self.fc1(self.norm(x)))))


class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.pg)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce; backward: identity."""

    @staticmethod
    def forward(ctx, x, pg):
        x = x.clone()
        dist.all_reduce(x, group=pg)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, pg, dtype=None):
        super().__init__()
        world = dist.get_world_size(group=pg)
        self.pg = pg
        self.weight = nn.Parameter(torch.empty(out_features // world, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features // world, dtype=dtype))

    def forward(self, x):
        return F.linear(_CopyToTP.apply(x, self.pg), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, pg, dtype=None, bias_before_reduce=False):
        super().__init__()
        world = dist.get_world_size(group=pg)
        self.pg, self.before = pg, bias_before_reduce
        self.weight = nn.Parameter(torch.empty(out_features, in_features // world, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype))

    def forward(self, x_local):
        if self.before:  # the bug: every rank's partial sum carries the bias
            return _ReduceFromTP.apply(F.linear(x_local, self.weight, self.bias), self.pg)
        return _ReduceFromTP.apply(F.linear(x_local, self.weight), self.pg) + self.bias


class TPBlock(nn.Module):
    """The dense block's layers, TP, under the names `names` gives them."""

    def __init__(self, group, dtype=None, names=None, wrap=lambda m: m, bias_before_reduce=False):
        super().__init__()
        self.names = names or {k: k for k in RENAMES}
        layers = {
            "norm": nn.LayerNorm(HIDDEN, dtype=dtype),
            "fc1": ColumnParallelLinear(HIDDEN, FFN, group.pg, dtype),
            "fc2": RowParallelLinear(FFN, HIDDEN, group.pg, dtype, bias_before_reduce),
            "out_norm": nn.LayerNorm(HIDDEN, dtype=dtype),
        }
        for dense_name, layer in layers.items():
            setattr(self, self.names[dense_name], wrap(layer))

    def layer(self, dense_name):
        return getattr(self, self.names[dense_name])

    def forward(self, x):
        h = self.layer("fc2")(F.gelu(self.layer("fc1")(self.layer("norm")(x))))
        return self.layer("out_norm")(x + h)


class DataParallelLike(nn.Module):
    """A data-parallel wrapper: the model under `module` (as DDP holds it)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def loader(names):
    """A checkpoint loader that knows its own layer names: this rank's slices."""

    def load_tp(tp, state, group):
        block = tp.module if isinstance(tp, DataParallelLike) else tp
        rank, world = group.rank, group.world_size
        for dense_name in ("norm", "out_norm"):
            for p in ("weight", "bias"):
                getattr(block.layer(dense_name), p).copy_(state[f"{dense_name}.{p}"])
        fc1, fc2 = block.layer("fc1"), block.layer("fc2")
        fc1.weight.copy_(state["fc1.weight"].chunk(world, dim=0)[rank])
        fc1.bias.copy_(state["fc1.bias"].chunk(world, dim=0)[rank])
        fc2.weight.copy_(state["fc2.weight"].chunk(world, dim=1)[rank])
        fc2.bias.copy_(state["fc2.bias"])

    return load_tp


def make_batch(g, dtype):
    x = torch.randn(4, 2, HIDDEN, generator=g).to(dtype)  # [s, b, h]
    return {"x": x}, torch.randn(4, 2, HIDDEN, generator=g).to(dtype)


def norms_alike(module, g):
    """Linear layers drawn from `g`, LayerNorms as their own reset leaves them (ones, zeros)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith(("fc1", "fc2")):
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            else:
                p.fill_(1.0 if name.endswith("weight") else 0.0)


def _case(name, build_tp, names=None, **fields):
    return Case(
        name=name,
        build_dense=Dense,
        build_tp=build_tp,
        plan=None,
        make_batch=make_batch,
        load_tp=loader(names),
        **fields,
    )


checkpointed = _case(
    "checkpointed",
    lambda group, dtype: DataParallelLike(TPBlock(group, dtype, wrap=checkpoint_wrapper)),
)
renamed = _case("renamed", lambda group, dtype: TPBlock(group, dtype, RENAMES), RENAMES)
renamed_mapping = _case(
    "renamed_mapping",
    lambda group, dtype: TPBlock(group, dtype, RENAMES),
    RENAMES,
    tp_names={f"{d}.{p}": f"{t}.{p}" for d, t in RENAMES.items() for p in ("weight", "bias")},
)


def tp_name(dense_name):
    """The TP name of a dense parameter: its layer renamed."""
    layer, param = dense_name.split(".")
    return f"{RENAMES[layer]}.{param}"


renamed_function = _case(
    "renamed_function",
    lambda group, dtype: TPBlock(group, dtype, RENAMES),
    RENAMES,
    tp_names=tp_name,
)
ambiguous = _case(
    "ambiguous", lambda group, dtype: TPBlock(group, dtype, RENAMES), RENAMES, init=norms_alike
)
ambiguous_named = _case(
    "ambiguous_named",
    lambda group, dtype: TPBlock(group, dtype, RENAMES),
    RENAMES,
    init=norms_alike,
    tp_names={"norm.weight": "ln_1.weight", "norm.bias": "ln_1.bias"},
)
renamed_bias_twice = _case(
    "renamed_bias_twice",
    lambda group, dtype: TPBlock(group, dtype, RENAMES, bias_before_reduce=True),
    RENAMES,
)
