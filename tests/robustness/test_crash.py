"""A rank that raises or dies brings the case down cleanly: an "error" result with the rank's
traceback (in problems and in the console summary), exit code 2, and in a matrix the next case runs
on a respawned pool. No process is left behind."""

import os
import signal

from tpcheck.api import check, exit_code
from tpcheck.checker.case import CaseSpec
from tpcheck.cli import main


def _on_rank1(action):
    def tamper(module, group):
        if group.rank == 1:
            action()

    return tamper


def _raise():
    raise RuntimeError("boom on rank 1")


def test_crashes_in_a_matrix_fail_their_case_and_the_matrix_goes_on(register_block, children):
    before = children()
    register_block("crash_exc", tamper=_on_rank1(_raise))
    register_block("crash_exit", tamper=_on_rank1(lambda: os._exit(3)))
    register_block("crash_kill", tamper=_on_rank1(lambda: os.kill(os.getpid(), signal.SIGKILL)))
    specs = [CaseSpec(block=b) for b in ("crash_exc", "mlp", "crash_exit", "crash_kill", "mlp")]
    exc, ok1, exited, killed, ok2 = results = check(specs, timeout_s=10)
    assert [r["verdict"] for r in results] == [
        "error",
        "equivalent",
        "error",
        "error",
        "equivalent",
    ]
    assert exit_code(results) == 3  # no verdict: not bad input (2)
    # rank 0 was stopped because rank 1 failed, not by its own timeout
    for crashed in (exc, exited, killed):
        (peer,) = [p for p in crashed["problems"] if p["rank"] == 0]
        assert peer["status"] == "aborted", peer
    (problem,) = [p for p in exc["problems"] if p["rank"] == 1]
    assert problem["status"] == "error" and "boom on rank 1" in problem["message"]
    assert "Traceback" in problem["traceback"] and "in _raise" in problem["traceback"]
    assert exc["summary"].startswith("error: rank 1: RuntimeError: boom on rank 1")
    assert "in _raise" in exc["summary"]  # the traceback's tail, shown in the console summary
    assert "rank 1 died (exited with code 3)" in exited["summary"]
    assert "rank 1 died (killed by signal SIGKILL)" in killed["summary"]
    assert all(not r["as_expected"] for r in (exc, exited, killed))
    assert children() == before


def test_single_crashing_case_exits_3_and_prints_the_traceback(register_block, capsys, children):
    before = children()
    register_block("crash_exc", tamper=_on_rank1(_raise))
    assert main(["run", "--block", "crash_exc", "--timeout", "10"]) == 3
    err = capsys.readouterr().err
    assert (
        "boom on rank 1" in err
        and "in _raise" in err
        and 'raise RuntimeError("boom on rank 1")' in err
    )
    assert children() == before


def test_a_rank_the_collective_library_aborts_is_explained_rank_by_rank(capfd, children):
    """gloo aborts (SIGABRT) a rank whose all-reduce meets one of another size: here rank 0 issues a
    debug all-reduce of 1024 elements alone, then every rank one of its own. The result names each
    rank's line and collective -- the dead rank's from the stacks its faulthandler dumped -- and the
    cause; no faulthandler dump ("Fatal Python error") reaches the parent's output."""
    from tpcheck.checker.casefile import file_spec

    before = children()
    path = os.path.join(os.path.dirname(__file__), "case_files", "runtime.py")
    (result,) = check([file_spec(f"{path}:mismatched", 2)], timeout_s=10)
    lines = open(path).read().splitlines()
    extra = next(i for i, s in enumerate(lines, 1) if "# EXTRA" in s)
    every = next(i for i, s in enumerate(lines, 1) if "# EVERY RANK" in s)
    assert result["verdict"] == "error", result["summary"]
    crash = result["crash"]
    died = [r for r in crash["ranks"] if r["status"] == "crash"]
    assert (
        died and "SIGABRT" in result["summary"] and "collective library aborted" in crash["cause"]
    )
    doing = {r["rank"]: r["doing"] for r in crash["ranks"]}
    assert f"runtime.py:{extra} in forward" in doing[0] and "4096 bytes" in doing[0], doing
    for r in died:
        assert "torch.distributed.all_reduce called at" in r["doing"], r
        assert f"runtime.py:{every} in forward" in r["doing"] or f":{extra} " in r["doing"], r
    (dead,) = [p for p in result["problems"] if p["status"] == "crash"]
    assert dead["where"]["state"] == "collective" and dead["where"]["call"] == "all_reduce"
    assert "Fatal Python error" not in capfd.readouterr().err
    assert children() == before
