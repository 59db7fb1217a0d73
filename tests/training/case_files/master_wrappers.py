"""Float32 master weights kept apart from a 16-bit TP model, as training scripts keep them: a
wrapper whose inner AdamW steps float32 copies in two parameter groups (weight decay on the
matrices only, the no-decay group of biases and norms: nanoGPT's and the HF Trainer's split), and a
hand-written AdamW whose masters and moments live in a dict. Two residual blocks, Megatron-style
column- and row-parallel linears on plain torch.distributed; the norms start at ones and zeros as
`nn.LayerNorm` makes them, so several parameters hold the same values when the optimizer is built.

    tpcheck verify tests/training/case_files/master_wrappers.py:grouped_masters --world-size 2
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case

HIDDEN, FFN, LR, DECAY = 16, 32, 1e-3, 0.1


class _Copy(torch.autograd.Function):
    """Identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.pg)
        return grad, None


class _Reduce(torch.autograd.Function):
    """All-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, pg):
        out = x.clone()
        dist.all_reduce(out, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Block(nn.Module):
    """Dense at world 1 (`pg` None); otherwise fc1 column-parallel, fc2 row-parallel (its bias
    replicated, added after the sum), the norm replicated."""

    def __init__(self, world=1, pg=None, dtype=None):
        super().__init__()
        self.pg = pg
        self.norm = nn.LayerNorm(HIDDEN, dtype=dtype)
        self.fc1 = nn.Linear(HIDDEN, FFN // world, dtype=dtype)
        self.fc2 = nn.Linear(FFN // world, HIDDEN, bias=False, dtype=dtype)
        self.fc2_bias = nn.Parameter(torch.zeros(HIDDEN, dtype=dtype))

    def forward(self, x):
        h = self.norm(x)
        if self.pg is not None:
            h = _Copy.apply(h, self.pg)
        out = self.fc2(F.gelu(self.fc1(h)))
        if self.pg is not None:
            out = _Reduce.apply(out, self.pg)
        return x + out + self.fc2_bias


class Net(nn.Module):
    def __init__(self, world=1, pg=None, dtype=None):
        super().__init__()
        self.blocks = nn.ModuleList(Block(world, pg, dtype) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def make_batch(g, dtype):
    x = torch.randn(2, 4, HIDDEN, generator=g).to(dtype)
    return {"x": x}, torch.randn(2, 4, HIDDEN, generator=g).to(dtype)


def load(tp, sd, group):
    """Each rank's slice of the dense state dict, copied into the TP model."""
    rank, world = group.rank, group.world_size
    with torch.no_grad():
        for name, p in tp.named_parameters():
            full = sd[name]
            if name.endswith("fc1.weight") or name.endswith("fc1.bias"):
                full = full.chunk(world, dim=0)[rank]
            elif name.endswith("fc2.weight"):
                full = full.chunk(world, dim=1)[rank]
            p.copy_(full)


def decay_groups(named, decay=DECAY):
    """Weight decay on the matrices, none on the biases and the norms, each in a group of its own
    (as trainers split them to give each its own settings): the groups list the parameters in
    another order than the model's."""
    named = list(named)
    norms = [(n, p) for n, p in named if ".norm." in n]
    return [
        {"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": decay},
        {"params": [(n, p) for n, p in named if p.dim() < 2 and ".norm." not in n]},
        {"params": norms},
    ]


def dense_adamw(named):
    return torch.optim.AdamW(decay_groups(named), lr=LR, weight_decay=0.0)


class GroupedMasters:
    """Float32 masters of the model's weights, stepped by an inner AdamW in two parameter groups
    (decay first, then no decay: not the model's order) and copied back into the model."""

    def __init__(self, model, decay=DECAY):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = decay_groups(named, decay)
        self.pairs = []  # (model parameter, its master), in the inner optimizer's order
        inner = []
        for group in groups:
            masters = []
            for _, p in group["params"]:
                master = p.detach().clone().float().requires_grad_()
                self.pairs.append((p, master))
                masters.append(master)
            inner.append({"params": masters, "weight_decay": group.get("weight_decay", 0.0)})
        self.optimizer = torch.optim.AdamW(inner, lr=LR)

    def zero_grad(self, set_to_none=True):
        for p, master in self.pairs:
            p.grad = master.grad = None

    def step(self):
        for p, master in self.pairs:
            master.grad = None if p.grad is None else p.grad.detach().float()
        self.optimizer.step()
        with torch.no_grad():
            for p, master in self.pairs:
                p.copy_(master)


class DictAdamW:
    """A hand-written AdamW (torch's formula) with float32 masters and moments in a dict by
    parameter name: no torch optimizer anywhere."""

    def __init__(self, model, decay=DECAY, betas=(0.9, 0.999), eps=1e-8):
        self.model, self.decay, self.betas, self.eps, self.t = model, decay, betas, eps, 0
        self.state = {
            n: {
                "master": p.detach().clone().float(),
                "exp_avg": torch.zeros_like(p, dtype=torch.float32),
                "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32),
            }
            for n, p in model.named_parameters()
            if p.requires_grad
        }

    def zero_grad(self, set_to_none=True):
        for p in self.model.parameters():
            p.grad = None

    @torch.no_grad()
    def step(self):
        self.t += 1
        b1, b2 = self.betas
        for n, p in self.model.named_parameters():
            if n not in self.state or p.grad is None:
                continue
            s, g = self.state[n], p.grad.float()
            decay = self.decay if p.dim() >= 2 else 0.0
            s["master"].mul_(1 - LR * decay)
            s["exp_avg"].lerp_(g, 1 - b1)
            s["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (s["exp_avg_sq"].sqrt() / math.sqrt(1 - b2**self.t)).add_(self.eps)
            s["master"].addcdiv_(s["exp_avg"], denom, value=-LR / (1 - b1**self.t))
            p.copy_(s["master"])


def torch_init(model, g):
    """The model's own initialisation (torch's): norms at ones and zeros, the replicated bias at
    zeros, the linears drawn from `g`."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm." in name or name.endswith("_bias"):
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def _case(name, tp_optimizer):
    return Case(
        name=name,
        init=torch_init,
        build_dense=lambda dtype: Net(dtype=dtype),
        build_tp=lambda group, dtype: Net(group.world_size, group.pg, dtype),
        load_tp=load,
        plan=None,
        make_batch=make_batch,
        tp_optimizer=tp_optimizer,
        dense_optimizer=dense_adamw,
    )


grouped_masters = _case("grouped_masters", lambda m, g: GroupedMasters(m))
# the bug: weight decay on every parameter in the TP wrapper, the norms' and biases' too
grouped_masters_decay_everywhere = _case(
    "grouped_masters_decay_everywhere", lambda m, g: _DecayEverywhere(m)
)
dict_adamw = _case("dict_adamw", lambda m, g: DictAdamW(m))
# the bug: the TP side's weight decay 10 times the rule's
dict_adamw_wrong_decay = _case("dict_adamw_wrong_decay", lambda m, g: DictAdamW(m, decay=1.0))


class _DecayEverywhere(GroupedMasters):
    def __init__(self, model):
        super().__init__(model)
        for group in self.optimizer.param_groups:
            group["weight_decay"] = DECAY
