"""Pattern to avoid: dropout on a sequence-sharded region draws one mask on every rank (plain
torch, documented behaviour).

    python docs/findings/repro_dtensor_sp_dropout.py

Two gloo ranks on CPU, the same `torch.manual_seed(0)` on every rank (as DTensor's random ops
require). A Linear under `RowwiseParallel(output_layouts=Shard(0))` (the sequence-parallel plan
torchtitan uses) returns each rank's sequence shard as a plain local tensor
(`use_local_output=True`, the default). Measured:
  pattern to avoid: `nn.Dropout` on that local shard draws from the default generator, which is
  in the same state on every rank: every shard gets the same mask;
  DTensor route on CPU: the dropout parallelized with `SequenceParallel(sequence_dim=0)` runs on a
  DTensor, but DTensor's RNG supports CUDA-like devices only (documented): the same masks on CPU;
  recommended pattern: the dropout under `torch.random.fork_rng()` with a per-rank seed: the
  masks differ, and the default generator is left in the same state on every rank (re-seeding
  per rank without fork_rng would leave it different, against what DTensor's random ops need).
Exit 0: reproduced and the recommended pattern verified; 1: not reproduced; 2: it did not verify.
"""

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel, parallelize_module

SEQ, HIDDEN, SEED = 8, 16, 0


def same_on_every_rank(t: torch.Tensor, world: int) -> bool:
    gathered = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(gathered[0], g) for g in gathered)


def mask(out: torch.Tensor) -> torch.Tensor:
    return (out != 0).to(torch.uint8)


def run(rank: int, world: int, port: int, result) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(SEED)  # the training script: the same seed on every rank
    mesh = init_device_mesh("cpu", (world,))
    proj = parallelize_module(
        nn.Linear(HIDDEN, HIDDEN, bias=False), mesh, RowwiseParallel(output_layouts=Shard(0))
    )
    x_local = torch.randn(SEQ, HIDDEN // world)  # [seq, hidden/world]: input sharded on features
    out = proj(x_local)  # [seq/world, hidden]: this rank's sequence shard, a local tensor
    ones = torch.ones_like(out)

    avoid = same_on_every_rank(mask(nn.Dropout(0.5)(ones)), world)

    with warnings.catch_warnings():  # "DTensor random operators may not have complete support"
        warnings.simplefilter("ignore")
        sp_drop = parallelize_module(nn.Dropout(0.5), mesh, SequenceParallel(sequence_dim=0))
        dtensor_route = same_on_every_rank(mask(sp_drop(ones).to_local()), world)

    with torch.random.fork_rng():  # recommended: a per-rank stream for the sharded region
        torch.manual_seed(SEED + 1000 + rank)
        recommended = same_on_every_rank(mask(nn.Dropout(0.5)(ones)), world)
    state_synced = same_on_every_rank(torch.get_rng_state(), world)
    torch.manual_seed(SEED + 1000 + rank)  # the same per-rank seed without fork_rng
    nn.Dropout(0.5)(ones)
    naive_synced = same_on_every_rank(torch.get_rng_state(), world)
    if rank == 0:
        result.update(
            kind=f"{type(out).__name__} {list(out.shape)}",
            avoid=avoid,
            dtensor_route=dtensor_route,
            recommended=recommended,
            state_synced=state_synced,
            naive_synced=naive_synced,
        )
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    print(f"torch {torch.__version__}, 2 gloo ranks on CPU")
    r = mp.Manager().dict()
    mp.start_processes(run, args=(2, free_port(), r), nprocs=2, start_method="fork")
    print(f"SP rowwise output on each rank: {r['kind']}")
    print(f"pattern to avoid (dropout on the local shard): masks identical: {r['avoid']}")
    print(f"DTensor route on CPU (SequenceParallel dropout): masks identical: {r['dtensor_route']}")
    print(f"recommended (fork_rng + per-rank seed): masks identical: {r['recommended']}")
    print(f"  default generator state after it identical on every rank: {r['state_synced']}")
    print(f"  the same per-rank seed without fork_rng: state identical: {r['naive_synced']}")
    if not r["avoid"]:
        print("NOT REPRODUCED: the sequence shards draw different masks")
        return 1
    print("REPRODUCED: dropout on the local sequence shard draws the same mask on every rank")
    ok = not r["recommended"] and r["state_synced"]
    print(
        f"FIX {'VERIFIED' if ok else 'FAILED'} (recommended pattern): a per-rank RNG stream for "
        "the sequence-sharded dropout (torch.random.fork_rng + a per-rank seed)"
    )
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
