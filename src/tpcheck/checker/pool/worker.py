"""The rank side of the pool: a forked process that joins the group (gloo; NCCL too on GPUs), then
runs the cases the parent sends until told to stop (or until the parent is gone).

Talks to the parent over one pipe with plain payloads (see spawn.py). A heartbeat thread sends where
the rank is a few times a second (heartbeat.py), so the parent can tell a slow rank from a stuck one
and, when a wait times out, name the rank that holds the others up.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch.distributed as dist

from tpcheck.checker.case import Case, CaseSpec
from tpcheck.checker.devices import rank_device
from tpcheck.checker.payload import RankPayload
from tpcheck.checker.pool import spawn
from tpcheck.checker.pool.heartbeat import BEAT_S, BeatMaker, main_frame
from tpcheck.checker.pool.spawn import join_group, recv_plain, send_plain
from tpcheck.checker.rank.engine import run_case_on_rank
from tpcheck.checker.rank.ledger import CollectiveMismatch, CollectiveTap, count_user_collectives
from tpcheck.checker.sync import PeerFailed, Rendezvous
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup

Build = Callable[[CaseSpec], Case]  # the resolver's build


def _is_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "timed out" in text or "timeout" in text or "deadline" in text


class RankState:
    """What this rank is doing now: the tap of the case
    in progress (the progress thread reads it)."""

    def __init__(
        self, rank: int, world: int, pg, rendezvous: Rendezvous, local_rank: int | None = None
    ) -> None:
        self.rank, self.world, self.pg, self.rendezvous = rank, world, pg, rendezvous
        # its GPU, on "cuda" (torchrun: LOCAL_RANK)
        self.local_rank = rank if local_rank is None else local_rank
        self.tap = CollectiveTap(rank)
        self.case = 0  # cases received, counted alike by the parent: beats carry it
        self.beats = BeatMaker(rank)

    def run(self, spec: CaseSpec, resolve: Build) -> RankPayload:
        """Build and run one case on this rank; never raises: failures come back as data, with this
        rank's ledger so the parent can say where the ranks' collectives parted."""
        self.tap = tap = CollectiveTap(self.rank)
        self.case += 1
        try:
            group = TPGroup(
                rank=self.rank,
                world_size=self.world,
                pg=self.pg,
                tap=tap,
                device=rank_device(spec.device, self.local_rank),
            )
            case = resolve(spec)
            done = run_case_on_rank(case, group, self.rendezvous, spawn.THREADS_WHILE_OTHERS_WAIT)
            # what ran, for the report (train=False where the case was checked forward only)
            ran = (
                case.run
                if done.forward_only is None
                else dataclasses.replace(case.run, train=False)
            )
            return dataclasses.replace(done, run=ran)
        except UsageError as e:
            return RankPayload(status="usage", rank=self.rank, message=str(e))
        except PeerFailed as e:
            return RankPayload(status="aborted", rank=self.rank, message=str(e))
        except CollectiveMismatch as e:
            return RankPayload(
                status="hang",
                rank=self.rank,
                message=str(e),
                waiting_in="checkpoint",
                checkpoint=e.checkpoint,
                last_collective=tap.inside,
                ledger=tap.ledger,
            )
        # SIGINT sent to this rank alone (the parent's own Ctrl-C kills ranks)
        except KeyboardInterrupt:
            return RankPayload(
                status="error",
                rank=self.rank,
                traceback=traceback.format_exc(),
                ledger=tap.ledger,
                message=f"rank {self.rank} was interrupted (SIGINT) while running the case",
            )
        except Exception as e:  # noqa: BLE001 - a rank's failure is a result, reported with its traceback
            hang = _is_timeout(e)
            return RankPayload(
                status="hang" if hang else "error",
                rank=self.rank,
                message=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc(),
                last_collective=tap.inside if hang else tap.last,
                ledger=tap.ledger,
                waiting_in="collective" if hang else None,
            )

    def beat(self):
        return self.beats.beat(self.case, self.tap, self.rendezvous, main_frame())


class _Channel:
    """This rank's end of the pipe; a lock because the progress thread sends too."""

    def __init__(self, conn: Connection, parent_pid: int) -> None:
        self.conn, self.parent_pid, self.lock = conn, parent_pid, threading.Lock()

    def send(self, msg) -> None:
        with self.lock:
            send_plain(self.conn, msg)

    def next_task(self) -> CaseSpec | None:
        while not self.conn.poll(1.0):
            if os.getppid() != self.parent_pid:
                return None
        try:
            return recv_plain(self.conn)
        except EOFError:
            return None


def _heartbeat(chan: _Channel, state: RankState) -> None:
    """Tell the parent where this rank is, a few times a second (heartbeat.py)."""
    while True:
        time.sleep(BEAT_S)
        try:
            chan.send(state.beat())
        except OSError:
            return  # the parent is gone: the main thread notices too


def pool_rank(
    rank: int,
    world: int,
    store_path: str,
    conn: Connection,
    timeout_s: float,
    resolve: Build,
    device: str = "cpu",
) -> None:
    """The body of one pool rank (run by spawn.Ranks in the forked process); every case it is sent
    runs on `device`."""
    chan = _Channel(conn, os.getppid())
    try:
        store = join_group(rank, world, store_path, timeout_s, device)
        state = RankState(rank, world, dist.group.WORLD, Rendezvous(store, rank, world, timeout_s))
        count_user_collectives(lambda: state.tap)
        threading.Thread(target=_heartbeat, args=(chan, state), daemon=True).start()
        while (spec := chan.next_task()) is not None:
            chan.send(state.run(spec, resolve))
        dist.destroy_process_group()
    except BaseException:
        try:
            chan.send(
                RankPayload(
                    status="error",
                    rank=rank,
                    message="rank failed outside a case",
                    traceback=traceback.format_exc(),
                )
            )
        except OSError:
            pass
        raise
