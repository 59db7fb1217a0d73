"""Launching ranks: a reusable pool of forked ranks, or the ranks torchrun started.

Pool: for each world size and device, `world` processes are forked from this one (after
`import torch`, so a rank starts in milliseconds) and join one group (gloo; on GPUs NCCL beside it,
checker/devices.py) through a FileStore in a fresh temp directory (no port to pick, so concurrent
checks cannot collide). Each rank talks to the parent over its own pipe: cases go down, results and
progress notes come up. Pipes, not `multiprocessing.Queue`: a Queue's feeder thread may still hold a
lock (or unsent data) when the parent forks the next pool, or when a rank calls `os._exit`;
`Connection.send` is synchronous, so neither can happen.

Never hang: every collective has the process group's timeout, and the checker's checkpoints wait on
the store with the same timeout, so a rank stuck in a collective reports "hang" by itself. Each rank
also sends heartbeats (heartbeat.py: where it is, from its Python stack). When a rank's wait times
out, the parent decides at once from the others' latest beats -- who was computing, silent, or
waiting elsewhere -- and kills them: a hang is reported within `timeout` + about a second. The
parent is also the backstop for a case in which no rank waits: no stack moving and no progress for
`timeout + 4` s is a hang (world 1, which has no collective, gets 10 times that; `stall_s` overrides
it). After a crash or an error the others get 1 s (they only wait for the dead rank), then are
stopped. A pool that saw any problem is torn down (its group may be out of step) and a fresh one
serves the next case.

Ranks die with the parent (PR_SET_PDEATHSIG, plus a parent-pid check while idle): a killed check
leaves no process behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from tpcheck.checker.case import CaseSpec, Resolver
from tpcheck.checker.devices import backend, check_device, rank_device
from tpcheck.checker.payload import RankPayload
from tpcheck.checker.pool.heartbeat import Beat, Watch, spot_of_dump
from tpcheck.checker.pool.spawn import TEMP_DIRS, Ranks, fault_path, recv_plain, send_plain
from tpcheck.checker.pool.worker import Build, RankState, pool_rank
from tpcheck.checker.sync import Rendezvous
from tpcheck.checker.verdict.hangs import describe
from tpcheck.errors import UsageError

DEFAULT_TIMEOUT_S = 20.0
MAX_LIVE_RANKS = 16  # rank processes a Launcher keeps alive at once, over all its pools
# The bounds of a timeout (seconds any collective may wait), their one definition: the Launcher
# refuses a timeout outside them, and `tpcheck --timeout` does before any rank starts. Below 1 s a
# correct implementation is reported as a false hang; an hour is far past any real collective.
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 3600.0


# ---------------------------------------------------------------------------- the pool


def _preload() -> None:
    """Import, once in the parent, torch's lazily imported optimizer machinery (torch._dynamo,
    seconds). Forked ranks inherit it, so a respawned pool serves its first case in
    milliseconds, not seconds."""
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


class RankPool:
    """`world` forked rank processes sharing one group on `device`; `resolve` turns a spec into a
    Case on a rank."""

    def __init__(
        self,
        world: int,
        resolve: Build,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        stall_s: float | None = None,
        device: str = "cpu",
    ) -> None:
        _preload()
        self.world, self.timeout_s, self.stall_s = world, timeout_s, stall_s
        self.ranks = Ranks(world, pool_rank, (timeout_s, resolve, device))
        self.conns, self.procs = self.ranks.conns, self.ranks.procs
        self.healthy = True
        self.cases = 0  # cases sent, counted alike by the ranks: their beats carry it

    def run(self, spec: CaseSpec) -> list[RankPayload]:
        """Run one case on every rank; returns one payload
        per rank (synthesised for dead or killed ranks)."""
        self.cases += 1
        watch = Watch(self.world, self.cases, self.timeout_s, stall_s=self.stall_s)
        for conn in self.conns:
            try:
                send_plain(conn, spec)
            except OSError:
                pass  # that rank is dead: its sentinel says so below
        got = self._collect(watch)
        self._synthesise(got, watch)
        payloads = [got[r] for r in range(self.world)]
        if any(p.status != "ok" for p in payloads):
            self.healthy = False  # the group may be out of step: never reuse it
        if any(p.threads_left for p in payloads):
            self.healthy = False  # a thread the case started still runs there
        return payloads

    def _collect(self, watch: Watch) -> dict[int, RankPayload]:
        """Wait for every rank's result, a death, a hang, or the stall deadline; returns the
        results. A rank whose wait timed out ends the wait at once: the others' beats
        say where they are."""
        got: dict[int, RankPayload] = {}
        # after a crash or an error: the others get a short grace, then are stopped
        failed_by = None
        while len(got) < self.world:
            deadline = watch.deadline() if failed_by is None else failed_by
            left = deadline - time.monotonic()
            if left <= 0:
                break
            pending = {c: r for r, c in enumerate(self.conns) if r not in got}
            sentinels = {self.procs[r].sentinel: r for r in pending.values()}
            for obj in wait([*pending, *sentinels], timeout=min(left, 1.0)):
                r = pending.get(obj, sentinels.get(obj))
                if r in got:
                    continue
                msg = self._drain(r, watch)
                if msg is None and obj in sentinels:
                    self.procs[r].join(timeout=1)
                    msg = self._drain(r, watch) or _death(r, self.procs[r].exitcode)
                if msg is None:
                    continue
                got[r] = msg
                if msg.status == "hang":
                    for q in range(self.world):  # results already sent by the others, then decide
                        if q not in got and (late := self._drain(q, watch)) is not None:
                            got[q] = late
                    return got
                if msg.status != "ok" and failed_by is None:
                    failed_by = time.monotonic() + 1.0  # the others only wait for this rank now
        return got

    def _drain(self, r: int, watch: Watch) -> RankPayload | None:
        """Read rank r's pipe: beats go to the watch; returns its result if one came."""
        conn = self.conns[r]
        try:
            while conn.poll():
                msg = recv_plain(conn)
                if isinstance(msg, Beat):
                    watch.note(msg)
                else:
                    return msg
        except (EOFError, OSError):
            pass
        return None

    def _synthesise(self, got: dict[int, RankPayload], watch: Watch) -> None:
        """Payloads for ranks that gave none (stopped after another rank's failure, or stuck), and
        the parent's evidence of where each rank was (heartbeat.py) on every payload of a hang."""
        failed = sorted(r for r, p in got.items() if p.status not in ("ok", "hang"))
        for r in range(self.world):
            e = watch.evidence(r, self.procs[r].pid)
            # False: the launcher's evidence alone (the rank was stopped)
            e["own_report"] = r in got
            if r in got:
                if got[r].status == "hang":
                    got[r].where = e
                elif got[r].status == "crash":  # died: where its stacks or last beat say it was
                    got[r].where = self._died_at(r) or e
                    got[r].ledger, got[r].has_ledger = list(watch.ledgers[r]), r in watch.beats
                continue
            if failed:
                got[r] = RankPayload(
                    status="aborted",
                    rank=r,
                    ledger=list(watch.ledgers[r]),
                    has_ledger=r in watch.beats,
                    where=e,
                    message=f"rank {r} was stopped: still running after rank(s) {failed} failed; "
                    f"{describe(e)}",
                )
                continue
            label = e.get("op") and (e["op"], e["site"], e["phase"])
            got[r] = RankPayload(
                status="hang",
                rank=r,
                message=describe(e),
                where=e,
                waiting_in=e["state"],
                checkpoint=e.get("checkpoint"),
                last_collective=label or None,
                ledger=list(watch.ledgers[r]),
                has_ledger=r in watch.beats,
            )

    def _died_at(self, r: int) -> dict | None:
        """Where rank r's main thread was when it was killed, from the stacks its faulthandler
        dumped (an abort by the collective library), as heartbeat evidence; None without a dump."""
        try:
            with open(fault_path(self.ranks.store_path, r)) as f:
                spot = spot_of_dump(f.read())
        except OSError:
            return None
        if spot is None:
            return None
        e = {"rank": r, "state": spot.state, "at": spot.at, "stack": spot.stack, "dumped": True}
        return {**e, "call": spot.call} if spot.call else e

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
    return RankPayload(
        status="crash",
        rank=rank,
        message=f"rank {rank} died ({how}) before reporting",
        has_ledger=False,
    )


class Launcher:
    """Runs specs on pools, one pool per world size and device, respawning a pool after any failure.
    The resolver checks each spec in the parent first and turns it into a Case on each rank
    (`tpcheck.resolve`: the checker itself knows no block and no fault)."""

    def __init__(
        self, resolver: Resolver, timeout_s: float = DEFAULT_TIMEOUT_S, stall_s: float | None = None
    ) -> None:
        number = isinstance(timeout_s, (int, float))
        if not (number and MIN_TIMEOUT_S <= timeout_s <= MAX_TIMEOUT_S):
            raise UsageError(
                f"timeout {timeout_s!r} must be between {MIN_TIMEOUT_S:g} and "
                f"{MAX_TIMEOUT_S:g} seconds: it is how long any collective may wait"
            )
        self.resolver = resolver
        self.timeout_s, self.stall_s = float(timeout_s), stall_s
        self.pools: dict[tuple[int, str], RankPool] = {}
        self.max_live_ranks = MAX_LIVE_RANKS  # `Lanes` shares it among its launchers
        self.cache = CompileCache()

    def run(self, spec: CaseSpec) -> list[RankPayload]:
        try:
            self.resolver.validate(spec)
        # one bad case of a matrix is an "invalid" result; the rest still run
        except UsageError as e:
            return [RankPayload(status="usage", rank=0, message=str(e))]
        key = (spec.world_size, spec.device)
        pool = self.pools.pop(key, None)  # re-inserted last: the pools stay in order of last use
        if pool is None:
            self._make_room(spec.world_size)
            pool = RankPool(
                spec.world_size, self.resolver.build, self.timeout_s, self.stall_s, spec.device
            )
        self.pools[key] = pool
        payloads = pool.run(spec)
        if not pool.healthy:
            pool.close()
            del self.pools[key]
        return payloads

    def _make_room(self, world: int) -> None:
        """Close the least recently used pools while a pool of `world` ranks would put more than
        `max_live_ranks` (MAX_LIVE_RANKS) ranks alive: each rank's memory grows with the cases it
        has run (~1 MB a case), and a sweep over world sizes 1..8 kept 36 ranks alive, more than the
        machine's memory held (their false "hangs" were ranks stalled on paging)."""
        live = self.max_live_ranks
        while self.pools and sum(p.world for p in self.pools.values()) + world > live:
            self.pools.pop(next(iter(self.pools))).close()

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
        self.cache.remove()

    def abort(self) -> None:
        """Stop every rank now (an interrupt): no goodbye to the ranks, no waiting for them."""
        for pool in list(self.pools.values()):  # a copy: `Lanes` may abort from another thread
            pool.ranks.kill()
        self.pools.clear()
        self.cache.remove()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, exc_type, *rest) -> None:
        # KeyboardInterrupt, a signal
        if exc_type is not None and not issubclass(exc_type, Exception):
            self.abort()
        else:
            self.close()


class CompileCache:
    """Torch's compile cache (TORCHINDUCTOR_CACHE_DIR) in a private temp dir, removed with the
    launcher, unless the user chose one: otherwise every run leaves
    torchinductor_<user> in $TMPDIR."""

    VAR = "TORCHINDUCTOR_CACHE_DIR"

    def __init__(self) -> None:
        self.path = None
        if self.VAR not in os.environ:
            self.path = tempfile.mkdtemp(prefix="tpcheck-inductor-")
            os.environ[self.VAR] = self.path
            TEMP_DIRS.add(self.path)

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            TEMP_DIRS.discard(self.path)
            if os.environ.get(self.VAR) == self.path:
                del os.environ[self.VAR]
            self.path = None


# ---------------------------------------------------------------------------- torchrun


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class TorchrunLauncher:
    """The ranks were started by torchrun: this process is one of them. Every rank runs every case;
    rank 0 gathers the payloads (other ranks get None back). On a machine with GPUs the group has
    NCCL beside gloo, and a rank's GPU is its LOCAL_RANK, so cases may run on either device."""

    def __init__(self, resolver: Resolver, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world = int(
            os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
        )
        if not dist.is_initialized():
            gpus = dist.is_nccl_available() and torch.cuda.device_count() >= self.local_world
            device = "cuda" if gpus else "cpu"
            rank_device(device, self.local_rank)
            dist.init_process_group(backend(device), timeout=timedelta(seconds=timeout_s))
        self.backends = str(dist.get_backend())
        self.group_args = (dist.get_rank(), dist.get_world_size())
        self.resolver, self.timeout_s, self.state = resolver, timeout_s, None

    @property
    def rank(self) -> int:
        return self.group_args[0]

    def run(self, spec: CaseSpec) -> list[RankPayload] | None:
        rank, world = self.group_args
        if spec.world_size != world:
            raise UsageError(
                f"torchrun started {world} ranks but the case asks for world size "
                f"{spec.world_size}; pass --world-size {world} or change --nproc_per_node"
            )
        if spec.device == "cuda":
            check_device("cuda", world, local_world=self.local_world, forking=False)
            if "nccl" not in self.backends:
                raise UsageError(
                    f"--device cuda: the process group has no NCCL backend ({self.backends}); "
                    "start torchrun on a machine with one GPU per local rank"
                )
        if self.state is None:
            store = dist.distributed_c10d._get_default_store()
            self.state = RankState(
                rank,
                world,
                dist.group.WORLD,
                Rendezvous(store, rank, world, self.timeout_s),
                local_rank=self.local_rank,
            )
        payload = self.state.run(spec, self.resolver.build)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(payload, gathered, dst=0)
        return gathered

    def share(self, value):
        """Rank 0's `value` on every rank (what every rank must decide alike, e.g. the spec of a
        case's float64 run, which only rank 0's results tell)."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_code(self, code: int) -> int:
        box = [code]
        dist.broadcast_object_list(box, src=0)
        return int(box[0])

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
