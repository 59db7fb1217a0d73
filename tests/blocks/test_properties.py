"""Property tests: a correct MLP is never flagged and the seed's two faults always are, over random
shapes, world sizes {1, 2, 4}, seeds, dtypes, optimizers and sequence parallelism; and no correct
case of any block is flagged over random cases from `tpcheck.blocks.sampling` (fixed seeds, printed;
in the slow tests the 2,000 cases that docs/tolerances.md reports (half here, half in
test_false_alarm_sweep.py), the 500 with an outlier in test_outlier_sweep.py;
TPCHECK_SWEEP_SEED=random explores)."""

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.blocks.sampling import random_specs
from tpcheck.checker.pool.session import run_specs
from tpcheck.resolve import launcher as pool_launcher


@pytest.fixture(scope="module")
def launcher():
    with pool_launcher(timeout_s=60) as launcher:
        yield launcher


@st.composite
def mlp_specs(draw):
    world = draw(st.sampled_from([1, 2, 4]))
    sp = draw(st.booleans())
    overrides = (
        ("seq", world * draw(st.integers(1, 3)) if sp else draw(st.integers(1, 6))),
        ("batch", draw(st.integers(1, 3))),
        ("hidden", draw(st.sampled_from([8, 16, 64, 128]))),
        ("ffn", world * draw(st.integers(1, 24))),
    )
    return CaseSpec(
        block="mlp",
        preset="seed",
        world_size=world,
        run=RunSettings(
            dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
            seed=draw(st.integers(0, 10_000)),
            optimizer=draw(st.sampled_from(["sgd", "adamw"])),
            steps=draw(st.integers(1, 3)),
            micro_batches=draw(st.integers(1, 3)),
        ),
        sequence_parallel=sp,
        overrides=overrides,
    )


def _no_false_alarm_and_seed_faults_flagged(launcher, spec):
    import dataclasses

    specs = [spec]
    if spec.world_size > 1 and not spec.sequence_parallel:
        specs += [
            dataclasses.replace(spec, fault=f)
            for f in ("missing_forward_reduce", "missing_backward_reduce")
        ]
    correct, *faulty = run_specs(specs, launcher)  # typed CaseResults
    assert correct.verdict == "equivalent", correct.summary
    assert correct.self_test.failures == [] and correct.self_test.flagged > 0
    for r in faulty:
        assert r.verdict == "not equivalent", r.summary
        assert r.diagnosis.signature == "partial_sum", r.summary


@settings(
    max_examples=12,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(spec=mlp_specs())
def test_no_false_alarm_and_seed_faults_always_flagged(launcher, spec):
    _no_false_alarm_and_seed_faults_flagged(launcher, spec)


@pytest.mark.slow
@settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(spec=mlp_specs())
def test_no_false_alarm_and_seed_faults_always_flagged_60_examples(launcher, spec):
    _no_false_alarm_and_seed_faults_flagged(launcher, spec)


def _sweep_seed(default: int) -> int:
    """A fixed set of examples (CI is deterministic); TPCHECK_SWEEP_SEED draws another, `random` a
    fresh one (docs/tolerances.md records the one false alarm a fresh seed has found)."""
    value = os.environ.get("TPCHECK_SWEEP_SEED", str(default))
    return random.randrange(2**31) if value == "random" else int(value)


def _no_false_alarm(
    n: int, seed: int, float64_run: str = "auto", part: slice = slice(None), **kw
) -> None:
    """No false alarm on the `part` of `n` random correct cases of `seed` (a slice: the 2,000-case
    sweep runs as two interleaved halves, one per file, so that the slow suite's two workers share
    it)."""
    specs = [s.with_run(float64_run=float64_run) for s in random_specs(seed, n, **kw)[part]]
    results = check(specs)
    false_alarms = [r for r in results if r["verdict"] != "equivalent"]
    worst = max(
        (
            c["error"] / c["bound"]
            for r in results
            if "checks" in r
            for c in r["checks"]
            if c["kind"] == "calibrated" and c["bound"]
        ),
        default=0.0,
    )
    print(
        f"{len(specs)} of {n} random correct cases ({part}), TPCHECK_SWEEP_SEED={seed}: "
        f"max error/bound {worst:.3f}"
    )
    assert not false_alarms, f"TPCHECK_SWEEP_SEED={seed}: " + "; ".join(
        f"{r['name']} {r['spec']['overrides']} seed {r['spec']['seed']}: {r['summary']}"
        for r in false_alarms[:5]
    )
    assert worst <= 1.0


@pytest.mark.slow
def test_no_false_alarm_on_random_correct_cases():
    """Every block, float32/bfloat16/float16, world 1-8, SP on/off, 1-3 micro-batches, 1-3 steps (24
    cases of seed 2027; the slow test beside it runs 2,000, and the property test above stays in
    `make test`)."""
    _no_false_alarm(24, _sweep_seed(2027))


@pytest.mark.slow
def test_no_false_alarm_on_2000_random_correct_cases_even_half():
    """The sweep behind the bound's factor, as docs/tolerances.md reports it (2,000 random correct
    cases, seed 11; TPCHECK_SWEEP_SEED draws another set): the working dtype's bounds, without the
    float64 run beside 16-bit cases (the 24 cases above and the outlier sweep run it too). Cases
    0, 2, 4, ...; the odd ones are in test_false_alarm_sweep.py."""
    _no_false_alarm(2000, _sweep_seed(11), float64_run="off", part=slice(0, None, 2))
