"""The launcher's evidence of where ranks are (tpcheck.checker.pool.heartbeat), on synthetic beats
and stacks, with a fake clock: the stall deadline, stale beats, the culprit rules, and the
stack classification."""

import os
import sys

import pytest
import torch

from tpcheck.checker.pool import heartbeat as hb
from tpcheck.checker.pool.heartbeat import Beat, Spot, Watch, spot_of
from tpcheck.checker.verdict.hangs import culprits, describe


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def beat(
    rank,
    state="compute",
    at="case.py:3 in forward",
    case=1,
    progress=(0, 0),
    since=0.0,
    label=None,
    call=None,
):
    return Beat(
        rank=rank,
        case=case,
        progress=progress,
        spot=Spot(state, at, call, [at]),
        label=label,
        since_s=since,
    )


def test_stall_deadline_is_timeout_plus_at_most_5_s_after_the_last_movement():
    clock = Clock()
    w = Watch(world=2, case=1, timeout_s=20, clock=clock)
    assert w.deadline() - clock.t <= 20 + 5
    clock.t += 3
    w.note(beat(0, at="case.py:3 in forward"))
    first = w.deadline()
    assert first == pytest.approx(clock.t + 20 + hb.STALL_EXTRA_S)
    clock.t += 10
    w.note(beat(0, at="case.py:3 in forward"))  # the same spot again: no movement
    assert w.deadline() == first
    w.note(beat(0, at="case.py:4 in forward"))  # a new line: movement
    assert w.deadline() == pytest.approx(clock.t + 20 + hb.STALL_EXTRA_S)
    # progress on another rank moves the case too
    w.note(beat(1, state="collective", progress=(1, 0)))
    assert w.deadline() == pytest.approx(clock.t + 20 + hb.STALL_EXTRA_S)


def test_world_1_waits_longer_and_beats_of_another_case_are_ignored():
    clock = Clock()
    solo = Watch(world=1, case=2, timeout_s=20, clock=clock)
    assert solo.deadline() - clock.t == pytest.approx(hb.WORLD1_FACTOR * (20 + hb.STALL_EXTRA_S))
    clock.t += 50
    solo.note(beat(0, case=1, at="elsewhere.py:1 in f"))  # a late beat of the previous case
    assert solo.beats == {} and solo.deadline() - clock.t < hb.WORLD1_FACTOR * (
        20 + hb.STALL_EXTRA_S
    )


def test_a_rank_without_recent_beats_is_unresponsive_with_its_process_state():
    clock = Clock()
    w = Watch(world=2, case=1, timeout_s=5, clock=clock)
    w.note(beat(0, state="checkpoint", label="building the TP module", since=1))
    w.note(beat(1, at="case.py:9 in forward"))
    clock.t += hb.STALE_S + 0.5
    w.note(beat(0, state="checkpoint", label="building the TP module", since=3.5))
    e0, e1 = w.evidence(0, None), w.evidence(1, os.getpid())
    assert e0["state"] == "checkpoint" and e0["checkpoint"] == "building the TP module"
    assert (
        e1["state"] == "unresponsive"
        and e1["at"] == "case.py:9 in forward"
        and e1["seconds"] >= hb.STALE_S
    )
    assert e1["process"] == hb.STATE_WORDS["R"]  # this very process: running
    assert "rank 1 sent no heartbeat" in describe(e1)
    never = Watch(world=2, case=1, timeout_s=5, clock=clock).evidence(1, None)
    assert never["state"] == "unresponsive" and never["process"] == "gone"


@pytest.mark.parametrize(
    "states, blamed, words",
    [
        (["collective", "compute"], [1], "stuck in compute"),
        (["checkpoint", "unresponsive"], [1], "stopped responding"),
        (["collective", "compute", "unresponsive"], [1, 2], "stuck in compute"),
        (["compute", "compute"], [0, 1], "no rank entered a collective"),
        (["collective", "collective", "checkpoint", "collective"], [2], "different places"),
        (["collective", "checkpoint"], [], "different places"),
        (["collective", "collective"], [], "same place"),
    ],
)
def test_culprits(states, blamed, words):
    evidence = [
        {"rank": r, "state": s, "call": "all_reduce" if s == "collective" else None}
        for r, s in enumerate(states)
    ]
    who, why = culprits(evidence)
    assert who == blamed and words in why


def _frames_from(path: str, src: str, fn: str):
    """The frame of `fn` defined in a module compiled as if it lived at `path`, called from here."""
    scope: dict = {"sys": sys}
    exec(compile(src, path, "exec"), scope)
    return scope[fn]()


def test_spot_of_tells_a_users_collective_from_compute_and_places_it_at_the_calling_line():
    c10d = os.path.join(os.path.dirname(torch.__file__), "distributed", "distributed_c10d.py")
    inner = _frames_from(c10d, "def all_reduce():\n    return sys._getframe()\n", "all_reduce")

    spot = spot_of(inner, tapped=None, checkpoint=None)
    assert spot.state == "collective" and spot.call == "all_reduce"
    assert spot.at.endswith(f"test_heartbeat.py:{_spot_line()} in _frames_from"), spot.at
    here = sys._getframe()
    compute = spot_of(here, tapped=None, checkpoint=None)
    assert compute.state == "compute" and "test_heartbeat.py" in compute.at
    tapped = spot_of(here, tapped=("all_reduce", "down", "forward"), checkpoint=None)
    assert tapped.state == "collective" and tapped.call == "all_reduce"
    # a checkpoint label without a frame in sync.py is not a checkpoint wait
    assert spot_of(here, tapped=None, checkpoint="x").state == "compute"


def _spot_line() -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if "return scope[fn]()" in line)


def test_spot_of_a_query_is_compute_at_the_line_that_asked():
    """dist.get_rank() (and the other queries) wait for no rank: not a collective."""
    c10d = os.path.join(os.path.dirname(torch.__file__), "distributed", "distributed_c10d.py")
    inner = _frames_from(c10d, "def get_rank():\n    return sys._getframe()\n", "get_rank")
    spot = spot_of(inner, tapped=None, checkpoint=None)
    assert spot.state == "compute" and spot.call is None, spot
    assert spot.at.endswith(f"test_heartbeat.py:{_spot_line()} in _frames_from"), spot.at


def test_spot_of_torchs_logging_wrapper_is_the_collective_it_wraps():
    """A rank sampled in c10d_logger's `wrapper` (before calling the collective, or logging its
    failure) is in that collective: named by the function the wrapper closes over."""
    logger = os.path.join(os.path.dirname(torch.__file__), "distributed", "c10d_logger.py")
    src = (
        "def _exception_logger(func):\n"
        "    def wrapper():\n"
        "        func\n"
        "        return sys._getframe()\n"
        "    return wrapper\n"
        "def all_reduce():\n"
        "    pass\n"
        "def sampled():\n"
        "    return _exception_logger(all_reduce)()\n"
    )
    inner = _frames_from(logger, src, "sampled")
    spot = spot_of(inner, tapped=None, checkpoint=None)
    assert spot.state == "collective" and spot.call == "all_reduce", spot
    assert spot.at.endswith(f"test_heartbeat.py:{_spot_line()} in _frames_from"), spot.at


def _dumped(rows):
    """Frames (innermost first) from (file, line, function) rows, as faulthandler dumps them."""
    return [hb._Dumped(hb._Code(path, fn), line) for path, line, fn in rows]


SUBPROCESS = os.path.join(os.path.dirname(os.__file__), "subprocess.py")
BATON = os.path.join(os.path.dirname(torch.__file__), "utils", "file_baton.py")
BUILDER = "/venv/site-packages/deepspeed/ops/op_builder/builder.py"


@pytest.mark.parametrize(
    "inner",
    [
        [(SUBPROCESS, 2000, "_wait"), (SUBPROCESS, 1260, "wait"), (SUBPROCESS, 550, "run")],
        [(BATON, 42, "wait")],
    ],
    ids=["its own compiler", "another process's build lock"],
)
def test_a_rank_waiting_on_a_build_is_in_a_subprocess_and_stretches_the_deadline(inner):
    frames = _dumped([*inner, (BUILDER, 613, "jit_load"), ("/u/case.py", 9, "build_tp")])
    spot = hb._spot(frames, None, None, None)
    assert spot.state == "subprocess" and spot.at.endswith("builder.py:613 in jit_load"), spot
    clock = Clock()
    w = Watch(world=2, case=1, timeout_s=20, clock=clock)
    w.note(beat(0, state="subprocess", at=spot.at))
    w.note(beat(1))
    assert w.deadline() - clock.t == pytest.approx(hb.WORLD1_FACTOR * (20 + hb.STALL_EXTRA_S))
    # bounded still: past the stretched deadline it is a hang, told as a wait on a subprocess
    ranks, why = culprits([w.evidence(0, None)])
    assert ranks == [0] and "waiting on a subprocess" in why
    assert describe(w.evidence(0, None)).endswith(
        "on a child process (a compile that did not finish?)"
    )
    # the compile done, the rank computes again: the deadline is the usual one
    w.note(beat(0, at="/u/case.py:10 in build_tp"))
    assert w.deadline() - clock.t == pytest.approx(20 + hb.STALL_EXTRA_S)


def test_a_subprocess_module_of_the_users_own_is_not_a_wait():
    frames = _dumped([("/u/mylib/subprocess.py", 3, "wait"), ("/u/case.py", 9, "forward")])
    assert hb._spot(frames, None, None, None).state == "compute"


def test_a_rank_waiting_on_a_stale_build_lock_is_told_the_lock_file(tmp_path):
    """torch's FileBaton waiting on a lock that a killed compile left behind (a real frame of a
    real wait): the evidence names the file and says what to do."""
    import threading

    from torch.utils.file_baton import FileBaton

    lock = tmp_path / "lock"
    lock.touch()
    waiter = threading.Thread(target=FileBaton(str(lock), wait_seconds=0.01).wait)
    waiter.start()
    try:
        frame = None
        while frame is None or frame.f_code.co_name != "wait":
            frame = sys._current_frames().get(waiter.ident)
            frame = frame and next(
                (f for f in _outward(frame) if f.f_code.co_filename.endswith("file_baton.py")), None
            )
        spot = spot_of(frame, None, None)
    finally:
        lock.unlink()
        waiter.join()
    assert spot.state == "subprocess" and spot.call == str(lock), spot
    clock = Clock()
    w = Watch(world=2, case=1, timeout_s=20, clock=clock)
    w.note(beat(0, state="subprocess", at=spot.at, call=spot.call))
    said = describe(w.evidence(0, None))
    assert f"on torch's build lock {lock}" in said and "delete the file" in said


def _outward(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back
