"""Dropout after a DTensor sequence-parallel output draws the same mask on every rank (plain torch).

    python docs/findings/repro_dtensor_sp_dropout.py

Two gloo ranks on CPU. A Linear under `RowwiseParallel(output_layouts=Shard(0))` (torchtitan's SP
plan) returns each rank's sequence shard as a local tensor; `nn.Dropout` on it draws from the
default generator, which a training script seeds the same on every rank, so the masks of the
sequence shards are identical: token t of rank 0 and token t + s/2 of rank 1 are always dropped
together. The fix (as Megatron-Core's RNG tracker does): draw the dropout under a per-rank stream,
`torch.random.fork_rng()` + `torch.manual_seed(seed + rank)`; the shards' masks then differ.
Exit 0: reproduced and the fix verified; 1: not reproduced (fixed upstream); 2: reproduced but the
fix did not verify.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def same_on_every_rank(mask: torch.Tensor, world: int) -> bool:
    masks = [torch.empty_like(mask, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(masks, mask.to(torch.uint8))
    return all(torch.equal(masks[0], m) for m in masks)


def run(rank: int, world: int, port: int, result) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    torch.manual_seed(0)  # the training script: the same seed on every rank
    mesh = init_device_mesh("cpu", (world,))
    proj = parallelize_module(
        nn.Linear(16, 16, bias=False), mesh, RowwiseParallel(output_layouts=Shard(0))
    )  # input sharded on features
    x_local = torch.randn(8, 16 // world)  # [seq, hidden/world]
    out = proj(x_local)  # [seq/world, hidden]: this rank's sequence shard, a plain tensor
    as_shipped = same_on_every_rank(nn.Dropout(0.5)(torch.ones_like(out)) != 0, world)
    with torch.random.fork_rng():  # the fix: a per-rank stream for the sequence-sharded region
        torch.manual_seed(1000 + rank)
        fixed = same_on_every_rank(nn.Dropout(0.5)(torch.ones_like(out)) != 0, world)
    if rank == 0:
        result.update(kind=f"{type(out).__name__} {list(out.shape)}", bug=as_shipped, fixed=fixed)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    print(f"torch {torch.__version__}, 2 gloo ranks")
    out = mp.Manager().dict()
    mp.start_processes(run, args=(2, free_port(), out), nprocs=2, start_method="fork")
    print(f"output of the SP rowwise linear on each rank: {out['kind']}")
    print(f"as shipped: masks of the 2 sequence shards identical: {out['bug']}")
    print(f"     fixed: masks of the 2 sequence shards identical: {out['fixed']}")
    if not out["bug"]:
        print("NOT REPRODUCED: the shards draw different masks (fixed upstream?)")
        return 1
    print("REPRODUCED: every sequence shard draws the same dropout mask")
    print(f"FIX {'FAILED' if out['fixed'] else 'VERIFIED'}: a per-rank RNG stream for the dropout")
    return 2 if out["fixed"] else 0


if __name__ == "__main__":
    sys.exit(main())
