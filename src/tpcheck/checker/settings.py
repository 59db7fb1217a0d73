"""How a case is run: `RunSettings` (working dtype, steps, micro-batches, optimizer and learning
rate, seed, master weights, clipping, warm-up, the float64 run, ...), validated on creation, the one
place these values are checked; and the limits and defaults it checks them against."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tpcheck.errors import UsageError

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
OPTIMIZERS = ("sgd", "adamw")
FLOAT64_RUN = ("auto", "on", "off")  # RunSettings.float64_run
MAX_STEPS = 10_000  # steps and micro-batches: beyond this a typo, not a check
DEFAULT_LR = {"sgd": 0.05, "adamw": 1e-3}
# above, the weights and the dense reference itself overflow within a few steps (the CLI's too)
MAX_LR = 10.0


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """How a case is run: working dtype, optimizer steps, micro-batches (gradient accumulation: the
    micro-batch losses are averaged, grads accumulate), optimizer and learning rate (None: 0.05 for
    SGD, 1e-3 for AdamW), seed of the weights and batches, and whether module outputs are captured
    to localize the first divergence. Validated on creation: this is the one place where these
    values are checked.

    master_weights: with a 16-bit dtype, both sides train as Megatron-Core and torchtitan do: the
    modules compute in the 16-bit dtype, the optimizer steps float32 master copies of the weights
    (grads upcast to float32, float32 optimizer state), and the modules get the masters rounded back
    after each step. False: pure 16-bit parameters and optimizer state (updates below half an ulp of
    a weight round away on both sides, so the post-step check sees much less; see
    docs/tolerances.md). No effect in float32/float64.

    clip_grad_norm: global gradient-norm clipping as trained (None: none). The dense side clips with
    `torch.nn.utils.clip_grad_norm_` before its optimizer step; the TP side with the case's
    `tp_clip_grad_norm` (yours) or tpcheck's TP-aware default; their total norms are compared
    (`clip:grad_norm`, checker/rank/training.py).

    train: False checks the forward only (checker/rank/forward_only.py): the loaded weights, then
    for each step a fresh batch through every side without autograd, every module output, the
    output and the loss (if the batch has a target) compared; no backward, no optimizer. Chosen
    by itself, and said in the report, when no TP parameter requires grad (inference code) or the
    case decodes (`Case.decode_steps`). micro_batches and the optimizer settings do not apply.

    warmup: forward passes of every side (dense, the float64 truth, TP) on the first batch before
    the first checked step (checker/rank/warmup.py), not compared: TP code whose path depends on
    how often it was called (a fused kernel after N warm-up calls, graph capture) is then checked on
    the calls after the N-th. Training runs them with autograd (as its steps' forwards),
    outputs dropped and no backward; a forward-only run without, after which the modules' buffers
    are restored as built (a KV cache). Without them a check sees `steps x micro_batches` forwards
    and the last step's eval-mode one (7 by default): a path taken from the 8th call on is not
    checked.

    float64_run: also run the TP model in float64 against the float64 truth (bounds of
    `FP64_FLOOR_ULPS` ulps, checker/rank/tolerance.py), after the run in the working dtype, and
    merge the two (checker/verdict/float64_run.py): most TP bugs are structural and act in float64
    too, where no 16-bit rounding hides them. "auto": on for the 16-bit dtypes (bfloat16, float16),
    off for float32 (the time it doubles; float32's own bounds see such bugs) and float64 (the run
    is one already); "on", "off"."""

    dtype: str = "float32"
    steps: int = 3
    micro_batches: int = 2
    optimizer: str = "adamw"
    lr: float | None = None
    seed: int = 31
    capture: bool = True
    master_weights: bool = True
    clip_grad_norm: float | None = None
    train: bool = True
    warmup: int = 0
    float64_run: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UsageError(
                f"dtype {self.dtype!r} is not one of {sorted(DTYPES)} (complex and integer dtypes "
                "cannot be checked: the tolerances are for real floating point)"
            )
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"optimizer {self.optimizer!r} is not one of {list(OPTIMIZERS)}")
        for name in ("steps", "micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STEPS:
                raise UsageError(
                    f"{name} must be an integer in 1..{MAX_STEPS}, got {value!r} (a check needs a "
                    "few steps; drift over many steps shows within tens)"
                )
        if self.lr is not None and not (
            isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and 0 < self.lr <= MAX_LR
        ):
            raise UsageError(
                f"learning rate {self.lr!r} must be a finite number in (0, {MAX_LR:g}]: larger "
                "steps make the weights, and the dense reference itself, overflow to "
                "Inf/NaN within a few steps"
            )
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not -(2**63) <= self.seed < 2**64
        ):
            raise UsageError(
                f"seed {self.seed!r} must be an integer in torch's range [-2**63, 2**64)"
            )
        if not isinstance(self.master_weights, bool):
            raise UsageError(f"master_weights {self.master_weights!r} must be True or False")
        clip = self.clip_grad_norm
        if clip is not None and not (
            isinstance(clip, (int, float))
            and not isinstance(clip, bool)
            and math.isfinite(clip)
            and clip > 0
        ):
            raise UsageError(
                f"clip_grad_norm {clip!r} must be a finite number > 0 (the largest total gradient "
                "norm, as torch.nn.utils.clip_grad_norm_ takes it), or None for no clipping"
            )
        if not isinstance(self.train, bool):
            raise UsageError(
                f"train {self.train!r} must be True or False (False: check the forward only)"
            )
        warmup = self.warmup
        if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup <= MAX_STEPS:
            raise UsageError(
                f"warmup must be an integer in 0..{MAX_STEPS} (forward passes before the first "
                f"checked step), got {warmup!r}"
            )
        if self.float64_run not in FLOAT64_RUN:
            raise UsageError(
                f"float64_run {self.float64_run!r} is not one of {list(FLOAT64_RUN)} (auto: a "
                "float64 run besides a bfloat16 or float16 one)"
            )

    @property
    def wants_float64_run(self) -> bool:
        """Whether a float64 run of the case follows this one (`float64_run`; never for a run
        that is in float64 already)."""
        if self.dtype == "float64" or self.float64_run == "off":
            return False
        return self.float64_run == "on" or self.dtype in ("bfloat16", "float16")

    @property
    def uses_masters(self) -> bool:
        """Whether the optimizer steps float32 master copies (16-bit dtype with master_weights)."""
        return self.master_weights and self.torch_dtype in (torch.bfloat16, torch.float16)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.learning_rate)
        return torch.optim.AdamW(params, lr=self.learning_rate, weight_decay=0.01)
