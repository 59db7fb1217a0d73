"""Detectability: the smallest planted error a default run flags, per dtype and world size.

Two bug sizes, planted into the built-in MLP (a
default run: 3 AdamW steps, 2 micro-batches, lr 1e-3):

* partial: the last rank's partial sum enters the row-parallel all-reduce scaled by (1 + size), the
  error a slightly wrong shard or scaling constant makes (relative to that rank's partial sum);
* lr: the last rank steps its sharded parameters with lr x (1 + size).

A size counts as detected when every seed's run is "not equivalent"; the threshold is the smallest
size of the grid from which every larger size is detected too (None: not even the largest).
benchmarks/detectability.py prints the table; docs/tolerances.md holds it.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from tpcheck.blocks import BLOCKS, config_for
from tpcheck.checker.case import CaseSpec
from tpcheck.checker.casefile import file_spec, register
from tpcheck.checker.settings import RunSettings
from tpcheck.faults import injectors as inj

PARTIAL_SIZES = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 3e-3, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2)
LR_SIZES = (1e-6, 1e-4, 1e-2, 0.5)
# the targets: relative error in one rank's partial
# sums (by dtype; world 8 in 16-bit: 10%), and lr x 1.5
TARGETS = {"float32": 1e-4, "float64": 1e-4, "bfloat16": 0.03, "float16": 0.03}
TARGET_16BIT_WORLD8 = 0.1
TARGET_LR = 0.5
# the largest outlier a float16 probe takes: its square must stay under float16's 65504 in the loss
FLOAT16_OUTLIER = 100.0


def target(kind: str, dtype: str, world: int) -> float:
    if kind == "lr":
        return TARGET_LR
    if dtype in ("bfloat16", "float16") and world >= 8:
        return TARGET_16BIT_WORLD8
    return TARGETS[dtype]


@dataclass(frozen=True)
class Probe:
    kind: str  # partial | lr
    dtype: str
    world: int
    size: float
    seed: int
    outlier: float = 0.0  # one input element set to this (ModelConfig.outlier; 0: none)
    float64_run: str = "auto"  # RunSettings.float64_run: "off" measures the working dtype alone

    def spec(self, preset: str = "tiny") -> CaseSpec:  # tiny: hidden 32, ffn 64
        """The planted case, registered in this process (register before the ranks fork)."""
        # heads: unused by the MLP; divisible up to 8
        overrides = (("heads", 8), ("kv_heads", 8))
        base = CaseSpec(
            block="mlp",
            preset=preset,
            world_size=self.world,
            run=RunSettings(dtype=self.dtype, seed=self.seed, float64_run=self.float64_run),
            overrides=overrides + ((("outlier", self.outlier),) if self.outlier else ()),
        )
        case = BLOCKS["mlp"].case(base, config_for(base))
        if self.kind == "partial":
            plant = inj.intercept(
                "all_reduce",
                "down",
                "forward",
                inj.scale_partial(1 + self.size),
                ranks=lambda r, w: r == w - 1,
            )
        else:
            plant = inj.lr_scaled_on_last_rank(lambda w: 1 + self.size)
        label = f"{self.kind}x(1+{self.size:g})/{self.dtype}/tp{self.world}/seed{self.seed}"
        label += f"/outlier{self.outlier:g}" if self.outlier else ""
        spec = file_spec(register(plant(case, base)), self.world, label=label)
        return dataclasses.replace(spec, expected="not equivalent")


def probes(
    kinds=("partial", "lr"),
    dtypes=("float32", "bfloat16", "float16"),
    worlds=(2, 4, 8),
    seeds=(1, 2),
    partial_sizes=PARTIAL_SIZES,
    lr_sizes=LR_SIZES,
    outlier: float = 0.0,
    float64_run: str = "auto",
) -> list[Probe]:
    """Every probe of the grid; `outlier`: one input element of that size (at most
    FLOAT16_OUTLIER in float16, whose MSE loss overflows beyond)."""
    out = []
    for kind, dtype, world, seed in itertools.product(kinds, dtypes, worlds, seeds):
        if kind == "partial" and world < 2:
            continue  # one rank: no partial sums
        big = min(outlier, FLOAT16_OUTLIER) if dtype == "float16" else outlier
        for size in partial_sizes if kind == "partial" else lr_sizes:
            out.append(Probe(kind, dtype, world, size, seed, big, float64_run))
    return out


def thresholds(
    probes_run: list[Probe], results: list[dict]
) -> dict[tuple[str, str, int], float | None]:
    """(kind, dtype, world) -> the smallest size from
    which every larger size was detected on every seed."""
    detected: dict[tuple, dict[float, bool]] = {}
    for p, r in zip(probes_run, results):
        cell = detected.setdefault((p.kind, p.dtype, p.world), {})
        cell[p.size] = cell.get(p.size, True) and r["verdict"] == "not equivalent"
    out = {}
    for key, by_size in detected.items():
        threshold = None
        for size in sorted(by_size, reverse=True):
            if not by_size[size]:
                break
            threshold = size
        out[key] = threshold
    return out
