"""Every collective wait is bounded, and a hang is told from evidence: each rank's heartbeat says
where it is (in a collective, at the checker's checkpoint, computing at a file:line, or silent), so
the rank that holds the others up is named -- not the ones waiting for it. No process is left
behind, and the verdict is a detection for the fault, a failure for a correct-looking case."""

import os
import time

from tpcheck.api import check, exit_code
from tpcheck.checker.case import CaseSpec
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.verdict.result import merge
from tpcheck.cli import main
from tpcheck.resolve import launcher as pool_launcher

from robust_helpers import skip_on_ranks

RUNTIME = os.path.join(os.path.dirname(__file__), "case_files", "runtime.py")
QUERIES = os.path.join(os.path.dirname(__file__), "case_files", "queries.py")


def _line(marker: str, path: str = RUNTIME) -> int:
    with open(path) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line)


def _run_file(name: str, timeout_s: float = 2, path: str = RUNTIME) -> dict:
    spec = file_spec(f"{path}:{name}", 2)
    (result,) = check([spec], timeout_s=timeout_s)
    return result


def test_fault_hang_is_named_bounded_and_leaves_no_process(children):
    before = children()
    hang, after = check([CaseSpec(fault="collective_on_some_ranks"), CaseSpec()], timeout_s=2)
    assert hang["verdict"] == "hang" and hang["as_expected"] is True
    # rank 1 skipped the forward all-reduce, so rank 0's forward all-reduce paired with rank 1's
    # backward one; rank 0 then waited alone in backward while rank 1 sat at the checkpoint.
    h = hang["hang"]
    assert h["stuck_in_collective"] == [
        {"rank": 0, "op": "all_reduce", "site": "gate_up", "phase": "backward"}
    ]
    assert [(w["rank"], w["checkpoint"]) for w in h["waiting_at_checkpoint"]] == [
        (1, "forward and backward of step 1")
    ]
    assert h["ledger_diff"] == (
        "collectives issued (rank 0: 2, rank 1: 1) first differ at #1: "
        "rank 0: forward all_reduce at 'down'; rank 1: backward all_reduce at 'gate_up'"
    )
    assert h["culprits"] == [] and "ranks wait in different places" in h["cause"]
    assert "in backward all_reduce at 'gate_up'" in hang["summary"]
    assert (
        "rank 1 waited" in hang["summary"]
        and "checkpoint after forward and backward of step 1" in hang["summary"]
    )
    assert after["verdict"] == "equivalent"  # the pool was respawned after the hang
    assert exit_code([hang, after]) == 0
    assert children() == before


def test_hang_in_a_correct_case_is_a_failure(register_block, capsys, children):
    before = children()
    register_block(
        "hangs_unmarked", intercept=skip_on_ranks("all_reduce", "down", "forward", ranks={1})
    )
    assert main(["run", "--block", "hangs_unmarked", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert "hang detected" in err and "in backward all_reduce at 'gate_up'" in err
    assert children() == before


def test_rank_stuck_outside_collectives_is_named_at_its_line_without_waiting_for_it(
    register_block, children
):
    """Rank 1 sleeps while building its module: rank 0's checkpoint wait times out, and the launcher
    names rank 1 -- computing at the sleeping line -- from its heartbeat, at once: it never waits
    for rank 1 (which would sleep an hour)."""

    def sleepy(module, group):
        if group.rank == group.world_size - 1:
            time.sleep(3600)  # SLEEPY

    before = children()
    spec = CaseSpec(block=register_block("sleepy", tamper=sleepy))
    t0 = time.monotonic()
    with pool_launcher(timeout_s=1) as launcher:
        result = merge(spec, launcher.run(spec)).to_json()
        # world 1: no collective, only the stall deadline
        solo = CaseSpec(block="sleepy", world_size=1)
        launcher.stall_s = 0.2
        alone = merge(solo, launcher.run(solo)).to_json()
    assert time.monotonic() - t0 < 60  # an hour's sleep was not waited for
    assert result["verdict"] == "hang" and result["as_expected"] is False
    h = result["hang"]
    assert h["culprits"] == [1]
    by_rank = {e["rank"]: e for e in h["ranks"]}
    here = f"tests/robustness/test_hang.py:{_sleepy_line()} in sleepy"
    assert by_rank[1]["state"] == "compute" and by_rank[1]["at"].endswith(here), by_rank[1]
    # the launcher's evidence: rank 1 was killed, not waited for
    assert by_rank[1]["own_report"] is False
    assert (
        by_rank[0]["state"] == "checkpoint" and by_rank[0]["checkpoint"] == "building the TP module"
    )
    assert by_rank[0]["own_report"] is True  # rank 0's own wait timed out: that decided the hang
    assert result["summary"].startswith(
        "hang detected: rank(s) [1] held the others up: rank 1 was computing at "
    )
    assert "stuck in compute" in result["summary"]
    assert alone["verdict"] == "hang" and alone["hang"]["culprits"] == [0]
    assert "no rank entered a collective or moved" in alone["summary"]
    assert children() == before


def _sleepy_line() -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if "# SLEEPY" in line and "if" not in line)


def test_rank_spinning_in_forward_is_the_culprit():
    result = _run_file("spin")
    h = result["hang"]
    assert result["verdict"] == "hang" and h["culprits"] == [1]
    spin = {e["rank"]: e for e in h["ranks"]}[1]
    assert spin["state"] == "compute" and spin["at"].endswith(
        f"runtime.py:{_line('# SPIN')} in forward"
    ), spin
    assert (
        "rank 1 was computing at" in result["summary"]
        and "checker:replicas" not in result["summary"]
    )


def test_ranks_waiting_on_a_compile_longer_than_the_stall_deadline_are_not_a_hang():
    """Every rank waits 7 s on a child process (a JIT compile) with a 1 s timeout (a 5 s stall
    deadline when ranks compute): the wait is the subprocess's, the deadline stretches, and the
    case is checked to the end."""
    result = _run_file("compiles", timeout_s=1)
    assert result["verdict"] == "equivalent", result["summary"]


def test_stopped_rank_is_named_as_not_responding():
    """SIGSTOP on rank 1: no heartbeat; the process state says why."""
    result = _run_file("stop")
    h = result["hang"]
    assert result["verdict"] == "hang" and h["culprits"] == [1]
    stopped = {e["rank"]: e for e in h["ranks"]}[1]
    assert stopped["state"] == "unresponsive" and "stopped by a signal" in stopped["process"], (
        stopped
    )
    assert "rank 1 sent no heartbeat" in result["summary"]


def test_users_own_collective_on_one_rank_is_named_at_its_line():
    """A torch.distributed call the checker does not tap: named by the line that issued it, never by
    the label of the checker's last collective."""
    result = _run_file("one_sided")
    h = result["hang"]
    assert result["verdict"] == "hang"
    r0 = {e["rank"]: e for e in h["ranks"]}[0]
    assert r0["state"] == "collective" and r0["call"] == "all_reduce"
    assert r0["at"].endswith(f"runtime.py:{_line('# ONE SIDED')} in forward"), r0
    assert "in forward torch.distributed.all_reduce called at" in result["summary"]
    assert "checker:replicas" not in result["summary"]
    # the user's own collectives are counted: the ledgers part at it
    assert h["ledger_diff"] == (
        "collectives issued (rank 0: 1, rank 1: 0) first differ at #1: "
        "rank 0: forward all_reduce at 'torch.distributed'; rank 1: nothing"
    )


def test_rank_spinning_on_a_query_is_computing_not_waiting_in_a_collective():
    """`dist.get_rank()` in a loop on rank 1 is compute, at its line: rank 1 holds rank 0 (waiting
    in its all-reduce) up, and is never said to wait in torch.distributed.get_rank."""
    result = _run_file("query_spin", path=QUERIES)
    h = result["hang"]
    assert result["verdict"] == "hang" and h["culprits"] == [1], result["summary"]
    by_rank = {e["rank"]: e for e in h["ranks"]}
    spin = by_rank[1]
    assert spin["state"] == "compute" and spin["at"].endswith(
        f"queries.py:{_line('# QUERY SPIN', QUERIES)} in forward"
    ), spin
    assert by_rank[0]["state"] == "collective" and by_rank[0]["call"] == "all_reduce"
    assert "rank 1 was computing at" in result["summary"]
    assert "get_rank" not in result["summary"]


def test_sigint_to_one_rank_inside_a_case_is_reported_as_such():
    result = _run_file("sigint")
    assert result["verdict"] == "error"
    assert "rank 1 was interrupted (SIGINT) while running the case" in result["summary"]
    assert "outside a case" not in result["summary"]
