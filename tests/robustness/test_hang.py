"""Every collective wait is bounded: a collective issued on some ranks only ends, in seconds, as a
"hang" naming the stuck rank, its collective and the ranks waiting at the checkpoint; no process is
left behind; and the verdict is a detection for the fault, a failure for a correct-looking case."""
import time

from tpcheck.api import check, exit_code
from tpcheck.check.case import CaseSpec
from tpcheck.check.result import merge
from tpcheck.cli import main
from tpcheck.resolve import launcher as pool_launcher

from robust_helpers import skip_on_ranks


def test_fault_hang_is_named_bounded_and_leaves_no_process(children):
    before = children()
    t0 = time.monotonic()
    hang, after = check([CaseSpec(fault="collective_on_some_ranks"), CaseSpec()], timeout_s=2)
    elapsed = time.monotonic() - t0
    assert hang["verdict"] == "hang" and hang["as_expected"] is True
    # rank 1 skipped the forward all-reduce, so rank 0's forward all-reduce paired with rank 1's
    # backward one; rank 0 then waited alone in backward while rank 1 sat at the checkpoint.
    h = hang["hang"]
    assert h["stuck_in_collective"] == [{"rank": 0, "op": "all_reduce", "site": "gate_up", "phase": "backward"}]
    assert [(w["rank"], w["checkpoint"]) for w in h["waiting_at_checkpoint"]] == [
        (1, "forward and backward of step 1")]
    assert h["ledger_diff"] == ("collectives issued (rank 0: 2, rank 1: 1) first differ at #1: "
                                "rank 0: forward all_reduce at 'down'; rank 1: backward all_reduce at 'gate_up'")
    assert "rank 0 stuck in backward all_reduce at 'gate_up'" in hang["summary"]
    assert "rank(s) [1] waiting at the checker's checkpoint" in hang["summary"]
    assert after["verdict"] == "equivalent"  # the pool was respawned after the hang
    assert exit_code([hang, after]) == 0
    assert elapsed < 20, elapsed
    assert children() == before


def test_hang_in_a_correct_case_is_a_failure(register_block, capsys, children):
    before = children()
    register_block("hangs_unmarked", intercept=skip_on_ranks("all_reduce", "down", "forward", ranks={1}))
    assert main(["run", "--block", "hangs_unmarked", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert "hang detected" in err and "stuck in backward all_reduce at 'gate_up'" in err
    assert children() == before


def test_rank_stuck_outside_collectives_is_killed(register_block, children):
    """Rank 1 never reaches a collective: rank 0 times out in its forward all-reduce and the launcher,
    after the grace, kills rank 1 and says where it was last seen."""
    def sleepy(module, group):
        if group.rank == group.world_size - 1:
            time.sleep(3600)

    before = children()
    spec = CaseSpec(block=register_block("sleepy", tamper=sleepy))
    t0 = time.monotonic()
    with pool_launcher(timeout_s=1) as launcher:
        result = merge(spec, launcher.run(spec)).to_json()
        solo = CaseSpec(block="sleepy", world_size=1)  # world 1: no collective, only the stall deadline
        launcher.stall_s = 0.2
        alone = merge(solo, launcher.run(solo)).to_json()
    assert time.monotonic() - t0 < 15
    assert result["verdict"] == "hang" and result["as_expected"] is False
    h = result["hang"]
    assert [w["rank"] for w in h["waiting_at_checkpoint"]] == [0]
    assert [o["rank"] for o in h["other"]] == [1] and "rank 1 was stopped" in result["summary"]
    assert "never reached a collective or checkpoint" in result["summary"]
    assert alone["verdict"] == "hang" and "no sign of progress" in alone["summary"]
    assert children() == before
