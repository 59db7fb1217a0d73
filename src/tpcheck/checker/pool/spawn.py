"""Forking ranks: the one helper behind the launcher's pool, the tests and the benchmarks.

`Ranks` forks `world` processes from this one (after `import torch`, so a rank starts in
milliseconds), each with its own duplex pipe to the parent; `join_group` is how a rank joins the
group (a FileStore in a fresh temp directory: no port to pick, so concurrent runs cannot collide):
gloo, or on GPUs gloo and NCCL (checker/devices.py).
`run_on_ranks(fn, world, *args)` runs `fn(group, *args)` on every rank and returns their values.

Pipes carry plain payloads: `send_plain` pickles with the standard pickler into bytes. Tensors then
travel as bytes, not as shared-memory handles (what `multiprocessing`'s own pickler does with torch
tensors): a handle whose owner calls `os._exit` right after sending is the race that made a queue of
tensors fail with ConnectionResetError on a loaded machine. `Connection.send_bytes` is synchronous,
so nothing is left in flight when a rank exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from tpcheck.checker.devices import backend, rank_device
from tpcheck.parallel.group import TPGroup


def send_plain(conn: Connection, obj) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv_plain(conn: Connection):
    return pickle.loads(conn.recv_bytes())


LIVE: set[Ranks] = set()  # every Ranks not yet killed: what `kill_all` stops
TEMP_DIRS: set[str] = set()  # other private temp dirs of this process that `kill_all` removes


class Ranks:
    """`world` forked processes, each running `target(rank, world, store_path, conn, *args)`. Each
    rank leads its own process group, so what it spawns dies with it (`kill`), and a Ctrl-C at the
    terminal reaches the parent only (which then stops every rank at once)."""

    def __init__(
        self, world: int, target: Callable, args: tuple = (), name: str = "tpcheck-rank"
    ) -> None:
        ctx = mp.get_context("fork")
        self.world = world
        self.tmpdir = tempfile.mkdtemp(prefix="tpcheck-")
        self.store_path = os.path.join(self.tmpdir, "store")
        self.conns: list[Connection] = []
        # `kill` may run in two threads at once (a lane whose ranks died, and `Lanes.abort`): one
        # closes each pipe, the other finds it closed (two os.close of one fd: EBADF, or worse, the
        # fd of a file opened in between)
        self._closing = threading.Lock()
        self.procs = []
        self.threads = (rank_threads(world), threads_while_others_wait(world))
        # the parent's objects as of now are left out of the ranks' garbage collections: a
        # collection in a forked rank writes to every object it traverses, copying the parent's
        # pages, so a long-lived rank comes to hold a private copy of much of the parent's heap
        # (ranks of a pytest worker that had imported transformers: 0.4-1.0 GB private each, 36 of
        # them in the false-alarm sweep). Unfrozen in the parent once the ranks are forked.
        gc.freeze()
        try:
            self._fork(ctx, world, target, args, name)
        finally:
            gc.unfreeze()
        LIVE.add(self)

    def _fork(self, ctx, world: int, target: Callable, args: tuple, name: str) -> None:
        for r in range(world):
            mine, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=_entry,
                args=(
                    target,
                    r,
                    world,
                    self.store_path,
                    theirs,
                    list(self.conns),
                    os.getpid(),
                    args,
                    self.threads,
                ),
                daemon=True,
                name=f"{name}{r}",
            )
            p.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(p)

    def kill(self, join_s: float = 5.0) -> None:
        """Kill every rank and whatever it spawned (its process group), reap them (waiting at most
        `join_s` for each), close the pipes, remove the store."""
        self.signal_all()
        for p in self.procs:
            p.join(timeout=join_s)
        with self._closing:
            for conn in self.conns:
                conn.close()  # a closed Connection's close does nothing
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        LIVE.discard(self)  # last: a second Ctrl-C during the joins still finds this one (kill_all)

    def signal_all(self) -> None:
        """SIGKILL to every rank's process group at once (a group outlives its rank while the rank's
        children live)."""
        for p in self.procs:
            if p.pid is None:
                continue
            if p.exitcode is None:
                p.kill()  # also before the rank made its group (setpgid), which killpg would miss
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def kill_all() -> None:
    """Stop every rank of this process now and remove their temp dirs, without waiting for anything
    (a second Ctrl-C)."""
    for ranks in list(LIVE):  # SIGKILL is not instant: reap briefly, so that no rank outlives us
        ranks.kill(join_s=0.2)
    for path in list(TEMP_DIRS):
        shutil.rmtree(path, ignore_errors=True)
    TEMP_DIRS.clear()


# libgomp is not fork-safe: once a process has run an OpenMP region on several threads (a large
# softmax, a matmul), a process forked from it hangs in its first parallel region. A parent that ran
# every op on one thread never started that thread team, and its ranks may use several threads.
_PARENT_KEPT_TO_ONE_THREAD = False


def keep_parent_to_one_thread() -> None:
    """Called first thing by the `tpcheck` command (before any torch op): this process then computes
    on one thread, and the ranks it forks share the CPUs (`rank_threads`). Any other parent (a
    pytest process, a script calling `tpcheck.check`) may have started the thread team, so its ranks
    run one thread each."""
    global _PARENT_KEPT_TO_ONE_THREAD
    torch.set_num_threads(1)
    _PARENT_KEPT_TO_ONE_THREAD = True


# A cap on any rank's intra-op threads set by the command (`rank_thread_cap`); None: none.
_THREAD_CAP: int | None = None


@contextlib.contextmanager
def rank_thread_cap(threads: int | None):
    """Within it, ranks forked compute on at most `threads` intra-op threads, rank 0's float64
    passes included (None: no cap beyond the CPUs and OMP_NUM_THREADS). For cases too small for a
    thread team to pay (`tpcheck hf`: models of at most a million parameters on 2 x 8 tokens): each
    op is then too short to split, and on a shared machine a team whose other thread waits for a
    busy core turns a millisecond op into seconds (a float64 depthwise conv1d: 0.9 ms on one
    thread, 5.8 s on two under load)."""
    global _THREAD_CAP
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)):
        raise TypeError(f"threads must be an int or None, got {threads!r}")
    before, _THREAD_CAP = _THREAD_CAP, None if threads is None else max(1, threads)
    try:
        yield
    finally:
        _THREAD_CAP = before


def rank_threads(world: int) -> int:
    """Intra-op threads for each of `world` ranks forked now: the CPUs this process may run on
    shared among them (at most OMP_NUM_THREADS when set), if this process kept to
    one thread; else 1."""
    cpus, cap = _cpus()
    return min(max(1, cpus // world), cap)


def threads_while_others_wait(world: int) -> int:
    """Intra-op threads for a rank of `world` forked now while every other rank waits for it (rank
    0's float64 truth: the others are blocked at the TP side's first collective): the whole group's
    CPUs, at most OMP_NUM_THREADS; 1 where `rank_threads` is 1 for fork-safety."""
    cpus, cap = _cpus()
    return min(cpus, cap, rank_threads(world) * world)


def _cpus() -> tuple[int, int]:
    """(the CPUs ranks forked now may share, the cap on one process's threads); (1, 1) if this
    process did not keep to one thread (its ranks then compute on one thread: libgomp)."""
    if not _PARENT_KEPT_TO_ONE_THREAD or torch.get_num_threads() != 1:
        return 1, 1
    cpus = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    cap = os.environ.get("OMP_NUM_THREADS", "")
    cap = int(cap) if cap.isdigit() and int(cap) > 0 else cpus
    return cpus, cap if _THREAD_CAP is None else min(cap, _THREAD_CAP)


# Set in each rank by `_entry`: the intra-op threads it may use while the other ranks wait for it.
THREADS_WHILE_OTHERS_WAIT = 1


_FAULT_FILE = None  # in a rank: where faulthandler writes if the process is killed


def fault_path(store_path: str, rank: int) -> str:
    """The file a rank's faulthandler writes its stacks into, beside its pool's store."""
    return os.path.join(os.path.dirname(store_path), f"fault-{rank}")


def _entry(target, rank, world, store_path, conn, inherited, parent_pid, args, threads) -> None:
    os.setpgid(0, 0)
    stop_on_signals()
    signal.signal(signal.SIGINT, _sigint)
    # a rank that a collective library aborts (SIGABRT) dumps its threads' stacks into a file of the
    # pool, where the launcher reads where it died (heartbeat.spot_of_dump) -- not into the parent's
    # output, as a parent's own faulthandler (pytest enables one) would have it
    global _FAULT_FILE
    _FAULT_FILE = open(fault_path(store_path, rank), "w")  # noqa: SIM115 - open for the process's life
    faulthandler.enable(_FAULT_FILE, all_threads=True)
    die_with_parent(parent_pid)
    global THREADS_WHILE_OTHERS_WAIT
    # rank_threads and threads_while_others_wait, decided in the parent
    torch.set_num_threads(threads[0])
    THREADS_WHILE_OTHERS_WAIT = threads[1]
    for c in inherited:  # the parent's ends of earlier ranks' pipes, inherited by the fork
        c.close()
    code = 0
    try:
        target(rank, world, store_path, conn, *args)
    except BaseException:  # noqa: BLE001 - the target reports its own failures; this is the last resort
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's slow (and, with gloo, sometimes aborting) interpreter exit


_SIGINT_SEEN = False


def _sigint(signum, frame) -> None:
    """A rank's SIGINT: KeyboardInterrupt, as by default, remembering that a signal raised it."""
    global _SIGINT_SEEN
    _SIGINT_SEEN = True
    raise KeyboardInterrupt


def interrupt_is_a_signal() -> bool:
    """Whether a KeyboardInterrupt caught now may come from a real SIGINT (else user code raised
    it): in a rank, only if one arrived; in the CLI, never (its SIGINT raises its own Interrupted);
    under Python's default handler, it may."""
    handler = signal.getsignal(signal.SIGINT)
    if handler is _sigint:
        return _SIGINT_SEEN
    return handler is signal.default_int_handler


def stop_on_signals() -> None:
    """In a process forked from the command: SIGTERM and SIGHUP end it. The handlers inherited
    from the parent (the command's, which stop the whole run and wait for its children) are not
    its own; one left in place keeps a child alive that its parent is waiting to see exit."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this rank when the parent goes (even by SIGKILL)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def join_group(
    rank: int, world: int, store_path: str, timeout_s: float, device: str = "cpu"
) -> dist.Store:
    """Join the group of `world` ranks rendezvousing at `store_path` (gloo; on "cuda", this rank's
    GPU made current and NCCL for CUDA tensors beside gloo); returns the store."""
    rank_device(device, rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(
        backend(device),
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    return store


# -------------------------------------------------------------------------- run a function on ranks


def _run_fn(rank, world, store_path, conn, fn, args, timeout_s, device) -> None:
    try:
        join_group(rank, world, store_path, timeout_s, device)
        out = fn(
            TPGroup(
                rank=rank, world_size=world, pg=dist.group.WORLD, device=rank_device(device, rank)
            ),
            *args,
        )
        send_plain(conn, ("ok", out))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it there
        send_plain(conn, ("error", traceback.format_exc()))


def run_on_ranks(
    fn: Callable, world: int, *args, timeout_s: float = 120.0, device: str = "cpu"
) -> list:
    """`fn(group, *args)` on `world` forked ranks (gloo; on "cuda" one GPU each, NCCL beside gloo);
    the ranks' return values, in rank order. A rank that raises or dies fails the call with its
    traceback; none waits past `timeout_s`."""
    ranks = Ranks(world, _run_fn, (fn, args, timeout_s, device))
    results: dict[int, object] = {}
    try:
        pending = {c: r for r, c in enumerate(ranks.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(ranks.procs)}
        while pending:
            ready = wait(
                [*pending, *(s for s, r in sentinels.items() if r not in results)],
                timeout=timeout_s,
            )
            if not ready:
                raise TimeoutError(
                    f"rank(s) {sorted(pending.values())} gave no result within {timeout_s:g} s"
                )
            for obj in ready:
                if obj in pending:
                    r = pending.pop(obj)
                    status, out = recv_plain(obj)
                    if status != "ok":
                        raise AssertionError(f"rank {r} failed:\n{out}")
                    results[r] = out
                elif sentinels[obj] in pending.values() and not ranks.conns[sentinels[obj]].poll():
                    r = sentinels[obj]
                    raise AssertionError(
                        f"rank {r} died (exit code {ranks.procs[r].exitcode}) before reporting"
                    )
    finally:
        ranks.kill()
    return [results[r] for r in range(world)]
