"""Check a torchtitan model, tensor-parallelized by torchtitan's own `Module.parallelize`.

    pip install 'tpcheck[torchtitan]'   # torchtitan 0.3.0 (+ triton: its models import it)

    case = torchtitan_case(name="llama3", build_dense=build_llama3, make_batch=make_batch)

torchtitan 0.3.0 declares TP on the model config: every module config carries a `ShardingConfig`
(its parameters' `state_shardings`, its inputs' and output's layouts per mesh axis), filled by the
model's own `set_*_sharding_config(config, enable_sp=...)`; `model.parallelize(parallel_dims)`
then distributes each parameter (`distribute_tensor`) and wraps each forward with the declared
redistributions (all-gather, reduce-scatter, all-reduce of a Partial output) and `local_map`
regions. The TP side here is exactly that, on the `partial_dtensor` backend (DTensor on the TP axis:
the backend the engine reads through `adapters.dtensor.LocalShards`), over a `ParallelDims` whose
only parallel axis is `tp` = the world size, built on tpcheck's process group.

The tpcheck plan is read from the same declarations, before any process group exists:
`state_shardings[param][tp]` `S(d)` -> `Shard(d)`, `R`/`I` -> `Replicate()`; each module's declared
output layout on the TP axis (`out_dst_shardings`, else `out_src_shardings`) becomes its per-module
check (`S(d)` or a sequence-parallel partition spec -> `Shard(d)`, `R`/`I` -> `Replicate()`). So a
wrong declaration is compared with the dense model's module output, and the real DTensor placements
are checked against the plan on every rank (LocalShards).

CPU: torchtitan picks its mesh device as `torch._utils._get_available_device_type() or "cuda"`
(torchtitan/tools/utils.py:55) and `ParallelDims.build_mesh` uses it (distributed/parallel_dims.py:
282), with no config or flag to choose another: on a machine without an accelerator the parameters
are moved to "cuda" ("Torch not compiled with CUDA enabled"). `parallel_dims_for` points that
module's `device_type` at the process group's device before building the mesh (torchtitan's source
is not changed). FlexAttention (the default language-model attention) has no backward on the CPU
(torch/nn/attention/flex_attention.py `_validate_device`): a CPU case builds its layers with
torchtitan's `ScaledDotProductAttention` (examples/torchtitan_llama.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tpcheck.adapters.dtensor import LocalShards
from tpcheck.checker.case import Case
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Placement, Plan, Replicate, Shard

TORCHTITAN_ERROR = (
    "torchtitan is not installed: pip install 'tpcheck[torchtitan]' "
    "(torchtitan==0.3.0 and triton, pinned beside your torch)"
)
BACKEND = "partial_dtensor"
_PARALLEL_DIMS: dict[tuple[int, str], object] = {}


def available() -> bool:
    try:
        import torchtitan.models.common  # noqa: F401  (imports triton)
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------ the plan


def _tp_type(layout):
    """The layout's type on the TP mesh axis (a partition spec's sharded dim as S(dim)), or None
    when the layout does not name the TP axis."""
    from torchtitan.distributed.parallel_dims import MeshAxisName

    return layout.per_axis_spmd_types().get(MeshAxisName.TP)


def _placement(layout, ndim: int | None) -> Placement | None:
    """tpcheck's placement for a torchtitan `SpmdLayout` on the TP axis; None for a Partial or
    varying one (nothing tpcheck can compare against the dense tensor)."""
    import spmd_types as spmd

    t = _tp_type(layout)
    if isinstance(t, spmd.Shard):
        return Shard(t.dim % ndim if ndim is not None and t.dim < 0 else t.dim)
    if t in (spmd.R, spmd.I):
        return Replicate()
    return None


def _output_layout(config):
    layout = config.out_dst_shardings or config.out_src_shardings
    return None if isinstance(layout, (tuple, list, dict)) else layout


def derive_plan(dense: nn.Module) -> Plan:
    """{dense parameter: placement} and {module: output placement} from the `ShardingConfig`s a
    torchtitan model was built with (the declarations `Module.parallelize` applies)."""
    params: dict[str, Placement] = {n: Replicate() for n, _ in dense.named_parameters()}
    activations: dict[str, Placement] = {}
    declared = 0
    for name, module in dense.named_modules():
        config = getattr(module, "_sharding_config", None)
        if config is None:
            continue
        declared += 1
        for pname, p in module.named_parameters(recurse=False):
            layout = config.state_shardings.get(pname)
            placement = None if layout is None else _placement(layout, p.dim())
            if placement is None:
                raise UsageError(
                    f"torchtitan declares parameter {f'{name}.{pname}'!r} as {layout} on the TP "
                    "axis; tpcheck compares Shard and Replicate parameters only"
                )
            params[f"{name}.{pname}" if name else pname] = placement
        layout = _output_layout(config)
        if name and layout is not None and (out := _placement(layout, None)) is not None:
            activations[name] = out
    if not declared:
        raise UsageError(
            f"{type(dense).__name__} has no torchtitan sharding_config on any module: fill them "
            "before building (e.g. set_llama3_sharding_config(config, enable_sp=...))"
        )
    return Plan(params=params, activations=activations)


# ------------------------------------------------------------------------------ the TP side


def parallel_dims_for(group: TPGroup):
    """torchtitan's `ParallelDims` with TP over the whole world (no data, context, pipeline or
    expert parallelism), its meshes built on the group's device, once per world size and device
    per process. Also selects the `partial_dtensor` backend (torchtitan's trainer does it from
    `parallelism.spmd_backend`)."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.distributed import utils as titan_utils

    titan_utils.set_spmd_backend(BACKEND)
    key = (group.world_size, group.device.type)
    if key not in _PARALLEL_DIMS:
        # torchtitan/tools/utils.py:55 falls back to "cuda" without an accelerator
        titan_dims.device_type = group.device.type
        dims = titan_dims.ParallelDims(
            dp_replicate=1,
            dp_shard=1,
            cp=1,
            tp=group.world_size,
            pp=1,
            ep=1,
            world_size=group.world_size,
            spmd_backend=BACKEND,
        )
        dims.build_mesh()
        _PARALLEL_DIMS[key] = dims
    return _PARALLEL_DIMS[key]


def tp_mesh(group: TPGroup):
    """The 1-D `tp` mesh of `parallel_dims_for(group)`."""
    return parallel_dims_for(group).get_mesh("tp")


def loss_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group: TPGroup):
    """torchtitan's own loss parallel (`components.loss.cross_entropy_loss` on logits sharded on the
    vocabulary: three TP all-reduces, no gathered logits), per token: its sum over the tokens
    divided by their number, as `cross_entropy_mean` on the dense side."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as DShard
    from torchtitan.components.loss import cross_entropy_loss

    if group.world_size == 1:
        return cross_entropy_mean(logits, labels)
    pred = DTensor.from_local(logits, tp_mesh(group), (DShard(logits.dim() - 1),), run_check=False)
    return cross_entropy_loss(pred, labels) / labels.numel()


def cross_entropy_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's cross-entropy of full logits (summed over tokens, in float32 at least) per
    token."""
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(logits, labels) / labels.numel()


def torchtitan_case(
    *,
    name: str,
    build_dense: Callable[[torch.dtype], nn.Module],
    make_batch: Callable,
    **fields,
) -> Case:
    """A Case whose TP side is `build_dense(dtype).parallelize(parallel_dims)`: a torchtitan model
    (a `torchtitan.protocols.module.Module`) built from a config whose sharding configs are filled.
    Loss: torchtitan's cross-entropy, vocab-parallel on the TP side (pass `loss`/`tp_loss` for
    another). `fields` are any other Case fields (init, run, inject, ...)."""
    if not available():
        raise UsageError(TORCHTITAN_ERROR)
    plan = derive_plan(build_dense(torch.float32))

    def build_tp(group: TPGroup, dtype: torch.dtype) -> nn.Module:
        dims = parallel_dims_for(group)
        model = build_dense(dtype)
        model.parallelize(dims)
        return LocalShards(model, dims.get_mesh("tp"), group, plan)

    fields.setdefault("loss", cross_entropy_mean)
    fields.setdefault("tp_loss", loss_parallel_cross_entropy)
    fields.setdefault("output_placement", Shard(2))
    return Case(
        name=name,
        build_dense=build_dense,
        build_tp=build_tp,
        plan=plan,
        make_batch=make_batch,
        **fields,
    )
