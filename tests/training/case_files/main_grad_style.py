"""Gradients kept where Megatron keeps them: each parameter gets a float32 `main_grad`, a view of
its segment of one contiguous grad buffer (Megatron's DistributedDataParallel); a hook on each
parameter adds `.grad` into `main_grad` once autograd has accumulated it and frees `.grad`; the
optimizer wrapper hands `main_grad` to float32 masters' `.grad` and steps an inner torch AdamW
(Float16OptimizerWithFloat16Params), then copies the masters back. The TP block is
megatron_style.py's. Each `Case` below is checked by tests/training/test_main_grad.py.

    tpcheck verify tests/training/case_files/main_grad_style.py:main_grad --world-size 2
"""

import torch
from megatron_style import LR, DenseBlock, TPBlock, adamw, load_copy, make_batch

from tpcheck import Case


def attach_grad_buffer(module, skip_hook=(), views=None):
    """Megatron's grad buffer: one float32 buffer (float64 for float64 weights) for every trained
    parameter, each parameter's `main_grad` its segment (or, with `views`, the segment kept in that
    dict by the parameter's `id` instead of on the parameter), and a post-accumulate hook per
    parameter that adds `.grad` into it and frees `.grad`. `skip_hook`: parameter names left
    without the hook (the planted bug). Returns the buffer."""
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    dtype = torch.promote_types(params[0][1].dtype, torch.float32)  # float32 for 16-bit weights
    buffer = torch.zeros(sum(p.numel() for _, p in params), dtype=dtype)
    offset = 0
    for name, p in params:
        view = buffer[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
        if views is None:
            p.main_grad = view
        else:
            views[id(p)] = view
        if name not in skip_hook:
            p.register_post_accumulate_grad_hook(_accumulate_into(view))
    return buffer


def _accumulate_into(view):
    def hook(p):
        view.add_(p.grad)
        p.grad = None

    return hook


class GradBufferTP(TPBlock):
    """The TP block inside a DistributedDataParallel-like wrapper: its grad buffer, and (with
    `zero_buffer`) the wrapper's `zero_grad_buffer()`, which the training loop calls before each
    step."""

    def __init__(self, group, dtype=None, skip_hook=(), zero_buffer=False, views=None):
        super().__init__(group, dtype)
        self.grad_buffer = attach_grad_buffer(self, skip_hook, views)
        if zero_buffer:
            self.zero_grad_buffer = self.grad_buffer.zero_


class MainGradOptimizer:
    """Float32 masters of the module's weights stepped by an inner AdamW on the module's
    `main_grad`, copied back after the step. `zero_main_grad`: its `zero_grad()` also zeroes the
    accumulators (False: the planted bug, or a module that zeroes its own buffer). `grad_at`: where
    a parameter's gradient is (default its `main_grad`)."""

    def __init__(self, model, zero_main_grad=True, grad_at=None):
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        self.master_params = [
            p.detach().clone().float().requires_grad_() for p in self.model_params
        ]
        self.optimizer = torch.optim.AdamW(self.master_params, lr=LR, weight_decay=0.01)
        self.zero_main_grad = zero_main_grad
        self.grad_of = grad_at or (lambda p: p.main_grad)

    def zero_grad(self, set_to_none=True):
        for p in self.model_params:
            p.grad = None
            if self.zero_main_grad:
                self.grad_of(p).zero_()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self):
        for master, p in zip(self.master_params, self.model_params):
            master.grad = self.grad_of(p).float()
        self.optimizer.step()
        with torch.no_grad():
            for master, p in zip(self.master_params, self.model_params):
                p.copy_(master)


# the grad buffer's segments by parameter, where a framework keeps them apart from the parameters
GRAD_VIEWS = {}


def grad_view(p):
    return GRAD_VIEWS.get(id(p))


def _case(name, grad_of=None, build=None, own_optimizer=False, **opt):
    return Case(
        name=name,
        build_dense=lambda dtype: DenseBlock(dtype),
        build_tp=build or (lambda group, dtype: GradBufferTP(group, dtype)),
        plan=None,
        load_tp=lambda tp, sd, group: load_copy(tp, sd, group),
        make_batch=make_batch,
        dense_optimizer=adamw,
        tp_optimizer=None if own_optimizer else (lambda m, g: MainGradOptimizer(m, **opt)),
        grad_of=grad_of,
    )


# found by tpcheck: `.grad` is None after the backward, `main_grad` has the parameter's shape
main_grad = _case("main_grad")
# the planted bug: zero_grad() frees `.grad` but leaves the accumulator; step 2 adds to step 1's
main_grad_not_zeroed = _case("main_grad_not_zeroed", zero_main_grad=False)
# the planted bug: the row-parallel bias has no accumulation hook, its `main_grad` stays zero
main_grad_bias_hook_missing = _case(
    "main_grad_bias_hook_missing",
    build=lambda group, dtype: GradBufferTP(group, dtype, skip_hook=("fc2.bias",)),
)
# Megatron's split: the module's zero_grad_buffer() zeroes the buffer, the optimizer only `.grad`;
# the attribute named in the Case
zeroed_by_module = _case(
    "zeroed_by_module",
    grad_of="main_grad",
    build=lambda group, dtype: GradBufferTP(group, dtype, zero_buffer=True),
    zero_main_grad=False,
)
# the buffer's segments kept beside the parameters: a function tells tpcheck where
grad_views = _case(
    "grad_views",
    grad_of=grad_view,
    build=lambda group, dtype: GradBufferTP(group, dtype, views=GRAD_VIEWS),
    grad_at=grad_view,
)
# no optimizer of the user's: tpcheck's own steps on `main_grad`, and zeroes it between steps
rule_on_main_grad = _case("rule_on_main_grad", own_optimizer=True)
