"""Where each rank is, as evidence: heartbeats up, blame down.

Every rank's heartbeat thread samples its main thread's Python stack a few times a second and sends
the parent a `Beat`: what the rank is doing ("collective" -- inside a torch.distributed collective,
tapped by tpcheck or the user's own; "checkpoint" -- waiting at the checker's store rendezvous;
"subprocess" -- waiting on a child process, or on the file lock of another process's build: a
just-in-time compile of a C++/CUDA op, as DeepSpeed and other libraries run on first use;
"compute" -- anything else, a query such as `dist.get_rank()` included), where (the innermost frame
that is not torch's or Python's own: the user's file:line, or tpcheck's), for how long it has been
in that spot, and the collectives it issued since the last beat. A stopped process (SIGSTOP, a
debugger) sends nothing, which is evidence too.

A sample lands at any instant, so a collective is told from the whole call in progress, not from
its innermost frame: torch's wrappers (c10d_logger's `wrapper`) and tpcheck's (the ledger's
`counted`) are the call they wrap, the collective's own helpers (`_check_single_tensor`, the
`get_rank` its logging calls) are part of it, and a tapped collective that raised (a timeout) is
still the rank's spot while the failure unwinds through the checker (`BeatMaker`).

When a rank's collective or checkpoint times out, the parent (`Watch`) does not wait for the others'
own timeouts: it reads their latest beats and names the culprit at once -- a rank computing, or
silent, while the others wait in a collective; or the ranks that wait somewhere else than the rest.
A case in which no rank waits and no rank's stack moves for `timeout + STALL_EXTRA_S` is a hang as
well (every rank spinning); world 1, which has no collective, gets `WORLD1_FACTOR` times that, and
so does a case in which some rank waits on a subprocess (a compile takes minutes, not seconds).
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass, field

from tpcheck.checker.rank.ledger import USER_COLLECTIVES
from tpcheck.checker.sourcelines import frame_kind, short_path

BEAT_S = 0.25  # a rank's heartbeat period
STALE_S = 2.0  # no beat for this long: the rank is not responding
STALL_EXTRA_S = 4.0  # no rank waits and no stack moves for timeout + this: a hang
WORLD1_FACTOR = 10  # world 1 (no collective to time out) waits this many times longer
STACK_FRAMES = 8  # frames of a stuck rank's stack kept in the report

_COLLECTIVE_FILES = (
    os.path.join("torch", "distributed", "distributed_c10d.py"),
    os.path.join("torch", "distributed", "_functional_collectives.py"),
    os.path.join("torch", "distributed", "c10d_logger.py"),
)
# functions that wrap a torch.distributed function held in their closure variable `func`
_WRAPPERS = {
    (os.path.join("torch", "distributed", "c10d_logger.py"), "wrapper"),
    (os.path.join("tpcheck", "checker", "rank", "ledger.py"), "counted"),
}
# The torch.distributed functions that wait for other ranks: the collectives the ledger counts, the
# ones TPGroup calls (`all_gather_single`, `reduce_scatter_single` since torch 2.13), the functional
# collectives' and the group-making ones (a store barrier). Anything else (get_rank,
# get_world_size, is_initialized, get_backend, ...) is a query: a rank in one is computing.
COLLECTIVES = frozenset(USER_COLLECTIVES) | {
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_coalesced",
    "all_reduce_coalesced",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced",
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "reduce_scatter_tensor_autograd",
    "all_to_all_single_autograd",
    "all_reduce_inplace",
    "all_gather_inplace",
    "reduce_scatter_tensor_inplace",
    "permute_tensor",
    "wait_tensor",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "batch_isend_irecv",
    "monitored_barrier",
    "init_process_group",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
}
_SYNC_FILE = os.path.join("tpcheck", "checker", "sync.py")
# a rank in one of these waits on another process: a child it started (subprocess.run, Popen.wait,
# communicate) or the lock another process's build holds (torch.utils.cpp_extension's FileBaton)
_SUBPROCESS_WAITS = (
    ("python", os.sep + "subprocess.py", ("wait", "_wait", "communicate", "_communicate")),
    ("torch", os.path.join("torch", "utils", "file_baton.py"), ("wait",)),
)
# tpcheck's collective plumbing: a collective issued through a TPGroup is placed at its caller
_PLUMBING = tuple(
    os.path.join("tpcheck", *p)
    for p in (
        ("parallel", "group.py"),
        ("parallel", "collectives.py"),
        ("checker", "rank", "ledger.py"),
        ("faults", "injectors.py"),
    )
)


@dataclass
class Spot:
    """What a rank's main thread is doing: state (collective | checkpoint | subprocess | compute),
    `call` (the torch.distributed function, for a collective; the build lock's file, for a
    subprocess wait on one),
    `at` (file:line in function) and its stack."""

    state: str
    at: str
    call: str | None = None
    stack: list[str] = field(default_factory=list)


@dataclass
class Beat:
    """One heartbeat of one rank, for case number `case`. `label` names a tapped collective (op,
    site, phase) or the checkpoint waited at; `since_s` is how long the rank has been at this spot
    (its own clock); `ledger` the collectives tapped since the previous beat of this case."""

    rank: int
    case: int
    progress: tuple
    spot: Spot
    label: tuple | str | None
    since_s: float
    ledger: list = field(default_factory=list)


def _is_library(path: str) -> bool:
    """torch's or Python's own code: a rank there is placed at the caller (`frame_kind`)."""
    return frame_kind(path) in ("torch", "python")


def _where(f: tuple[str, int, str]) -> str:
    """A frame (file, line, function) as "file:line in function", the file relative to the cwd."""
    return f"{short_path(f[0])}:{f[1]} in {f[2]}"


def _called(frame) -> str | None:
    """The torch.distributed function `frame` runs, None for a frame of no such function. A
    wrapper's frame is the function it wraps, at every instant: about to call it, inside it, or
    logging its failure (c10d_logger's `wrapper` closes over `func`; so does the ledger's
    `counted`)."""
    path, name = frame.f_code.co_filename, frame.f_code.co_name
    if any(path.endswith(file) and name == fn for file, fn in _WRAPPERS):
        return getattr(frame.f_locals.get("func"), "__name__", None)
    return name if path.endswith(_COLLECTIVE_FILES) else None


def _collective(frames: list) -> tuple[str | None, int]:
    """The collective in progress on the stack (`frames`, innermost first) and the index of the
    frames outside it: the outermost torch.distributed function that is a collective -- the one the
    rank's code called; its helpers, the queries it makes (its logging's `get_rank`) and what
    tpcheck's wrapper calls (the current tap) are part of it. (None, 0) when no collective is in
    progress (a query, or no torch.distributed)."""
    calls = [i for i, f in enumerate(frames) if _called(f) in COLLECTIVES]
    return (_called(frames[calls[-1]]), calls[-1] + 1) if calls else (None, 0)


def _waits_on_a_process(row: tuple[str, int, str]) -> bool:
    """Whether a frame (file, line, function) is Python's or torch's wait on another process."""
    path, _, name = row
    return any(
        path.endswith(file) and name in names and frame_kind(path) == kind
        for kind, file, names in _SUBPROCESS_WAITS
    )


def _build_lock(frame) -> str | None:
    """The file of torch's build lock a rank waits on (a compile that was killed leaves it behind,
    and every later build waits on it); None for a wait on a child process."""
    lock = getattr(frame.f_locals.get("self"), "lock_file_path", None)
    return lock if isinstance(lock, str) else None


def spot_of(frame, tapped: tuple | None, checkpoint: str | None, held: Spot | None = None) -> Spot:
    """Classify the main thread's stack (`frame`: its innermost frame, or None). `tapped` is the
    collective the checker's tap is inside, `checkpoint` the rendezvous waited at, if any; `held`
    the spot at which the stack last showed `tapped` (BeatMaker's): a stack that has left it while
    `tapped` is still set is unwinding its failure (a timeout) and is still there."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return _spot(frames, tapped, checkpoint, held)


def _spot(frames: list, tapped: tuple | None, checkpoint: str | None, held: Spot | None) -> Spot:
    """`spot_of` on a stack as a list of frames (or `_Dumped` ones), innermost first."""
    rows = [(f.f_code.co_filename, f.f_lineno, f.f_code.co_name) for f in frames]
    mine = [i for i, f in enumerate(rows) if not _is_library(f[0])]
    stack = [_where(rows[i]) for i in mine[:STACK_FRAMES]]
    call, outside = _collective(frames)
    # the line the rank is at: its own innermost (outside the collective in progress), past
    # tpcheck's collective plumbing
    own = [i for i in mine if i >= outside] or mine
    placed = next((i for i in own if not rows[i][0].endswith(_PLUMBING)), own[0] if own else 0)
    at = _where(rows[placed]) if rows else "?"
    if checkpoint is not None and any(f[0].endswith(_SYNC_FILE) for f in rows):
        return Spot("checkpoint", at, None, stack)
    if call is not None:
        return Spot("collective", at, call, stack)
    if tapped is not None:
        return held if held is not None else Spot("collective", at, tapped[0], stack)
    waiting = next((f for f, row in zip(frames, rows) if _waits_on_a_process(row)), None)
    if waiting is not None:
        return Spot("subprocess", at, _build_lock(waiting), stack)
    return Spot("compute", at, None, stack)


@dataclass(frozen=True)
class _Code:
    co_filename: str
    co_name: str


@dataclass(frozen=True)
class _Dumped:
    """A frame as faulthandler dumped it: file, line and function, no locals."""

    f_code: _Code
    f_lineno: int
    f_locals: dict = field(default_factory=dict)


_DUMPED_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_ENTRY = (os.path.join("checker", "pool", "spawn.py"), "_entry")


def spot_of_dump(text: str) -> Spot | None:
    """Where a rank's main thread was when its process was killed (a collective library's abort),
    from the stacks faulthandler dumped then (each rank dumps into a file of its pool:
    `spawn.fault_path`); the main thread is the one running the rank's entry. None without one."""
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", text):
        frames = [
            _Dumped(_Code(m["path"], m["func"]), int(m["line"]))
            for m in map(_DUMPED_FRAME.match, block.splitlines())
            if m
        ]
        if any(
            f.f_code.co_filename.endswith(_ENTRY[0]) and f.f_code.co_name == _ENTRY[1]
            for f in frames
        ):
            return _spot(frames, None, None, None)
    return None


class BeatMaker:
    """The rank side: turns the rank's state into beats (one per call of `beat`)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._tap = None
        self._sent = 0
        self._key, self._since = None, time.monotonic()
        # (the tapped collective, the spot the stack last showed it at)
        self._held: tuple[tuple, Spot] | None = None

    def beat(self, case: int, tap, rendezvous, frame) -> Beat:
        if tap is not self._tap:
            self._tap, self._sent, self._held = tap, 0, None
        new = list(tap.ledger[self._sent :]) if tap is not None else []
        self._sent += len(new)
        tapped = getattr(tap, "inside", None)
        checkpoint = getattr(rendezvous, "waiting_at", None)
        # the tap's label object is made afresh for each collective: `is` tells this one's
        held = self._held[1] if self._held is not None and self._held[0] is tapped else None
        spot = spot_of(frame, tapped, checkpoint, held)
        if tapped is not None and spot.state == "collective" and spot is not held:
            self._held = (tapped, spot)
        label = (
            checkpoint
            if spot.state == "checkpoint"
            else (tapped if spot.state == "collective" else None)
        )
        progress = (len(tap.ledger) if tap is not None else 0, getattr(rendezvous, "rounds", 0))
        key = (case, spot.state, spot.at, spot.call, label, progress)
        now = time.monotonic()
        if key != self._key:
            self._key, self._since = key, now
        return Beat(self.rank, case, progress, spot, label, now - self._since, new)


def main_frame():
    """The innermost frame of this process's main thread (the heartbeat thread is another)."""
    import threading

    return sys._current_frames().get(threading.main_thread().ident)


# ---------------------------------------------------------------------------- the parent side


def process_state(pid: int) -> str | None:
    """Linux's one-letter state of `pid` (R running, S
    sleeping, T stopped, t traced, D disk, Z zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


STATE_WORDS = {
    "T": "stopped by a signal (SIGSTOP/SIGTSTP)",
    "t": "stopped by a debugger",
    "D": "in uninterruptible I/O",
    "Z": "exited (zombie)",
    "R": "running, but its heartbeat thread gets no time",
    "S": "sleeping, but its heartbeat thread is silent",
}


class Watch:
    """The parent's view of one case's ranks: their latest beats, and when the case is stuck."""

    def __init__(
        self,
        world: int,
        case: int,
        timeout_s: float,
        clock=time.monotonic,
        stall_s: float | None = None,
    ) -> None:
        self.world, self.case, self.timeout_s, self.clock, self.stall_s = (
            world,
            case,
            timeout_s,
            clock,
            stall_s,
        )
        self.beats: dict[int, Beat] = {}
        self.beat_at: dict[int, float] = {}
        self.ledgers: dict[int, list] = {r: [] for r in range(world)}
        self.started = self.moved = clock()
        self._keys: dict[int, tuple] = {}

    def note(self, beat: Beat) -> None:
        if beat.case != self.case:
            return  # a late beat of the previous case
        now = self.clock()
        self.ledgers[beat.rank].extend(beat.ledger)
        key = (beat.progress, beat.spot.state, beat.spot.at, beat.label)
        if self._keys.get(beat.rank) != key:
            self._keys[beat.rank] = key
            self.moved = now
        self.beats[beat.rank] = beat
        self.beat_at[beat.rank] = now

    def stall_limit(self) -> float:
        if self.stall_s is not None:  # the caller's own limit (tests)
            return self.stall_s
        limit = self.timeout_s + STALL_EXTRA_S
        waits = any(b.spot.state == "subprocess" for b in self.beats.values())
        return limit * WORLD1_FACTOR if self.world == 1 or waits else limit

    def deadline(self) -> float:
        """When the case counts as stuck if nothing moves: no stack moved and no rank progressed."""
        return self.moved + self.stall_limit()

    def silent_for(self, rank: int) -> float:
        return self.clock() - self.beat_at.get(rank, self.started)

    def evidence(self, rank: int, pid: int | None) -> dict:
        """What the parent knows of `rank` now: state, where, for how long, its stack."""
        beat = self.beats.get(rank)
        silent = self.silent_for(rank)
        if beat is None or silent > STALE_S:
            proc = process_state(pid) if pid else None
            how = STATE_WORDS.get(proc or "", "gone") if proc else "gone"
            out = {
                "rank": rank,
                "state": "unresponsive",
                "seconds": round(silent, 1),
                "process": how,
            }
            if beat is not None:
                out.update(at=beat.spot.at, stack=beat.spot.stack)
            return out
        out = {
            "rank": rank,
            "state": beat.spot.state,
            "at": beat.spot.at,
            "seconds": round(beat.since_s, 1),
            "stack": beat.spot.stack,
        }
        if beat.spot.state == "subprocess" and beat.spot.call:
            out["lock"] = beat.spot.call
        if beat.spot.state == "collective":
            out["call"] = beat.spot.call
            if isinstance(beat.label, tuple):
                out["op"], out["site"], out["phase"] = beat.label
        elif beat.spot.state == "checkpoint":
            out["checkpoint"] = beat.label
        return out
