"""A Megatron-style TP block and the training-step code people write around it, as they write it:
plain torch.distributed, parameters marked `tensor_model_parallel`, their own optimizer wrappers
(float32 masters stepped by an inner AdamW, an AdamW over one flat buffer, a hand-written SGD),
their own gradient clipping, and checkpoint loaders that replace parameters. Each `Case` below is
checked by tests/training/.

    tpcheck verify tests/training/case_files/megatron_style.py:fp32_master --world-size 2
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, RunSettings

HIDDEN, FFN, LR = 16, 32, 1e-3


class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input grad backward."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.pg)
        return grad, None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, pg):
        out = x.clone()
        dist.all_reduce(out, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ColumnParallelLinear(nn.Module):
    def __init__(self, n_in, n_out, rank, world, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out // world, n_in, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(n_out // world, dtype=dtype))
        for p in (self.weight, self.bias):
            p.tensor_model_parallel = True


class RowParallelLinear(nn.Module):
    def __init__(self, n_in, n_out, rank, world, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in // world, dtype=dtype))
        self.weight.tensor_model_parallel = True
        self.bias = nn.Parameter(torch.empty(n_out, dtype=dtype))  # replicated: added after the sum


class TPBlock(nn.Module):
    def __init__(self, group, dtype=None):
        super().__init__()
        self.pg, rank, world = group.pg, group.rank, group.world_size
        self.norm = nn.LayerNorm(HIDDEN, dtype=dtype)
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, rank, world, dtype)
        self.fc2 = RowParallelLinear(FFN, HIDDEN, rank, world, dtype)

    def forward(self, x):
        h = CopyToTP.apply(self.norm(x), self.pg)
        h = F.gelu(F.linear(h, self.fc1.weight, self.fc1.bias))
        out = ReduceFromTP.apply(F.linear(h, self.fc2.weight), self.pg) + self.fc2.bias
        return x + out


class DenseBlock(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN, dtype=dtype)
        self.fc1 = nn.Linear(HIDDEN, FFN, dtype=dtype)
        self.fc2 = nn.Linear(FFN, HIDDEN, dtype=dtype)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def make_batch(g, dtype):
    x = torch.randn(2, 4, HIDDEN, generator=g).to(dtype)
    return {"x": x}, torch.randn(2, 4, HIDDEN, generator=g).to(dtype)


def shards(sd, rank, world, dtype):
    """The loader's slicing of the full state dict for this rank, in the model's dtype."""
    full = {
        "norm.weight": sd["norm.weight"],
        "norm.bias": sd["norm.bias"],
        "fc1.weight": sd["fc1.weight"].chunk(world, dim=0)[rank],
        "fc1.bias": sd["fc1.bias"].chunk(world, dim=0)[rank],
        "fc2.weight": sd["fc2.weight"].chunk(world, dim=1)[rank],
        "fc2.bias": sd["fc2.bias"],
    }
    return {k: v.to(dtype) for k, v in full.items()}


# ------------------------------------------------------------------ optimizers people write


class MixedPrecisionOptimizer:
    """Float32 master copies of the model's weights, stepped by an inner AdamW, the results copied
    back into the model (Megatron's Float16OptimizerWithFloat16Params, apex's FP16_Optimizer)."""

    def __init__(self, model, lr=LR, skip_copy_back=None):
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        self.master_params = [
            p.detach().clone().float().requires_grad_() for p in self.model_params
        ]
        self.optimizer = torch.optim.AdamW(self.master_params, lr=lr, weight_decay=0.01)
        self.skip_copy_back = skip_copy_back  # the planted bug: one weight never gets its master

    def zero_grad(self, set_to_none=True):
        for p in self.model_params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self):
        for master, p in zip(self.master_params, self.model_params):
            master.grad = None if p.grad is None else p.grad.detach().float()
        self.optimizer.step()
        with torch.no_grad():
            for i, (master, p) in enumerate(zip(self.master_params, self.model_params)):
                if i != self.skip_copy_back:
                    p.copy_(master)


class FlatAdamW:
    """AdamW over one flat float32 buffer holding every weight (a contiguous-buffer optimizer)."""

    def __init__(self, model, lr=LR, grads_reversed=False):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.flat = nn.Parameter(torch.cat([p.detach().float().reshape(-1) for p in self.params]))
        self.optimizer = torch.optim.AdamW([self.flat], lr=lr, weight_decay=0.01)
        self.grads_reversed = grads_reversed  # the planted bug: grads packed in another order

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        # the planted bug packs the grads in the reverse order of the weights
        order = self.params[::-1] if self.grads_reversed else self.params
        self.flat.grad = torch.cat([p.grad.float().reshape(-1) for p in order])
        self.optimizer.step()
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


class HandWrittenSGD:
    """A plain SGD that is no torch optimizer: nothing tpcheck can find its state through."""

    def __init__(self, model, lr=0.05):
        self.params, self.lr = list(model.parameters()), lr

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.lr)


def adamw(named):
    return torch.optim.AdamW(named, lr=LR, weight_decay=0.01)


# ------------------------------------------------------------------ clipping people write


def clip_megatron(model, max_norm, group):
    """Correct: tensor-parallel parameters' squares summed over the ranks, the others once."""
    tp_sq = torch.zeros(())
    dup_sq = torch.zeros(())
    for p in model.parameters():
        if p.grad is None:
            continue
        if getattr(p, "tensor_model_parallel", False):
            tp_sq = tp_sq + p.grad.float().pow(2).sum()
        else:
            dup_sq = dup_sq + p.grad.float().pow(2).sum()
    dist.all_reduce(tp_sq, group=group.pg)
    total = (tp_sq + dup_sq).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(coef)
    return total


def clip_local_norm(model, max_norm, group):
    """Bug: torch's clip on the local shards: every rank clips by its own partial norm."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def clip_all_summed(model, max_norm, group):
    """Bug: every parameter's square summed over the ranks, replicated ones world times."""
    sq = sum(p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None)
    dist.all_reduce(sq, group=group.pg)
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(coef)
    return total


def clip_sharded_only(model, max_norm, group):
    """Bug: the right total norm, but only the tensor-parallel parameters' gradients are scaled
    (the replicated ones, the norm's weight and bias and the row-parallel bias, step unclipped)."""
    total = _megatron_norm(model, group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None and getattr(p, "tensor_model_parallel", False):
            p.grad.mul_(coef)
    return total


def clip_fp32_buffer(model, max_norm, group, replicated_twice=False):
    """Correct: Megatron's `get_grad_norm_fp32` as it runs off the GPU: squared norms summed into
    float32 buffers (its accumulation dtype, whatever the gradients'), the tensor-parallel ones
    all-reduced, the total read out with `.item()`, the gradients scaled by a Python float.
    `replicated_twice` (bug): the replicated parameters' buffer all-reduced too, so each counts
    once per rank."""
    tp_sq = torch.zeros(1, dtype=torch.float)
    dup_sq = torch.zeros(1, dtype=torch.float)
    for p in model.parameters():
        if p.grad is not None:
            sq = torch.norm(p.grad.float(), 2.0) ** 2
            if getattr(p, "tensor_model_parallel", False):
                tp_sq += sq
            else:
                dup_sq += sq
    dist.all_reduce(tp_sq, group=group.pg)
    if replicated_twice:
        dist.all_reduce(dup_sq, group=group.pg)
    total = (tp_sq + dup_sq).item() ** 0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return total


def _megatron_norm(model, group):
    tp_sq, dup_sq = torch.zeros(()), torch.zeros(())
    for p in model.parameters():
        if p.grad is None:
            continue
        if getattr(p, "tensor_model_parallel", False):
            tp_sq = tp_sq + p.grad.float().pow(2).sum()
        else:
            dup_sq = dup_sq + p.grad.float().pow(2).sum()
    dist.all_reduce(tp_sq, group=group.pg)
    return (tp_sq + dup_sq).sqrt()


# ------------------------------------------------------------------ loaders that replace parameters


def load_assign(tp, sd, group):
    """`load_state_dict(..., assign=True)`: the module gets the loaded tensors as new parameters."""
    tp.load_state_dict(shards(sd, group.rank, group.world_size, tp.norm.weight.dtype), assign=True)


def load_copy(tp, sd, group):
    """`load_state_dict` into the module's own parameters (their attributes kept)."""
    tp.load_state_dict(shards(sd, group.rank, group.world_size, tp.norm.weight.dtype))


def build_on_meta(group, dtype):
    with torch.device("meta"):
        return TPBlock(group, dtype)


def load_meta(tp, sd, group):
    """Meta-device init, then `to_empty` and a load (torchtitan's and accelerate's way)."""
    tp.to_empty(device="cpu")
    tp.load_state_dict(shards(sd, group.rank, group.world_size, tp.norm.weight.dtype))


def load_new_parameters(tp, sd, group):
    """Assign a fresh `nn.Parameter` per tensor (a hand-written checkpoint converter)."""
    for name, t in shards(sd, group.rank, group.world_size, tp.norm.weight.dtype).items():
        owner, attr = name.rsplit(".", 1)
        setattr(tp.get_submodule(owner), attr, nn.Parameter(t.clone()))


def _case(name, **kw):
    kw.setdefault("build_tp", lambda group, dtype: TPBlock(group, dtype))
    kw.setdefault("load_tp", lambda tp, sd, group: load_assign(tp, sd, group))
    return Case(
        name=name,
        build_dense=lambda dtype: DenseBlock(dtype),
        plan=None,
        make_batch=make_batch,
        **kw,
    )


fp32_master = _case(
    "fp32_master", tp_optimizer=lambda m, g: MixedPrecisionOptimizer(m), dense_optimizer=adamw
)
fp32_master_copy_back_skipped = _case(
    "fp32_master_copy_back_skipped",
    tp_optimizer=lambda m, g: MixedPrecisionOptimizer(m, skip_copy_back=3),
    dense_optimizer=adamw,
)
flat_buffer = _case("flat_buffer", tp_optimizer=lambda m, g: FlatAdamW(m), dense_optimizer=adamw)
flat_buffer_grads_misplaced = _case(
    "flat_buffer_grads_misplaced",
    tp_optimizer=lambda m, g: FlatAdamW(m, grads_reversed=True),
    dense_optimizer=adamw,
)


# a trainer's own torch AdamW over the TP module, in the implementation it picked (fused kernels,
# foreach), stepping the module's weights directly (16-bit ones too); the dense rule (`adamw`) is
# the plain one. Its shards are copied into the module's contiguous parameters (`load_copy`)
def _own_adamw(name, weight_decay=0.01, load=load_copy, **kw):
    return _case(
        name,
        tp_optimizer=lambda m, g: torch.optim.AdamW(
            m.parameters(), lr=LR, weight_decay=weight_decay, **kw
        ),
        dense_optimizer=adamw,
        load_tp=lambda tp, sd, group: load(tp, sd, group),
    )


fused_adamw = _own_adamw("fused_adamw", fused=True)
foreach_adamw = _own_adamw("foreach_adamw", foreach=True)
fused_adamw_wrong_decay = _own_adamw("fused_adamw_wrong_decay", weight_decay=0.1, fused=True)
# the shards assigned as views of the dense weights (`load_assign`): fc2's column shard is not
# contiguous, and torch 2.13's fused CPU AdamW steps a non-contiguous parameter (or gradient)
# wrongly (docs/findings/torch-fused-adamw-strided.md)
fused_adamw_strided_shards = _own_adamw("fused_adamw_strided_shards", load=load_assign, fused=True)
hand_written_sgd = _case(
    "hand_written_sgd",
    tp_optimizer=lambda m, g: HandWrittenSGD(m),
    run=RunSettings(optimizer="sgd", lr=0.05),
)
hand_written_sgd_wrong_lr = _case(
    "hand_written_sgd_wrong_lr",
    tp_optimizer=lambda m, g: HandWrittenSGD(m, lr=0.04),
    run=RunSettings(optimizer="sgd", lr=0.05),
)


def _clip_case(name, clip=None):
    # `assign=True` would drop the `tensor_model_parallel` marks the clipping reads
    return _case(
        name,
        run=RunSettings(clip_grad_norm=0.05),
        tp_clip_grad_norm=clip,
        load_tp=lambda tp, sd, group: load_copy(tp, sd, group),
    )


clip_default = _clip_case("clip_default")
clip_correct = _clip_case("clip_correct", clip_megatron)
clip_local = _clip_case("clip_local", clip_local_norm)
clip_replicated_twice = _clip_case("clip_replicated_twice", clip_all_summed)
clip_sharded_gradients_only = _clip_case("clip_sharded_gradients_only", clip_sharded_only)
clip_fp32_norm = _clip_case("clip_fp32_norm", clip_fp32_buffer)
clip_fp32_norm_replicated_twice = _clip_case(
    "clip_fp32_norm_replicated_twice",
    lambda model, max_norm, group: clip_fp32_buffer(model, max_norm, group, True),
)

assign_loader = _case("assign_loader")
meta_loader = _case(
    "meta_loader", build_tp=build_on_meta, load_tp=lambda tp, sd, group: load_meta(tp, sd, group)
)
new_parameter_loader = _case(
    "new_parameter_loader", load_tp=lambda tp, sd, group: load_new_parameters(tp, sd, group)
)


# ------------------------------------------------------------------ mistakes the messages name


class FrozenBiasTP(TPBlock):
    """fc1's bias frozen on the TP side only (a fine-tuning script that freezes biases)."""

    def __init__(self, group, dtype=None):
        super().__init__(group, dtype)
        self.fc1.bias.requires_grad_(False)


class DetachedTP(TPBlock):
    """The TP forward hands back a detached output (a `.detach()` left from a debugging print)."""

    def forward(self, x):
        return super().forward(x).detach()


frozen_bias = _case("frozen_bias", build_tp=lambda group, dtype: FrozenBiasTP(group, dtype))
detached_output = _case("detached_output", build_tp=lambda group, dtype: DetachedTP(group, dtype))

# state kept in a module global, as parallel-state initializers do (Megatron's parallel_state)
_PARALLEL_STATE = {}


def initialize_model_parallel(group):
    _PARALLEL_STATE["tp_size"] = group.world_size


class GlobalStateTP(TPBlock):
    def __init__(self, group, dtype=None):
        if _PARALLEL_STATE.get("tp_size") != group.world_size:
            raise RuntimeError("model parallel is not initialized")
        super().__init__(group, dtype)


with_setup = _case(
    "with_setup",
    build_tp=lambda group, dtype: GlobalStateTP(group, dtype),
    setup=initialize_model_parallel,
)


class Rotary(nn.Module):
    """Rotary factors as complex numbers (Meta's llama `freqs_cis`): an output with no bound."""

    def forward(self, x):
        angles = torch.arange(x.shape[-1] // 2, dtype=torch.float32) * 0.1
        return torch.polar(torch.ones_like(angles), angles)


class RotaryDense(DenseBlock):
    def __init__(self, dtype=None):
        super().__init__(dtype)
        self.rotary = Rotary()

    def forward(self, x):
        return super().forward(x) + 0.0 * self.rotary(x).real.sum()


class RotaryTP(TPBlock):
    def __init__(self, group, dtype=None):
        super().__init__(group, dtype)
        self.rotary = Rotary()

    def forward(self, x):
        return super().forward(x) + 0.0 * self.rotary(x).real.sum()


complex_module_output = Case(
    name="complex_module_output",
    build_dense=lambda dtype: RotaryDense(dtype),
    build_tp=lambda group, dtype: RotaryTP(group, dtype),
    plan=None,
    load_tp=lambda tp, sd, group: load_copy(tp, sd, group),
    make_batch=make_batch,
)


class FrozenWeightsTP(TPBlock):
    """Inference-style TP layers: the sliced weights built frozen (`requires_grad=False`), the norm
    and the biases trained (a partly frozen fine-tune)."""

    def __init__(self, group, dtype=None):
        super().__init__(group, dtype)
        self.fc1.weight.requires_grad_(False)
        self.fc2.weight.requires_grad_(False)


frozen_weights = _case(
    "frozen_weights",
    build_tp=lambda group, dtype: FrozenWeightsTP(group, dtype),
    load_tp=lambda tp, sd, group: load_copy(tp, sd, group),
)


class FrozenWeightsBiasTwiceTP(FrozenWeightsTP):
    """The same, with fc2's bias added on every rank before the all-reduce (counted world times)."""

    def forward(self, x):
        h = CopyToTP.apply(self.norm(x), self.pg)
        h = F.gelu(F.linear(h, self.fc1.weight, self.fc1.bias))
        return x + ReduceFromTP.apply(F.linear(h, self.fc2.weight, self.fc2.bias), self.pg)


class FrozenBiasOnRank0TP(TPBlock):
    """fc1's bias frozen on rank 0 only (a freezing loop that ran on one rank)."""

    def __init__(self, group, dtype=None):
        super().__init__(group, dtype)
        if group.rank == 0:
            self.fc1.bias.requires_grad_(False)


frozen_weights_bias_twice = _case(
    "frozen_weights_bias_twice",
    build_tp=lambda group, dtype: FrozenWeightsBiasTwiceTP(group, dtype),
    load_tp=lambda tp, sd, group: load_copy(tp, sd, group),
)
frozen_on_rank0 = _case(
    "frozen_on_rank0", build_tp=lambda group, dtype: FrozenBiasOnRank0TP(group, dtype)
)
