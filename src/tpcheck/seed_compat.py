"""Everything seed-compatible, in one place: the seed's modes as CaseSpecs, its `inspect` payload,
and its RunResult JSON (same keys, same numbers as `../shared/seed/reference.py`).

The seed checks its SwiGLU MLP (preset "seed") with one SGD step, lr 0.05; `missing_forward_reduce`
and `missing_backward_reduce` are the catalogue's faults of the same names.
"""

from __future__ import annotations

import platform
import sys

import torch

from tpcheck.blocks import BLOCKS, config_for
from tpcheck.checker.case import CaseSpec
from tpcheck.checker.settings import RunSettings
from tpcheck.parallel.group import PHASES, TPGroup

SEED_MODES = ("equivalence", "missing_forward_reduce", "missing_backward_reduce")
MODES = ("inspect", *SEED_MODES, "all")

SEED_KEYS = {  # seed RunResult key -> our check name
    "forward_max_abs_diff": "output",
    "loss_abs_diff": "loss",
    "input_grad_max_abs_diff": "grad:x",
    "norm_grad_max_abs_diff": "grad:norm.weight",
    "gate_up_grad_max_abs_diff": "grad:gate_up.weight",
    "down_grad_max_abs_diff": "grad:down.weight",
    "down_bias_grad_max_abs_diff": "grad:down.bias",
}
NOT_INCLUDED = [
    "CUDA/NCCL (untested on this CPU machine)",
    "autocast mixed precision",
    "fused kernels",
    "pipeline and data parallelism",
]


def mode_specs(
    mode: str,
    world_size: int,
    *,
    preset: str | None = None,
    steps: int | None = None,
    optimizer: str | None = None,
    lr: float | None = None,
    seed: int = 31,
) -> list[CaseSpec]:
    """The CaseSpecs of a seed mode ('all': the three run modes; 'inspect': none)."""
    modes = SEED_MODES if mode == "all" else () if mode == "inspect" else (mode,)
    run = RunSettings(
        steps=1 if steps is None else steps,
        optimizer=optimizer or "sgd",
        lr=lr,
        seed=seed,
        micro_batches=1,
    )
    return [
        CaseSpec(
            block="mlp",
            preset=preset or "seed",
            world_size=world_size,
            run=run,
            fault=None if m == "equivalence" else m,
            label=m,
        )
        for m in modes
    ]


def seed_run_result(mode: str, result: dict) -> dict:
    """The seed's RunResult for one mode, computed as the seed computes it: replicated tensors on
    rank 0, sharded ones gathered from every rank (the max over ranks of the shards' differences);
    `passed` as the seed defines it (mode is equivalence and every diff < 1e-6)."""
    checks = [c for c in result.get("checks", []) if c["step"] == 1 and c["stage"] != "replicas"]
    worst: dict = {}
    for c in checks:
        if c["placement"] == "replicate" and c["rank"] != 0:
            continue
        key = (c["stage"], c["name"])
        worst[key] = max(worst.get(key, 0.0), c["diff_vs_dense"])
    out: dict = {"mode": mode, "world_size": result["world_size"]}
    for key, name in SEED_KEYS.items():
        stage = {"output": "forward", "loss": "loss"}.get(
            name, "backward" if name == "grad:x" else "grads"
        )
        out[key] = worst[(stage, name)]
    out["post_step_weight_max_abs_diff"] = max(
        v
        for (stage, name), v in worst.items()
        if stage == "optimizer" and name.startswith("param:")
    )
    diffs = [v for k, v in out.items() if k.endswith("_diff")]
    out["passed"] = mode == "equivalence" and max(diffs) < 1e-6
    return out


def seed_payload(mode: str, results: list[dict], world_size: int) -> dict:
    """What `tpcheck run --mode MODE` prints: the seed's JSON for that mode."""
    runs = {
        r["name"]: seed_run_result(r["name"], r)
        if r["verdict"] in ("equivalent", "not equivalent")
        else {"mode": r["name"], "error": r["summary"]}
        for r in results
    }
    if mode == "inspect":
        return seed_inspect(world_size)
    if mode == "all":
        return {"inspect": seed_inspect(world_size), **runs}
    return runs[mode]


def seed_inspect(world_size: int) -> dict:
    """The seed's inspect JSON, same keys, shapes for `world_size` ranks."""
    spec = CaseSpec(block="mlp", preset="seed", world_size=world_size)
    cfg = config_for(spec)
    s, b, h, f, w = cfg.seq, cfg.batch, cfg.hidden, cfg.ffn, world_size
    return {
        "python": sys.version.split()[0],
        "pytorch": torch.__version__,
        "platform": platform.platform(),
        "backend": "gloo",
        "world_size": w,
        "block_path": "pre-RMSNorm -> fused gate/up -> SwiGLU -> down projection -> residual add",
        "dense_shapes": {
            "x": [s, b, h],
            "norm_weight": [h],
            "w_gate_up": [2, f, h],
            "w_down": [h, f],
            "output": [s, b, h],
        },
        "rank_local_shapes": {
            "gate_up_weight": [2, f // w, h],
            "gate": [s, b, f // w],
            "up": [s, b, f // w],
            "swiglu": [s, b, f // w],
            "down_weight": [h, f // w],
            "partial_output": [s, b, h],
        },
        "collectives": [
            "row-parallel forward: all-reduce partial down-projection outputs",
            "column-parallel backward: all-reduce hidden-state gradient before RMSNorm",
        ],
        "not_included": NOT_INCLUDED,
        "blocks": describe_blocks("tiny", world_size),
    }


def describe_blocks(preset: str, world_size: int) -> dict:
    """For each block: dense and per-rank parameter shapes, placement, collectives per phase."""
    out = {}
    for name, block in BLOCKS.items():
        for sp in (False, True) if block.sequence_parallel else (False,):
            spec = CaseSpec(block=name, preset=preset, world_size=world_size, sequence_parallel=sp)
            try:
                case = block.case(spec, config_for(spec))
            except ValueError as e:  # this preset cannot host this block (e.g. no vocab)
                out[spec.name] = {"skipped": str(e)}
                continue
            dense = case.build_dense(torch.float32)
            per_rank = {}
            for rank in range(world_size):
                tp = case.build_tp(TPGroup(rank=rank, world_size=world_size), torch.float32)
                per_rank[rank] = {n: list(p.shape) for n, p in tp.named_parameters()}
            out[f"{name}{'/sp' if sp else ''}"] = {
                "params": {
                    n: {
                        "dense": list(p.shape),
                        "placement": str(case.plan.params[n]),
                        "rank_local": {r: per_rank[r][case.plan.tp_name(n)] for r in per_rank},
                    }
                    for n, p in dense.named_parameters()
                },
                "collectives": {
                    phase: [
                        f"{op} at {site}"
                        for ph, op, site in case.expected_collectives
                        if ph == phase
                    ]
                    for phase in PHASES
                },
            }
    return out
