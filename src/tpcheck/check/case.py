"""A `Case`: everything the engine needs to check one TP implementation against its dense twin.

The engine knows no layer: it builds the dense module, builds the TP module, loads TP weights from
the dense ones through the plan, feeds both the same batches (TP inputs placed by
`input_placements`), and compares through the plan.

A `CaseSpec` is the small, picklable name of a case (block, preset, world size, dtype, fault, ...)
that travels to rank processes; `build_case(spec)` turns it into a `Case` on each rank.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Placement, Plan, Replicate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
OPTIMIZERS = ("sgd", "adamw")

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]  # (forward kwargs, target)


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


@dataclass(frozen=True, kw_only=True)
class Case:
    """How to build, feed and compare one dense module and its TP twin.

    build_dense(dtype) -> dense module; its parameters are initialised by `init(module, generator)`.
    build_tp(group, dtype) -> TP module whose parameters are named as in the dense one (or renamed by
        `plan.tp_names`); the engine fills them from the dense weights through `plan`.
    make_batch(generator, dtype) -> ({forward kwarg: dense tensor}, target).
    loss(out, target) -> scalar for the dense side; tp_loss(out_local, target, group) for the TP side
        (defaults to `loss`, valid when the TP output is placed `Replicate`).
    input_placements: how each forward input reaches the TP module (default Replicate; Shard(0) for
        sequence parallelism). output_placement: how the TP output relates to the dense one;
        target_placement: which part of the target the TP loss sees.
    grad_inputs: forward inputs whose gradients are checked (floating point only).
    """

    name: str
    build_dense: Callable[[torch.dtype], nn.Module]
    build_tp: Callable[[TPGroup, torch.dtype], nn.Module]
    plan: Plan
    make_batch: Callable[[torch.Generator, torch.dtype], Batch]
    init: Callable[[nn.Module, torch.Generator], None] = lambda m, g: m.reset_parameters(g)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mse_loss
    tp_loss: Callable[[torch.Tensor, torch.Tensor, TPGroup], torch.Tensor] | None = None
    input_placements: dict[str, Placement] = field(default_factory=dict)
    output_placement: Placement = Replicate()
    target_placement: Placement = Replicate()
    grad_inputs: tuple[str, ...] = ("x",)
    seed: int = 31
    steps: int = 3
    micro_batches: int = 1
    optimizer: str = "adamw"
    lr: float = 1e-3
    dtype: str = "float32"
    # Compare module outputs and their grads (plan.activations) to localize the first divergence.
    capture: bool = True
    # Called on every rank after the TP module is built and loaded (fault injection uses it).
    tamper: Callable[[nn.Module, TPGroup], None] | None = None
    # The plan the TP side loads its weights with, when it differs from `plan` (a TP implementation
    # with its own checkpoint loading); checks always use `plan`.
    load_plan: Plan | None = None
    # (phase, op, site) the TP module should issue per micro-batch (forward, backward) and per step
    # (optimizer); None when unknown. The ledger is checked against it.
    expected_collectives: tuple | None = None
    # Builds the TP side's optimizer: (tp_module, group, default_factory) -> Optimizer.
    tp_optimizer: Callable | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UsageError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"optimizer {self.optimizer!r} is not one of {OPTIMIZERS}")
        if self.steps < 1 or self.micro_batches < 1:
            raise UsageError(f"steps ({self.steps}) and micro_batches ({self.micro_batches}) must be >= 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def compute_tp_loss(self, out_local: torch.Tensor, target: torch.Tensor, group: TPGroup) -> torch.Tensor:
        if self.tp_loss is not None:
            return self.tp_loss(out_local, target, group)
        return self.loss(out_local, target)

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr)
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)


@dataclass(frozen=True, kw_only=True)
class CaseSpec:
    """The picklable name of a case. `block` is a built-in block name or "file:PATH[:NAME]"."""

    block: str = "mlp"
    preset: str = "seed"
    world_size: int = 2
    dtype: str = "float32"
    steps: int = 3
    optimizer: str = "adamw"
    lr: float | None = None
    micro_batches: int = 1
    sequence_parallel: bool = False
    fault: str | None = None
    seed: int = 31
    overrides: tuple[tuple[str, object], ...] = ()  # ModelConfig field overrides
    capture: bool = True  # compare module outputs/grads to localize the first divergence
    label: str = ""

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        parts = [self.block, self.preset, f"tp{self.world_size}", self.dtype]
        if self.sequence_parallel:
            parts.append("sp")
        if self.fault:
            parts.append(self.fault)
        return "/".join(parts)

    @property
    def expect_equivalent(self) -> bool:
        """Injected faults are expected to be caught (not equivalent); everything else to pass."""
        return self.fault is None
