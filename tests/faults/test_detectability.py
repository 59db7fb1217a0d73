"""Detectability, as docs/tolerances.md states it: the smallest error in one rank's partial sums and
in one rank's learning rate that a default run flags, per dtype at world sizes 2, 4 and 8 (the
script benchmarks/detectability.py prints the same table). Every size at or above the stated one is
caught; correct twins pass (the planted size 0 is a correct case)."""

import pytest

from tpcheck import check
from tpcheck.faults.detectability import Probe, probes, target, thresholds

WORLDS = (2, 4, 8)
# what docs/tolerances.md states (the smallest size of the grid flagged from there up, seed 1); a
# target of the issue that is missed is stated as missed there, with what bounds it
STATED = {
    ("partial", "float32"): {2: 1e-5, 4: 1e-5, 8: 1e-5},
    ("partial", "float16"): {2: 0.02, 4: 0.02, 8: 0.03},
    ("partial", "bfloat16"): {2: 0.1, 4: 0.2, 8: 0.2},
    ("lr", "float32"): {2: 1e-6, 4: 1e-6, 8: 1e-6},
    ("lr", "float16"): {2: 1e-6, 4: 1e-6, 8: 1e-6},
    ("lr", "bfloat16"): {2: 1e-6, 4: 1e-6, 8: 1e-6},
}


@pytest.mark.slow
def test_detectability_is_what_the_docs_state():
    run = probes(worlds=WORLDS, seeds=(1,))
    results = check([p.spec() for p in run])
    found = thresholds(run, results)
    for (kind, dtype, world), threshold in found.items():
        stated = STATED[(kind, dtype)][world]
        assert threshold is not None and threshold <= stated, (
            kind,
            dtype,
            world,
            threshold,
            stated,
        )
        # bf16 partial sums: the target is missed (docs say why)
        if dtype != "bfloat16" or kind == "lr":
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
