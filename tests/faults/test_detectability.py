"""Detectability, as docs/tolerances.md states it: the smallest error in one rank's partial sums and
in one rank's learning rate that a run flags, per dtype at world sizes 2, 4 and 8, with the working
dtype's bounds alone and with the default float64 run beside 16-bit ones (the script
benchmarks/detectability.py prints the same tables). Every size at or above the stated one is
caught; correct twins pass (the planted size 0 is a correct case)."""

import dataclasses

import pytest

from tpcheck import check
from tpcheck.faults.detectability import Probe, probes, target, thresholds

WORLDS = (2, 4, 8)
# what docs/tolerances.md states (the smallest size of the grid flagged from there up, seed 1), for
# the working dtype's own bounds (`float64_run="off"`); a target of the issue that is missed is
# stated as missed there, with what bounds it
STATED = {
    ("partial", "float32"): {2: 1e-5, 4: 1e-5, 8: 1e-5},
    ("partial", "float16"): {2: 0.02, 4: 0.02, 8: 0.03},
    ("partial", "bfloat16"): {2: 0.1, 4: 0.2, 8: 0.2},
    ("lr", "float32"): {2: 1e-6, 4: 1e-6, 8: 1e-6},
    ("lr", "float16"): {2: 1e-6, 4: 1e-6, 8: 1e-6},
    ("lr", "bfloat16"): {2: 1e-6, 4: 1e-6, 8: 1e-6},
}
# a default run (`float64_run="auto"`): the float64 run beside a 16-bit one sees a partial-sum
# error at the smallest size probed
STATED_DEFAULT = {
    **STATED,
    ("partial", "float16"): {2: 1e-7, 4: 1e-7, 8: 1e-7},
    ("partial", "bfloat16"): {2: 1e-7, 4: 1e-7, 8: 1e-7},
}


def _same_run(p: Probe) -> Probe:
    """The probe as it runs: float32 has no float64 run in either setting (auto is off there)."""
    return dataclasses.replace(p, float64_run="off") if p.dtype == "float32" else p


@pytest.fixture(scope="module")
def verdicts() -> dict[Probe, dict]:
    """Both settings' probes, each distinct run once (the float32 probes serve both)."""
    run = {
        _same_run(p): None
        for f in ("off", "auto")
        for p in probes(worlds=WORLDS, seeds=(1,), float64_run=f)
    }
    return dict(zip(run, check([p.spec() for p in run])))


@pytest.mark.slow
@pytest.mark.parametrize("float64_run", ["off", "auto"])
def test_detectability_is_what_the_docs_state(verdicts, float64_run):
    run = probes(worlds=WORLDS, seeds=(1,), float64_run=float64_run)
    results = [verdicts[_same_run(p)] for p in run]
    found = thresholds(run, results)
    stated_table = STATED if float64_run == "off" else STATED_DEFAULT
    for (kind, dtype, world), threshold in found.items():
        stated = stated_table[(kind, dtype)][world]
        assert threshold is not None and threshold <= stated, (
            kind,
            dtype,
            world,
            float64_run,
            threshold,
            stated,
        )
        # bf16 partial sums in bfloat16's own bounds: the target is missed (docs say why)
        if float64_run == "auto" or dtype != "bfloat16" or kind == "lr":
            assert threshold <= target(kind, dtype, world), (kind, dtype, world, threshold)


def test_a_correct_twin_of_every_probe_passes():
    """Size 0 plants nothing: the probe machinery itself does not make a case fail."""
    run = [
        Probe(kind, dtype, world, 0.0, 1)
        for kind in ("partial", "lr")
        for dtype in ("float32", "bfloat16")
        for world in (2, 4)
    ]
    for r in check([p.spec() for p in run]):
        assert r["verdict"] == "equivalent", r["summary"]
