"""What `tpcheck run --mode inspect` prints: the seed's inspect payload, plus every block's dense and
per-rank parameter shapes, placements and collectives per phase."""
from __future__ import annotations

import platform
import sys

import torch

from tpcheck.check.case import CaseSpec
from tpcheck.models.cases import BLOCKS, COLLECTIVES, config_for
from tpcheck.parallel.group import TPGroup

NOT_INCLUDED = ["CUDA/NCCL (untested on this CPU machine)", "mixed precision (autocast, float32 master weights)",
                "fused kernels", "pipeline and data parallelism"]


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
        "dense_shapes": {"x": [s, b, h], "norm_weight": [h], "w_gate_up": [2, f, h], "w_down": [h, f],
                         "output": [s, b, h]},
        "rank_local_shapes": {"gate_up_weight": [2, f // w, h], "gate": [s, b, f // w], "up": [s, b, f // w],
                              "swiglu": [s, b, f // w], "down_weight": [h, f // w], "partial_output": [s, b, h]},
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
    for block in BLOCKS:
        for sp in (False, True):
            spec = CaseSpec(block=block, preset=preset, world_size=world_size, sequence_parallel=sp)
            try:
                case = BLOCKS[block](spec, config_for(spec))
            except ValueError as e:  # this preset cannot host this block (e.g. no vocab)
                out[spec.name] = {"skipped": str(e)}
                continue
            dense = case.build_dense(torch.float32)
            per_rank = {}
            for rank in range(world_size):
                tp = case.build_tp(TPGroup(rank=rank, world_size=world_size), torch.float32)
                per_rank[rank] = {n: list(p.shape) for n, p in tp.named_parameters()}
            # the case's own list when it has one: it knows the config and world size
            collectives = case.expected_collectives or COLLECTIVES[block](sp)
            out[f"{block}{'/sp' if sp else ''}"] = {
                "params": {n: {"dense": list(p.shape), "placement": str(case.plan.params[n]),
                               "rank_local": {r: per_rank[r][case.plan.tp_name(n)] for r in per_rank}}
                           for n, p in dense.named_parameters()},
                "collectives": {phase: [f"{op} at {site}" for ph, op, site in collectives if ph == phase]
                                for phase in ("forward", "backward", "optimizer")},
            }
    return out
