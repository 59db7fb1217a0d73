"""Dropout after a DTensor sequence-parallel output draws the same mask on every rank (plain torch).

    python docs/findings/repro_dtensor_sp_dropout.py

Two gloo ranks on CPU. A Linear under `RowwiseParallel(output_layouts=Shard(0))` (torchtitan's SP
plan) returns each rank's sequence shard as a local tensor; `nn.Dropout` on it draws from the
default generator, which a training script seeds the same on every rank. Prints each rank's mask:
they are identical, so token t of rank 0 and token t + s/2 of rank 1 are always dropped together.
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def run(rank: int, world: int, port: int) -> None:
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
    mask = nn.Dropout(0.5)(torch.ones_like(out)) != 0
    masks = [torch.empty_like(mask, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(masks, mask.to(torch.uint8))
    if rank == 0:
        print(f"output on each rank: {type(out).__name__} {list(out.shape)}")
        print(
            f"masks of the {world} sequence shards identical: "
            f"{all(torch.equal(masks[0], m) for m in masks)}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(2, 29533), nprocs=2)
