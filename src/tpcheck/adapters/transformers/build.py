"""The models checked: the class chosen for an architecture (`model_class`: its causal LM, else its
base model), built from a config (`build_lm`) and seen as `inputs -> output` (`wrap`:
`CausalLMLogits`, `HiddenStates`); the TP side, sharded by transformers itself over its mesh
(`mesh_manager`, `resolved_plan`, `TransformersTP`); and where the plan's styles leave the module
outputs checked and the model's output (`activation_placements`, `output_placement`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import re
from dataclasses import dataclass

import torch
from torch import nn

from tpcheck.adapters.dtensor import LocalShards
from tpcheck.adapters.transformers.common import (
    CONFIG_MAPPING,
    HIDDEN,
    LOGITS,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_MAPPING_NAMES,
    Skip,
    transformers,
)
from tpcheck.adapters.transformers.inputs import _own_config, _unmade_inputs
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Fused, Placement, Replicate, Shard


@dataclass(frozen=True)
class ModelChoice:
    """The class checked for an architecture and what its output is: `LOGITS` (a causal LM:
    cross-entropy on the logits) or `HIDDEN` (a base model or encoder: its last hidden state,
    mean-squared error against a random target, a loss whose gradient reaches every parameter)."""

    cls: type
    kind: str


def _takes_token_ids(cls) -> bool:
    try:
        return "input_ids" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return False


def _own_classes(config_cls) -> list[type]:
    """The model classes of the config's own modeling module built from that config class (its
    `config_class`), in definition order; abstract `*PreTrainedModel` bases left out."""
    import importlib

    from transformers import PreTrainedModel

    module_name = config_cls.__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - no modeling module: no class to build
        return []
    return [
        v
        for k, v in vars(module).items()
        if isinstance(v, type)
        and issubclass(v, PreTrainedModel)
        and v.__module__ == module_name
        and getattr(v, "config_class", None) is config_cls
        and not k.endswith("PreTrainedModel")
    ]


@functools.cache
def model_class(model_type: str) -> ModelChoice:
    """The class checked for `model_type`, by one rule for every architecture: its causal LM
    (AutoModelForCausalLM's entry, else a `*ForCausalLM` class of its modeling module built from
    its config class); else its base model (AutoModel's entry built from its config class, else a
    class of its modeling module built from its config class that is no task head), seen through
    its last hidden state. Only classes whose forward takes `input_ids`; raises Skip when none."""
    config_cls = CONFIG_MAPPING[model_type]
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if isinstance(name, str) and getattr(transformers, name, None) is not None:
        return ModelChoice(getattr(transformers, name), LOGITS)
    own = _own_classes(config_cls)
    for cls in own:
        if cls.__name__.endswith("ForCausalLM") and _takes_token_ids(cls):
            return ModelChoice(cls, LOGITS)
    base = MODEL_MAPPING_NAMES.get(model_type)
    base_cls = getattr(transformers, base, None) if isinstance(base, str) else None
    candidates = [base_cls] if base_cls is not None else []
    candidates += [c for c in own if "For" not in c.__name__ and c is not base_cls]
    candidates = [c for c in candidates if getattr(c, "config_class", None) is config_cls]
    for cls in candidates:
        if _takes_token_ids(cls):
            return ModelChoice(cls, HIDDEN)
    for cls in candidates:
        if not _unmade_inputs(cls):
            return ModelChoice(cls, HIDDEN)  # run from random pixels or embeddings
    if own or base_cls is not None:
        inputs = sorted({_signature(c) for c in (own or [base_cls])})
        unmade = sorted({i for c in candidates for i in _unmade_inputs(c)})
        raise Skip(
            "it takes no token ids: its models encode another modality "
            f"({'; '.join(inputs[:2])}) and need "
            f"{', '.join(f'`{i}`' for i in unmade) or 'inputs'} that no generic rule makes "
            "(made: token ids, `pixel_values` of its config's image size, random "
            "`*_embeds` / `*hidden_states` of its hidden size)"
        )
    raise Skip(
        "no model class is built from its config class (no causal LM, no base model): it is "
        "a part configured inside another architecture's model"
    )


def _signature(cls) -> str:
    args = list(inspect.signature(cls.forward).parameters)[1:3]
    return f"{cls.__name__}.forward({', '.join(args)}, ...)"


def _call_kwargs(model: nn.Module, inputs: dict) -> dict:
    """The forward's keyword arguments: the batch's inputs, and no KV cache where it takes one."""
    kwargs = dict(inputs)
    if "use_cache" in inspect.signature(type(model).forward).parameters:
        kwargs["use_cache"] = False
    return kwargs


def _last_hidden_state(out) -> torch.Tensor:
    """The last hidden state of a base model's output; else its first output (a tuple's, or a
    ModelOutput's first field set: the logits of a head class registered as the base model)."""
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None:
        hidden = out if torch.is_tensor(out) else out[0]
    return hidden


class CausalLMLogits(nn.Module):
    """A causal LM seen as `input_ids -> logits`, under the HF parameter and module names: it shares
    the model's submodules (its `_modules` dict) instead of holding the model as a child."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "lm", lm)
        object.__setattr__(self, "_modules", lm._modules)
        object.__setattr__(self, "_parameters", lm._parameters)
        object.__setattr__(self, "_buffers", lm._buffers)

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.lm(**_call_kwargs(self.lm, inputs)).logits


class HiddenStates(CausalLMLogits):
    """A base model (no LM head) seen as `input_ids -> last hidden state`, under the HF names
    (the same sharing of submodules as `CausalLMLogits`)."""

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return _last_hidden_state(self.lm(**_call_kwargs(self.lm, inputs)))


def wrap(model: nn.Module, kind: str) -> nn.Module:
    """The model seen as `input_ids -> output` for its kind (`LOGITS` or `HIDDEN`)."""
    return CausalLMLogits(model) if kind == LOGITS else HiddenStates(model)


def build_lm(
    model_type: str,
    cfg,
    dtype: torch.dtype,
    device=None,
    tie: bool = True,
    pinned: tuple[str, ...] = (),
) -> nn.Module:
    """The architecture's model (`model_class`) from `cfg`. tie=False: embeddings left untied, as
    `from_pretrained` builds a model it is about to shard (it ties them after the plan is
    applied). `pinned`: modules kept in float32 whatever `dtype` (those that cast their input to
    float32 and so run in no other dtype: `_float32_pinned`)."""
    from transformers import initialization

    cls = model_class(model_type).cls
    cfg = _own_config(cls, cfg)
    untied = initialization.no_tie_weights() if not tie else contextlib.nullcontext()
    with torch.device(device or "cpu"), untied:
        model = cls(copy.deepcopy(cfg))
    model = model.to(dtype).eval()
    for name in pinned:
        model.get_submodule(name).float()
    return model


_MESHES: dict[int, tuple] = {}


def mesh_manager(world: int):
    """transformers' DistributedConfig and mesh manager
    for `world` ranks: built once per process."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import initialize_distributed_mesh

    if world not in _MESHES:
        dc = DistributedConfig(tp_size=world)
        _, manager = initialize_distributed_mesh(dc)
        _MESHES[world] = (dc, manager)
    return _MESHES[world]


def resolved_plan(model: nn.Module, world: int, rules: dict[str, str] | None) -> dict[str, str]:
    """transformers' own plan for this model at `world` ranks, one entry per module or parameter."""
    from transformers.distributed import DistributedConfig

    dc = DistributedConfig(tp_size=world, tp_plan=dict(rules) if rules else None)
    tp_plan, _, _ = model._resolve_parallel_plans(dc)
    return tp_plan


class TransformersTP(LocalShards):
    """The TP side: built on the first `load` from the dense weights (a copy of the dense model
    sharded by `maybe_distribute_model`), refilled on a later load by the same `distribute_tensor`
    of each weight to its placement. (The checker loads once; each later step restarts the local
    shards in place through the plan.)"""

    def __init__(
        self, model_type: str, cfg, dtype: torch.dtype, group: TPGroup, rules: dict | None
    ) -> None:
        nn.Module.__init__(self)
        self.model_type, self.cfg, self.dtype_, self.group, self.rules = (
            model_type,
            cfg,
            dtype,
            group,
            rules,
        )
        object.__setattr__(self, "parallel", None)
        self.specs, self.shards, self.comm, self.mesh = {}, nn.ParameterDict(), None, None

    def load(self, state: dict[str, torch.Tensor]) -> None:
        if self.parallel is None:
            self._build(state)
            return
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            for name, p in self.named_parameters():
                full = state[name].to(self.dtype_)
                if name in self.specs:
                    placements = self.specs[name][0]
                    full = distribute_tensor(
                        full, self.mesh, placements, src_data_rank=None
                    ).to_local()
                p.copy_(full)

    def _build(self, state: dict[str, torch.Tensor]) -> None:
        from transformers.distributed import DistributedConfig

        dc, manager = mesh_manager(self.group.world_size)
        if self.rules:
            dc = DistributedConfig(tp_size=self.group.world_size, tp_plan=dict(self.rules))
        lm = build_lm(self.model_type, self.cfg, self.dtype_, tie=False)
        lm.load_state_dict({k: v.to(self.dtype_) for k, v in state.items()}, strict=False)
        lm = type(lm).maybe_distribute_model(lm, dc, manager)
        lm.tie_weights()
        if not any(hasattr(p, "to_local") for p in lm.parameters()):
            raise UsageError(
                f"transformers sharded no parameter of {self.model_type} at world size "
                f"{self.group.world_size}: its plan applied nothing"
            )
        parallel = wrap(lm, model_class(self.model_type).kind)
        LocalShards.__init__(self, parallel, manager.get_mesh("tp"), self.group, None)
        names = {n for n, _ in self.named_parameters()}
        if names != set(state):
            raise UsageError(
                f"{self.model_type}: the sharded model's parameters differ from the dense model's: "
                f"only TP {sorted(names - set(state))[:5]}, only dense "
                f"{sorted(set(state) - names)[:5]}"
            )


_REPLICATED_OUTPUT = {
    "rowwise",
    "rowwise_rep",
    "rowwise_split_input",
    "colwise_gather_output",
    "colwise_rep",
    "embedding_rowwise",
    "embedding_colwise",
    "all_reduce",
    "moe_tp_experts",
}

_LAYER = re.compile(r"(^|\.)layers\.\d+$")


def activation_placements(
    model: nn.Module, tp_plan: dict[str, str], world: int
) -> dict[str, Placement]:
    """The module outputs checked, placed as the styles lay them out: colwise -> this rank's slice
    of the last dim; packed_colwise -> this rank's slice of each packed part; rowwise, gathered,
    embedding and moe_tp_experts (all-reduced) outputs -> whole on every rank; every decoder layer
    (`*.layers.N`) -> whole (the residual stream). Modules under other styles (MLA, sequence
    parallel) are checked through their layer."""
    modules = dict(model.named_modules())
    out: dict[str, Placement] = {}
    for name in modules:
        if _LAYER.search(name):
            out[name] = Replicate()
    for name, style in tp_plan.items():
        module = modules.get(name)
        if module is None:
            continue  # a parameter rule
        if style == "colwise" and isinstance(module, nn.Linear):
            out[name] = Shard(-1)
        elif (
            style == "packed_colwise"
            and isinstance(module, nn.Linear)
            and module.out_features % (2 * world) == 0
        ):
            half = module.out_features // 2
            out[name] = Fused(-1, (half, half))
        elif style in _REPLICATED_OUTPUT:
            out[name] = Replicate()
    return out


def output_placement(tp_plan: dict[str, str], kind: str = LOGITS) -> Placement:
    """How the TP output relates to the dense one: whole, unless the LM head's rule leaves the
    logits sharded (Skip: no loss transformers applies reads them so). A base model's last
    hidden state comes out of its final norm, whole."""
    if kind != LOGITS:
        return Replicate()
    style = tp_plan.get("lm_head")
    if style in (None, *_REPLICATED_OUTPUT):
        return Replicate()
    raise Skip(
        f"its lm_head rule {style!r} leaves the logits sharded; the loss would need a "
        "vocab-parallel cross-entropy transformers does not apply"
    )
