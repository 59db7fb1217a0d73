"""Launching ranks: a reusable pool of forked gloo ranks, or the ranks torchrun started.

Pool: for each world size, `world` processes are forked from this one (after `import torch`, so a
rank starts in milliseconds) and join one gloo group through a FileStore in a fresh temp directory
(no port to pick, so concurrent checks cannot collide). Each rank talks to the parent over its own
pipe: cases go down, results and progress notes come up. Pipes, not `multiprocessing.Queue`: a
Queue's feeder thread may still hold a lock (or unsent data) when the parent forks the next pool, or
when a rank calls `os._exit`; `Connection.send` is synchronous, so neither can happen.

Never hang: every collective has the process group's timeout, and the checker's checkpoints wait on
the store with the same timeout, so a rank stuck in a collective reports "hang" by itself. The parent
is the backstop: it waits on the ranks' pipes and exit sentinels, never longer than `stall_s`
(default 2 * timeout + 10 s) without progress (a rank entering a collective or passing a checkpoint;
a world-1 case, which has none, gets 10 * stall_s in all). After the first problem it gives the other
ranks a short grace (timeout + 2 s after a hang, so their own diagnosis arrives; 1 s after a crash,
since they only wait for the dead rank), then kills the stragglers. A pool that saw any problem is
torn down (its group may be out of step) and a fresh one serves the next case.

Ranks die with the parent (PR_SET_PDEATHSIG, plus a parent-pid check while idle): a killed check
leaves no process behind.
"""
from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from multiprocessing.connection import wait

import torch.distributed as dist

from tpcheck.check.case import CaseSpec, Resolver
from tpcheck.check.result import RankPayload
from tpcheck.check.spawn import Ranks, recv_plain, send_plain
from tpcheck.check.sync import Rendezvous
from tpcheck.check.worker import Build, RankState, pool_rank
from tpcheck.errors import UsageError

DEFAULT_TIMEOUT_S = 20.0


# ---------------------------------------------------------------------------- the pool


def _preload() -> None:
    """Import, once in the parent, torch's lazily imported optimizer machinery (torch._dynamo, seconds).
    Forked ranks inherit it, so a respawned pool serves its first case in milliseconds, not seconds."""
    import torch

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


class RankPool:
    """`world` forked rank processes sharing one gloo group; `resolve` turns a spec into a Case on a rank."""

    def __init__(self, world: int, resolve: Build, timeout_s: float = DEFAULT_TIMEOUT_S,
                 stall_s: float | None = None) -> None:
        _preload()
        self.world, self.timeout_s = world, timeout_s
        self.stall_s = stall_s if stall_s is not None else 2 * timeout_s + 10
        self.ranks = Ranks(world, pool_rank, (timeout_s, resolve))
        self.conns, self.procs = self.ranks.conns, self.ranks.procs
        self.healthy = True

    def run(self, spec: CaseSpec) -> list[RankPayload]:
        """Run one case on every rank; returns one payload per rank (synthesised for dead or killed ranks)."""
        for conn in self.conns:
            try:
                send_plain(conn, spec)
            except OSError:
                pass  # that rank is dead: its sentinel says so below
        got, seen = self._collect()
        self._synthesise(got, seen)
        payloads = [got[r] for r in range(self.world)]
        if any(p.status != "ok" for p in payloads):
            self.healthy = False  # the group may be out of step: never reuse it
        return payloads

    def _collect(self) -> tuple[dict[int, RankPayload], dict[int, tuple]]:
        """Wait for every rank's result, a death, or the deadline; returns results and last spots seen."""
        got: dict[int, dict] = {}
        seen: dict[int, tuple] = {}
        # world 1 issues no collective, hence no progress note: one fixed, longer deadline
        deadline = time.monotonic() + (10 * self.stall_s if self.world == 1 else self.stall_s)
        while len(got) < self.world and (left := deadline - time.monotonic()) > 0:
            pending = {c: r for r, c in enumerate(self.conns) if r not in got}
            sentinels = {self.procs[r].sentinel: r for r in pending.values()}
            for obj in wait([*pending, *sentinels], timeout=left):
                r = pending.get(obj, sentinels.get(obj))
                if r in got:
                    continue
                msg = self._read(r)
                if msg is None and obj in sentinels:
                    self.procs[r].join(timeout=1)
                    msg = _death(r, self.procs[r].exitcode)
                if msg is None:
                    continue
                if isinstance(msg, tuple):  # ("progress", rank, last_collective)
                    seen[r] = msg[2]
                    if self.world > 1 and all(p.status == "ok" for p in got.values()):
                        deadline = time.monotonic() + self.stall_s
                    continue
                got[r] = msg
                if msg.status != "ok":
                    grace = self.timeout_s + 2 if msg.status == "hang" else 1.0
                    deadline = min(deadline, time.monotonic() + grace)
        return got, seen

    def _read(self, r: int):
        conn = self.conns[r]
        try:
            return recv_plain(conn) if conn.poll() else None
        except (EOFError, OSError):
            return None

    def _synthesise(self, got: dict[int, RankPayload], seen: dict[int, tuple]) -> None:
        """Payloads for ranks that gave none: killed after another rank's failure, or after the deadline."""
        failed = sorted(r for r, p in got.items() if p.status != "ok")
        for r in range(self.world):
            if r in got:
                continue
            spot = seen.get(r)
            where = f"; last seen in {spot[2]} {spot[0]} at {spot[1]!r}" if spot else ""
            if failed:
                got[r] = RankPayload(status="aborted", rank=r, last_collective=spot, has_ledger=False,
                                     message=f"rank {r} was stopped: still running after rank(s) {failed} failed{where}")
            else:
                got[r] = RankPayload(status="hang", rank=r, last_collective=spot, waiting_in="unknown", has_ledger=False,
                                     message=f"rank {r} gave no result and no sign of progress "
                                     f"for {self.stall_s:g} s (stuck outside any collective?){where}; killed")

    def close(self) -> None:
        if self.healthy:
            for conn in self.conns:
                try:
                    send_plain(conn, None)
                except OSError:
                    pass
            for p in self.procs:
                p.join(timeout=5)
        self.ranks.kill()


def _death(rank: int, exitcode: int | None) -> RankPayload:
    if exitcode is None:
        how = "its pipe closed"
    elif exitcode < 0:
        how = f"killed by signal {signal.Signals(-exitcode).name}"
    else:
        how = f"exited with code {exitcode}"
    return RankPayload(status="crash", rank=rank, message=f"rank {rank} died ({how}) before reporting", has_ledger=False)


class Launcher:
    """Runs specs on pools, one pool per world size, respawning a pool after any failure. The resolver
    checks each spec in the parent first and turns it into a Case on each rank (`tpcheck.resolve`: the
    checker itself knows no block and no fault)."""

    def __init__(self, resolver: Resolver, timeout_s: float = DEFAULT_TIMEOUT_S,
                 stall_s: float | None = None) -> None:
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 3600):
            raise UsageError(f"timeout {timeout_s!r} must be in (0, 3600] seconds")
        self.resolver = resolver
        self.timeout_s, self.stall_s = float(timeout_s), stall_s
        self.pools: dict[int, RankPool] = {}

    def run(self, spec: CaseSpec) -> list[RankPayload]:
        try:
            self.resolver.validate(spec)
        except UsageError as e:  # one bad case of a matrix is an "invalid" result; the rest still run
            return [RankPayload(status="usage", rank=0, message=str(e))]
        pool = self.pools.get(spec.world_size)
        if pool is None:
            pool = self.pools[spec.world_size] = RankPool(spec.world_size, self.resolver.build, self.timeout_s,
                                                              self.stall_s)
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


# ---------------------------------------------------------------------------- torchrun


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class TorchrunLauncher:
    """The ranks were started by torchrun: this process is one of them. Every rank runs every case;
    rank 0 gathers the payloads (other ranks get None back)."""

    def __init__(self, resolver: Resolver, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        self.group_args = (dist.get_rank(), dist.get_world_size())
        self.resolver, self.timeout_s, self.state = resolver, timeout_s, None

    @property
    def rank(self) -> int:
        return self.group_args[0]

    def run(self, spec: CaseSpec) -> list[RankPayload] | None:
        rank, world = self.group_args
        if spec.world_size != world:
            raise UsageError(f"torchrun started {world} ranks but the case asks for world size {spec.world_size}; "
                             f"pass --world-size {world} or change --nproc_per_node")
        if self.state is None:
            store = dist.distributed_c10d._get_default_store()
            self.state = RankState(rank, world, dist.group.WORLD, Rendezvous(store, rank, world, self.timeout_s))
        payload = self.state.run(spec, self.resolver.build)
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
