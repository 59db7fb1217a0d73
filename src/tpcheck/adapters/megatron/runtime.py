"""Megatron-Core on CPU/gloo: the optional import, the set-up every rank runs (`init_megatron`),
the CPU RNG tracker, the config, and the small wrappers and batches the cases share
(tpcheck/adapters/megatron/__init__.py says why each is needed)."""

from __future__ import annotations

import torch
from torch import nn

from tpcheck.checker.settings import RunSettings
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.parallel.random import drawing_from

try:  # imported at module load, so a case file importing this pays it once, before the ranks fork
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mtp
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:  # pragma: no cover - depends on the optional extra
    MEGATRON_ERROR: str | None = (
        f"megatron-core is not importable ({e}); pip install 'tpcheck[megatron]'"
    )
else:
    MEGATRON_ERROR = None

# Megatron-Core's names, used by the cases beside this module as `runtime.<name>` (bound only when
# the extra is installed: a case reaches them after `available()`)
__all__ = [
    "GPTModel",
    "MLP",
    "MLPSubmodules",
    "TransformerBlockSubmodules",
    "build_module",
    "get_gpt_layer_local_spec",
    "mtp",
]


def available() -> bool:
    return MEGATRON_ERROR is None


def init_megatron(group: TPGroup) -> None:
    """CPU patch + Megatron's global parallel state over this rank's gloo group (idempotent)."""
    if MEGATRON_ERROR:
        raise ImportError(MEGATRON_ERROR)
    if group.device.type != "cpu":
        raise UsageError(
            "Megatron-Core layers are checked on the CPU only (tpcheck runs them with their CUDA "
            "calls patched to the CPU); leave --device out"
        )
    torch.cuda.current_device = lambda: torch.device("cpu")
    if not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, _CPUTracker):
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = (
            _CPUTracker(group.rank),
            True,
        )
    if parallel_state.model_parallel_is_initialized():
        have = parallel_state.get_tensor_model_parallel_world_size()
        if have == group.world_size:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=group.world_size)


SEED = 1234  # the training script's seed, as given to model_parallel_cuda_manual_seed


class _CPUTracker(mrandom.CudaRNGStatesTracker if MEGATRON_ERROR is None else object):
    """Megatron's RNG tracker on CPU: its named states as CPU generator states, seeded as
    `model_parallel_cuda_manual_seed(SEED)` seeds them on tensor-parallel rank `tp_rank`
    (data-parallel: SEED; model-parallel: SEED + 2718 + tp_rank; expert: SEED + 1024 + tp_rank);
    `fork(name)` swaps one into the CPU default generator and back, as Megatron's
    swaps the CUDA one."""

    def __init__(self, tp_rank: int) -> None:
        super().__init__()
        self.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, SEED)
        self.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, SEED + 2718 + tp_rank)
        self.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, SEED + 1024 + tp_rank)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    def fork(
        self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME if MEGATRON_ERROR is None else ""
    ):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        return drawing_from(self.states_, name)


def config(world: int, dtype: torch.dtype, hidden: int, ffn: int, **kw) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=4,
        tensor_model_parallel_size=world,
        params_dtype=dtype,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        **kw,
    )


class Unpack(nn.Module):
    """Megatron layers return (output, bias): keep the output; parameters appear as `layer.*`."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        out = self.layer(x)
        return out[0] if isinstance(out, tuple) else out


class Keep(Unpack):
    """`Unpack` for a module called with its own keyword arguments (TransformerLayer returns
    (output, context); GPTModel the loss or logits)."""

    def forward(self, **kwargs):
        out = self.layer(**kwargs)
        return out[0] if isinstance(out, tuple) else out


class Finalized(Keep):
    """A Megatron model as its training loop sees it: `finalize_grads()` (called by the engine in
    the optimizer phase, before the step) runs Megatron's own
    `_allreduce_non_tensor_model_parallel_grads`, the part of `finalize_model_grads` that sums over
    the TP group the grads of parameters marked `sequence_parallel=True` (norm weights under SP:
    each rank saw only its sequence shard, so its grad is partial). No-op without SP. `ddp_config`
    is what that function reads off a model chunk."""

    def __init__(self, layer: nn.Module, cfg: TransformerConfig) -> None:
        super().__init__(layer)
        self.cfg, self.ddp_config = cfg, DistributedDataParallelConfig()

    def finalize_grads(self) -> None:
        _allreduce_non_tensor_model_parallel_grads([self], self.cfg)


def init_normal(model: nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def hidden_batch(seq: int, batch: int, hidden: int, out: int | None = None):
    def make(g, dtype):
        x = torch.randn(seq, batch, hidden, generator=g)
        return {"x": x.to(dtype)}, torch.randn(seq, batch, out or hidden, generator=g).to(dtype)

    return make


def _fields(kw: dict) -> dict:
    return {"init": init_normal, "run": RunSettings(steps=2), **kw}
