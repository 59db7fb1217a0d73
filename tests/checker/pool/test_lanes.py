"""`Lanes` (checker/pool/session.py): several launchers running one list of specs side by side, as
`tpcheck hf` runs its sweep. The results are those of one launcher, in the order of the specs, each
case on one pool at a time; a failure of the checker in a lane reaches the caller."""

import dataclasses

import pytest

from tpcheck import CaseSpec, RunSettings
from tpcheck.checker.pool import session
from tpcheck.checker.pool.launch import MAX_LIVE_RANKS
from tpcheck.checker.pool.session import Lanes, run_specs
from tpcheck.resolve import launcher

BASE = CaseSpec(
    block="mlp",
    preset="seed",
    world_size=2,
    run=RunSettings(steps=1, micro_batches=1),
    overrides=(("hidden", 8), ("ffn", 8), ("seq", 2), ("batch", 1)),
)
SPECS = [
    BASE,
    dataclasses.replace(BASE, fault="missing_forward_reduce"),
    dataclasses.replace(BASE, world_size=1),
    dataclasses.replace(BASE, fault="missing_backward_reduce"),
    dataclasses.replace(BASE, run=RunSettings(steps=1, micro_batches=1, seed=7)),
]
EXPECTED = [
    (None, 2, "equivalent"),
    ("missing_forward_reduce", 2, "not equivalent"),
    (None, 1, "equivalent"),
    ("missing_backward_reduce", 2, "not equivalent"),
    (None, 2, "equivalent"),
]


def _verdicts(results):
    return [(r.spec.fault, r.spec.world_size, r.verdict) for r in results]


def test_lanes_give_one_launchers_results_in_the_order_of_the_specs():
    with launcher(60) as one:
        alone = run_specs(SPECS, one)
    lanes = Lanes([launcher(60), launcher(60)])
    seen = []
    try:
        side_by_side = run_specs(SPECS, lanes, seen.append)
        used = [bool(lane.pools) for lane in lanes.launchers]
    finally:
        lanes.close()
    assert side_by_side == [] and len(seen) == len(SPECS)
    assert _verdicts(seen) == _verdicts(alone)
    assert _verdicts(alone) == EXPECTED
    assert used == [True, True]  # both lanes ran cases
    # the ranks alive at once over both lanes stay within one launcher's cap
    assert [lane.max_live_ranks for lane in lanes.launchers] == [MAX_LIVE_RANKS // 2] * 2
    assert all(not lane.pools for lane in lanes.launchers)  # closed together


def test_a_checker_failure_in_a_lane_reaches_the_caller(monkeypatch):
    real = session.run_case

    def broken(spec, launcher, ran=None):
        if spec.fault == "missing_backward_reduce":
            raise RuntimeError("the checker broke on this case")
        return real(spec, launcher, ran)

    monkeypatch.setattr(session, "run_case", broken)
    lanes = Lanes([launcher(60), launcher(60)])
    seen = []
    try:
        with pytest.raises(RuntimeError, match="the checker broke"):
            run_specs(SPECS, lanes, seen.append)
    finally:
        lanes.abort()
    # what was handed over came in the order of the specs, and none at or after the broken one
    assert len(seen) <= 3 and _verdicts(seen) == EXPECTED[: len(seen)]
