"""The heartbeat samples a rank's stack at an instant it does not choose, so `spot_of` must be right
at every one: here a tracer stops a real torch.distributed call (a 1-rank gloo group in this
process, tpcheck's counting wrapper installed as in a rank) at every call, line, return and
exception event, and the spot is read right there. A collective is named by what the user called
(never torch's `wrapper`, nor a helper such as `_check_single_tensor`) at the user's line, from the
moment the call is entered, through the wait, to its failure unwinding; a query (`get_rank`) is
computing at the user's line."""

import os
import sys

import pytest
import torch
import torch.distributed as dist

from tpcheck.checker.pool.heartbeat import COLLECTIVES, BeatMaker, spot_of
from tpcheck.checker.rank.ledger import USER_COLLECTIVES, CollectiveTap, count_user_collectives
from tpcheck.parallel import group as tpgroup
from tpcheck.parallel.group import TPGroup

_DIST_DIR = os.path.dirname(dist.__file__) + os.sep


@pytest.fixture
def tap(monkeypatch):
    """A 1-rank gloo group in this process, torch.distributed's collectives wrapped by
    `count_user_collectives` (as in a pool rank) around a tap in its forward phase;
    torch.distributed is restored and the group destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    for name in USER_COLLECTIVES:
        for module in (c10d, dist):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(module, name))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tap = CollectiveTap(0)
    count_user_collectives(lambda: tap)
    try:
        with tap.tp_phase("forward"):
            yield tap
    finally:
        dist.destroy_process_group()


def _users_all_reduce(t):
    dist.all_reduce(t)  # USER ALL_REDUCE
    return t


def _users_query():
    return dist.get_rank()  # USER QUERY


def _users_tp_all_gather(group, t):
    return group.collective("all_gather", t, site="s", phase="forward")  # USER TPGROUP


def _line(marker: str) -> str:
    with open(__file__) as f:
        n = next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {marker}"))
    return f"test_heartbeat_instants.py:{n}"


def _in_distributed(frame, counted_code) -> bool:
    """Whether the stack has entered torch.distributed (or tpcheck's wrapper of its functions)."""
    while frame is not None:
        code = frame.f_code
        if code is counted_code or code.co_filename.startswith(_DIST_DIR):
            return True
        frame = frame.f_back
    return False


def _instants(run, read, through: bool = False):
    """Run `run()` under a tracer; at every event inside torch.distributed (or tpcheck's wrapper
    around it; `through`: and at every one after entering it, until `run` is done), `read(frame)`
    right there (a frame's line moves on after the event). Returns [(where the event is, what
    `read` gave)]."""
    counted_code = dist.all_reduce.__code__  # the ledger's `counted`, shared by every collective
    seen = []

    def tracer(frame, event, arg):
        if _in_distributed(frame, counted_code) or (through and seen):
            here = f"{event} {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
            seen.append((f"{here} in {frame.f_code.co_name}", read(frame)))
        return tracer

    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        run()
    except (TypeError, ValueError, RuntimeError):
        pass
    finally:
        sys.settrace(before)
    return seen


def _wrong(seen, state, call, at):
    return [
        (where, (s.state, s.call, s.at))
        for where, s in seen
        if (s.state, s.call) != (state, call) or not s.at.endswith(at)
    ]


def test_every_instant_of_a_users_all_reduce_is_that_collective_at_the_users_line(tap):
    """From entering `dist.all_reduce` (tpcheck's `counted`, torch's c10d_logger `wrapper`) to its
    wait and return, from the stack alone (no tap state): the call is "all_reduce", placed at the
    line that issued it -- also in torch's helpers and the queries all_reduce makes itself."""
    seen = _instants(lambda: _users_all_reduce(torch.ones(3)), lambda f: spot_of(f, None, None))
    assert len(seen) > 20 and any(" in wrapper" in w for w, _ in seen)
    assert any(" in _check_single_tensor" in w for w, _ in seen), "torch's helpers are traced"
    user = f"{_line('USER ALL_REDUCE')} in _users_all_reduce"
    assert _wrong(seen, "collective", "all_reduce", user) == []


def test_every_instant_of_a_failing_all_reduce_is_that_collective_until_the_checker_has_it(tap):
    """A collective that raises (a timeout, here a bad argument) goes through c10d_logger's
    exception path (`_get_msg_dict`: get_backend, get_rank...; logging) and unwinds through
    the user's code into the checker's. The beats say the rank is in all_reduce at the user's
    line all along: past the user's frame too, as long as the tap holds the collective."""
    maker = BeatMaker(0)
    seen = _instants(
        lambda: _users_all_reduce("not a tensor"),
        lambda f: maker.beat(1, tap, None, f).spot,
        through=True,
    )
    assert any(" in _get_msg_dict" in w for w, _ in seen), "the failure path is traced"
    assert any(w.startswith("exception test_heartbeat_instants.py") for w, _ in seen)
    user = f"{_line('USER ALL_REDUCE')} in _users_all_reduce"
    assert _wrong(seen, "collective", "all_reduce", user) == []
    # unwound into the caller (the checker's engine in a rank): still that collective, there
    after = maker.beat(1, tap, None, sys._getframe())
    assert (after.spot.state, after.spot.call) == ("collective", "all_reduce")
    assert after.spot.at.endswith(user), after.spot
    assert tap.inside == ("all_reduce", "torch.distributed", "forward")


def test_every_instant_of_a_tpgroup_collective_is_named_at_the_line_that_called_the_group(tap):
    """tpcheck's own collective (TPGroup -> tap -> torch's all_gather_single or
    all_gather_into_tensor): the call is torch's function, at the caller of the group."""
    group = TPGroup(rank=0, world_size=1, pg=dist.group.WORLD, tap=tap)
    seen = _instants(
        lambda: _users_tp_all_gather(group, torch.ones(2, 3)), lambda f: spot_of(f, None, None)
    )
    name = tpgroup._ALL_GATHER.__name__
    assert name in COLLECTIVES and len(seen) > 10
    user = f"{_line('USER TPGROUP')} in _users_tp_all_gather"
    assert _wrong(seen, "collective", name, user) == []


def test_every_instant_of_a_query_is_compute_at_the_users_line(tap):
    """dist.get_rank() waits for no rank: a rank in it is computing at the line that asked."""
    seen = _instants(_users_query, lambda f: spot_of(f, None, None))
    assert any(" in get_rank" in w for w, _ in seen)
    assert _wrong(seen, "compute", None, f"{_line('USER QUERY')} in _users_query") == []


def test_the_collectives_are_the_ledgers_and_tpgroups_and_queries_are_not():
    assert set(USER_COLLECTIVES) <= COLLECTIVES
    assert {tpgroup._ALL_GATHER.__name__, tpgroup._REDUCE_SCATTER.__name__} <= COLLECTIVES
    queries = ("get_rank", "get_world_size", "is_initialized", "get_backend", "get_group_rank")
    assert not COLLECTIVES & set(queries)
