"""Launching ranks: a reusable pool of forked gloo ranks, or the ranks torchrun started.

Pool: for each world size, `world` processes are forked from this one (after `import torch`, so a
rank starts in milliseconds) and join one gloo group through a FileStore in a fresh temp directory
(no port to pick, so concurrent checks cannot collide). Cases are sent to every rank through a
queue; each rank sends back its checks. The pool is reused for the next case of that world size.

Bounded: every collective has the process group's timeout; the parent waits at most
`2 * timeout + 10` s for a case, then kills the ranks. A rank that raises sends its traceback; one
that dies (os._exit, a signal) is noticed through its exit code. Either way the pool is torn down
(its group may be out of step) and a fresh one serves the next case.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

from tpcheck.check.case import CaseSpec
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup

DEFAULT_TIMEOUT_S = 20.0
MAX_WORLD_SIZE = 64


def _is_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "timed out" in text or "timeout" in text or "deadline" in text


def run_spec_on_rank(spec: CaseSpec, group: TPGroup) -> dict:
    """Build and run one case on this rank; never raises: failures come back as data."""
    from tpcheck.check.registry import build_case
    from tpcheck.check.runner import CollectiveMismatch, run_case_on_rank

    group.interceptor, group.last_collective = None, None
    try:
        return {"status": "ok", **run_case_on_rank(build_case(spec), group)}
    except UsageError as e:
        return {"status": "usage", "rank": group.rank, "message": str(e)}
    except CollectiveMismatch as e:
        return {"status": "hang", "rank": group.rank, "message": str(e), "last_collective": group.last_collective}
    except Exception as e:  # noqa: BLE001 - a rank's failure is a result, reported with its traceback
        status = "hang" if _is_timeout(e) else "error"
        return {"status": status, "rank": group.rank, "message": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(), "last_collective": group.last_collective}


def _worker(rank: int, world: int, store_path: str, tasks, results, timeout_s: float) -> None:
    code = 0
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        group = TPGroup(rank=rank, world_size=world, pg=dist.group.WORLD, store=store, timeout_s=timeout_s)
        while (spec := tasks.get()) is not None:
            results.put(run_spec_on_rank(spec, group))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        results.put({"status": "error", "rank": rank, "message": "rank failed outside a case",
                     "traceback": traceback.format_exc()})
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's slow (and, with gloo, sometimes aborting) interpreter exit


class RankPool:
    """`world` forked rank processes sharing one gloo group."""

    def __init__(self, world: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        ctx = mp.get_context("fork")
        self.world, self.timeout_s = world, timeout_s
        self.tmpdir = tempfile.mkdtemp(prefix="tpcheck-")
        store = os.path.join(self.tmpdir, "store")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_worker, args=(r, world, store, self.tasks[r], self.results, timeout_s),
                                  daemon=True, name=f"tpcheck-rank{r}") for r in range(world)]
        for p in self.procs:
            p.start()
        self.healthy = True

    def run(self, spec: CaseSpec) -> list[dict]:
        """Run one case on every rank; returns one payload per rank (synthesised for dead ranks)."""
        for q in self.tasks:
            q.put(spec)
        got: dict[int, dict] = {}
        deadline = time.monotonic() + 2 * self.timeout_s + 10
        while len(got) < self.world and time.monotonic() < deadline:
            try:
                msg = self.results.get(timeout=0.05)
                got.setdefault(msg["rank"], msg)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None and r not in got]
            if dead:  # give the others a moment to report, then stop waiting
                deadline = min(deadline, time.monotonic() + 1.0)
                for r in dead:
                    got.setdefault(r, _death(r, self.procs[r].exitcode))
        for r in range(self.world):
            got.setdefault(r, {"status": "hang", "rank": r, "message":
                               f"rank {r} gave no result within {2 * self.timeout_s + 10:.0f} s; killed"})
        payloads = [got[r] for r in range(self.world)]
        if any(p["status"] != "ok" for p in payloads):
            self.healthy = False  # the group may be out of step: never reuse it
        return payloads

    def close(self) -> None:
        if self.healthy:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        for q in [self.results, *self.tasks]:
            q.close()
            q.cancel_join_thread()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _death(rank: int, exitcode: int) -> dict:
    how = f"killed by signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exited with code {exitcode}"
    return {"status": "crash", "rank": rank, "message": f"rank {rank} died ({how}) before reporting"}


class Launcher:
    """Runs specs on pools, one pool per world size, respawning a pool after any failure."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.pools: dict[int, RankPool] = {}

    def run(self, spec: CaseSpec) -> list[dict]:
        check_world_size(spec.world_size)
        pool = self.pools.get(spec.world_size)
        if pool is None:
            pool = self.pools[spec.world_size] = RankPool(spec.world_size, self.timeout_s)
        payloads = pool.run(spec)
        if not pool.healthy:
            pool.close()
            del self.pools[spec.world_size]
        return payloads

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_world_size(world: int) -> None:
    if not 1 <= world <= MAX_WORLD_SIZE:
        raise UsageError(f"world size {world} is outside 1..{MAX_WORLD_SIZE}: each rank is a process on this "
                         f"machine ({os.cpu_count()} CPUs); choose a smaller world size")


# ---------------------------------------------------------------------------- torchrun


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class TorchrunLauncher:
    """The ranks were started by torchrun: this process is one of them. Every rank runs every case;
    rank 0 gathers the payloads (other ranks get None back)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        self.group_args = (dist.get_rank(), dist.get_world_size())
        self.timeout_s, self.group = timeout_s, None

    @property
    def rank(self) -> int:
        return self.group_args[0]

    def run(self, spec: CaseSpec) -> list[dict] | None:
        rank, world = self.group_args
        if spec.world_size != world:
            raise UsageError(f"torchrun started {world} ranks but the case asks for world size {spec.world_size}; "
                             f"pass --world-size {world} or change --nproc_per_node")
        if self.group is None:
            self.group = TPGroup(rank=rank, world_size=world, pg=dist.group.WORLD,
                                 store=dist.distributed_c10d._get_default_store(), timeout_s=self.timeout_s)
        payload = run_spec_on_rank(spec, self.group)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(payload, gathered, dst=0)
        return gathered

    def broadcast_code(self, code: int) -> int:
        box = [code]
        dist.broadcast_object_list(box, src=0)
        return int(box[0])

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
