"""Parallel styles tpcheck ships for transformers' plans, registered in transformers'
`ALL_PARALLEL_STYLES` under tpcheck-named keys when this module is imported (by
`tpcheck.adapters.transformers.common`, before any rank forks: the ranks and the parent know the
same styles). A plan rule names one like any of transformers' own:

    tpcheck hf qwen3 --rule 'model.layers.*.self_attn.q_norm=tpcheck_reduce_grad_on_arrival'

`tpcheck_reduce_grad_on_arrival` is the fix of transformers' `replicated_with_grad_allreduce` under
gradient accumulation (docs/findings/hf-replicated-grad-allreduce-accumulation.md): a replicated
parameter whose gradient is a partial sum gets each micro-batch's gradient all-reduced as it
arrives (a tensor hook, `param.register_hook`), before autograd accumulates it into `.grad`;
transformers' style all-reduces the accumulated `.grad` after every backward (a post-accumulate
hook), counting the earlier micro-batches world-size times.

`tpcheck_rowwise_any_input` is transformers' `rowwise` for a module whose plan key matches modules
fed two ways: this rank's slice of the input features (after a `colwise` projection), or the whole
input (after projections no rule shards: GLM-5 Next's linear-attention layers, whose `o_proj`
shares the key `layers.*.self_attn.o_proj` with the MLA layers'). A whole input, the module's full
`in_features` wide, is split here (`rowwise_split_input`'s input layout); a slice goes through as
`rowwise` (docs/findings/hf-glm5-next-o-proj.md). A transformers plan cannot give one layer its
own rule (keys are matched with the layer numbers as `*`), so the style tells them apart.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from transformers.distributed.tensor_parallel import (
    ALL_PARALLEL_STYLES,
    RowwiseParallel,
    TensorParallelLayer,
)

REDUCE_GRAD_ON_ARRIVAL = "tpcheck_reduce_grad_on_arrival"
ROWWISE_ANY_INPUT = "tpcheck_rowwise_any_input"
# the styles tpcheck registers (the repair tries them beside transformers' own)
TPCHECK_STYLES = (REDUCE_GRAD_ON_ARRIVAL, ROWWISE_ANY_INPUT)


class ReduceGradOnArrival(TensorParallelLayer):
    """A replicated parameter whose gradient is partial (a norm that sees this rank's heads only):
    each backward's gradient of the module's own parameters is summed over the TP ranks as it
    arrives. The hooks are attached at the first grad-enabled forward, as transformers attaches its
    own (the parameters are replaced when the weights load)."""

    def install_forward(self, module, mesh):
        original, hooked = module.forward, {}

        def reduce(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            dist.all_reduce(grad, group=mesh.get_group())
            return grad

        def tp_forward(*args, **kwargs):
            if torch.is_grad_enabled():
                for name, param in module.named_parameters(recurse=False):
                    if param.requires_grad and hooked.get(name) is not param:
                        param.register_hook(reduce)
                        hooked[name] = param
            return original(*args, **kwargs)

        module.forward = tp_forward
        return module


class RowwiseAnyInput(RowwiseParallel):
    """`rowwise` (weight Shard(-1), output all-reduced) whose input is this rank's slice of the
    features or the whole of them, told apart at each call by the input's width."""

    def __init__(self) -> None:
        super().__init__()
        self.whole = RowwiseParallel(input_layouts=Replicate())  # rowwise_split_input's input

    def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
        x = args[0]
        if not isinstance(x, DTensor) and x.shape[-1] == module.in_features:
            return self.whole.transform_inputs_pre_forward(module, args, kwargs, mesh)
        return super().transform_inputs_pre_forward(module, args, kwargs, mesh)


ALL_PARALLEL_STYLES.register(REDUCE_GRAD_ON_ARRIVAL, ReduceGradOnArrival())
ALL_PARALLEL_STYLES.register(ROWWISE_ANY_INPUT, RowwiseAnyInput())
