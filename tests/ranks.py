"""Run a function on N forked gloo ranks in a test; returns each rank's return value."""
from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcheck.parallel.group import TPGroup


def _entry(fn, rank, world, store, q, args):
    try:
        torch.set_num_threads(1)  # libgomp is not fork-safe (see tpcheck.check.worker)
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        out = fn(TPGroup(rank=rank, world_size=world, pg=dist.group.WORLD), *args)
        q.put((rank, "ok", out))
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    os._exit(0)


def run_ranks(fn, world: int, *args, timeout: float = 60.0) -> list:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, os.path.join(d, "store"), q, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in range(world):
                rank, status, out = q.get(timeout=timeout)
                if status != "ok":
                    raise AssertionError(f"rank {rank} failed:\n{out}")
                results[rank] = out
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world)]
