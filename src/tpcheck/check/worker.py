"""The rank side of the pool: a forked process that joins the gloo group, then runs the cases the
parent sends until told to stop (or until the parent is gone).

Talks to the parent over one pipe (`Connection.send` is synchronous: no feeder thread that could hold
a lock at the next fork, or lose a message at `os._exit`). A progress thread notes every collective
entered and checkpoint passed, so the parent can tell a slow rank from a stuck one.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from tpcheck.check.case import CaseSpec
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup

PROGRESS_EVERY_S = 0.25


def _is_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "timed out" in text or "timeout" in text or "deadline" in text


def _ledger_lines(group: TPGroup) -> list[str]:
    return [f"{e.phase} {e.op} at {e.site!r}" for e in group.ledger or ()]


def run_spec_on_rank(spec: CaseSpec, group: TPGroup) -> dict:
    """Build and run one case on this rank; never raises: failures come back as data, with this rank's
    ledger so the parent can say where the ranks' collectives parted."""
    from tpcheck.check.registry import build_case
    from tpcheck.check.runner import CollectiveMismatch, run_case_on_rank

    group.interceptor, group.last_collective, group.ledger = None, None, None
    try:
        return {"status": "ok", **run_case_on_rank(build_case(spec), group)}
    except UsageError as e:
        return {"status": "usage", "rank": group.rank, "message": str(e)}
    except CollectiveMismatch as e:
        return {"status": "hang", "rank": group.rank, "message": str(e), "waiting_in": "checkpoint",
                "checkpoint": getattr(e, "checkpoint", None), "last_collective": group.last_collective,
                "ledger": _ledger_lines(group)}
    except Exception as e:  # noqa: BLE001 - a rank's failure is a result, reported with its traceback
        hang = _is_timeout(e)
        return {"status": "hang" if hang else "error", "rank": group.rank, "message": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(), "last_collective": group.last_collective,
                "ledger": _ledger_lines(group), **({"waiting_in": "collective"} if hang else {})}


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this rank when the parent goes (even by SIGKILL)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


class _Channel:
    """This rank's end of the pipe; a lock because the progress thread sends too."""

    def __init__(self, conn: Connection, parent_pid: int) -> None:
        self.conn, self.parent_pid, self.lock = conn, parent_pid, threading.Lock()

    def send(self, msg) -> None:
        with self.lock:
            self.conn.send(msg)

    def next_task(self) -> CaseSpec | None:
        while not self.conn.poll(1.0):
            if os.getppid() != self.parent_pid:
                return None
        try:
            return self.conn.recv()
        except EOFError:
            return None


def _progress(chan: _Channel, group: TPGroup) -> None:
    """Tell the parent whenever this rank enters a collective or passes a checkpoint: proof of life
    for the parent's stall deadline, and the last spot seen if the rank must be killed."""
    last = None
    while True:
        time.sleep(PROGRESS_EVERY_S)
        now = (len(group.ledger or ()), group.syncs, group.last_collective)
        if now != last:
            last = now
            chan.send(("progress", group.rank, group.last_collective))


def _worker(rank: int, world: int, store_path: str, conn: Connection, others: list[Connection],
            timeout_s: float, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    # libgomp is not fork-safe: if the parent ran an OpenMP region (softmax, log_softmax, ...) before
    # forking, the rank's first parallel region hangs forever. One thread per rank avoids the pool.
    torch.set_num_threads(1)
    for c in others:  # the parent's ends of earlier ranks' pipes, inherited by the fork
        c.close()
    chan, code = _Channel(conn, parent_pid), 0
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        group = TPGroup(rank=rank, world_size=world, pg=dist.group.WORLD, store=store, timeout_s=timeout_s)
        threading.Thread(target=_progress, args=(chan, group), daemon=True).start()
        while (spec := chan.next_task()) is not None:
            chan.send(run_spec_on_rank(spec, group))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        code = 1
        try:
            chan.send({"status": "error", "rank": rank, "message": "rank failed outside a case",
                       "traceback": traceback.format_exc()})
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's slow (and, with gloo, sometimes aborting) interpreter exit
