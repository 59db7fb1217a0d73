"""Mutation score: every catalogue fault is caught on every block it names, at world sizes 2 and 4,
in float32, bfloat16 and float16 (where it applies: `Fault.dtypes` says where a fault is below a
dtype's resolution, docs/tolerances.md), by a default run; in float32 first at its expected stage,
at its earliest step (and, for a fault of the decode path, its earliest decode pass), with its
expected signature; in 16 bits never before that point (no earlier
false alarm); and the correct twin of each case passes. The 16-bit half is marked slow."""

import dataclasses

import pytest

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.faults import CATALOGUE

WORLDS = (2, 4)
DTYPES = ("float32", "bfloat16", "float16")
# the step where a fault first acts: a stale weight
# cache and a reset optimizer state need a step before
FIRST_STEP = {"weight_cached_at_first_forward": 2, "state_reset_on_sharded": 2}
# the stages of a step in the order the engine compares them (checker/rank/engine.py)
ORDER = ("weights", "forward", "loss", "backward", "replicas", "grads", "optimizer")
# the decode pass where a fault first acts (checker/rank/forward_only.py; 0: the prefill, or a
# block that does not decode): a cache slot written wrong in a decode pass is read by the next one
FIRST_PASS = {"decode_cache_offset": 2}


def first_step(fault) -> int:
    """Weights as loaded are step 0; everything else can
    show at step 1 unless it needs a step before."""
    return FIRST_STEP.get(fault.name, 0 if fault.expected_stage == "weights" else 1)


def decode_pass(check_name: str) -> int:
    """The decode pass a check belongs to: K for "...:decodeK", else 0."""
    head, _, k = check_name.rpartition(":decode")
    return int(k) if head and k.isdigit() else 0


def _cases(dtypes):
    """(fault, world, faulty spec) for every fault on every block it names, at every world size in
    WORLDS and every dtype in `dtypes` where it applies (the tiny preset has every block)."""
    out = []
    for fault in CATALOGUE.values():
        if fault.expected_stage == "hang":
            continue
        for block in fault.blocks:
            for world in WORLDS:
                for dtype in dtypes:
                    if fault.applies(block, world, "adamw", dtype):
                        out.append(
                            (
                                fault,
                                world,
                                fault.prepare(
                                    CaseSpec(
                                        block=block,
                                        preset="tiny",
                                        world_size=world,
                                        run=RunSettings(dtype=dtype),
                                    )
                                ),
                            )
                        )
    return out


def _first_block_world_2(cases):
    """Each fault on the first block it names, at world 2 where it applies there (else its first
    world): what every `make test` runs (the rest: slow)."""
    firsts = {}
    # stable: the blocks keep their order
    for fault, world, spec in sorted(cases, key=lambda c: c[1] != 2):
        firsts.setdefault(fault.name, (fault, world, spec))
    return list(firsts.values())


ALL_FLOAT32 = _cases(DTYPES[:1])
CASES = _first_block_world_2(ALL_FLOAT32)
CASES_MORE = [c for c in ALL_FLOAT32 if c not in CASES]
CASES_16BIT = _cases(DTYPES[1:])


def _run(cases):
    specs = []
    for _, _, faulty in cases:
        specs += [faulty, dataclasses.replace(faulty, fault=None)]  # the fault and its correct twin
    unique = list(dict.fromkeys(specs))  # correct twins repeat across faults: run each once
    return dict(zip(unique, check(unique)))


@pytest.fixture(scope="module")
def results():
    return _run(CASES)


@pytest.fixture(scope="module")
def results_more():
    return _run(CASES_MORE)


@pytest.fixture(scope="module")
def results_16bit():
    return _run(CASES_16BIT)


def test_every_fault_is_exercised():
    assert set(FIRST_PASS) <= {n for n, f in CATALOGUE.items() if "decode" in f.blocks}
    assert {f.name for f, _, _ in CASES} == {
        n for n, f in CATALOGUE.items() if f.expected_stage != "hang"
    }
    # and in the slow suite on every block it names at world 2 and 4
    assert {(f.name, s.block, w) for f, w, s in CASES + CASES_MORE} == {
        (n, b, w)
        for n, f in CATALOGUE.items()
        if f.expected_stage != "hang"
        for b in f.blocks
        for w in WORLDS
        if f.applies(b, w)
    }
    # every fault that applies in a 16-bit dtype is exercised there too
    assert {f.name for f, _, _ in CASES_16BIT} == {
        n
        for n, f in CATALOGUE.items()
        if f.expected_stage != "hang" and {"bfloat16", "float16"} & set(f.dtypes)
    }


def caught_and_twin_passes(results: dict, faulty: CaseSpec) -> dict:
    """The faulty case's first divergence, after asserting
    it is caught and its correct twin passes."""
    r = results[faulty]
    assert r["verdict"] == "not equivalent" and r["as_expected"], r["summary"]
    twin = results[dataclasses.replace(faulty, fault=None)]
    assert twin["verdict"] == "equivalent" and twin["as_expected"], twin["summary"]
    return r["first_divergence"] | {
        "summary": r["summary"],
        "signature": r["diagnosis"]["signature"],
    }


def _caught_at_its_stage(results, fault, faulty):
    first = caught_and_twin_passes(results, faulty)
    assert (first["stage"], first["step"]) == (fault.expected_stage, first_step(fault)), first[
        "summary"
    ]
    assert decode_pass(first["name"]) == FIRST_PASS.get(fault.name, 0), first["summary"]
    assert first["signature"] == fault.expected_signature, first["summary"]


@pytest.mark.parametrize(
    "fault,world,faulty",
    CASES,
    ids=[f"{f.name}-{s.block}-tp{w}-{s.settings.dtype}" for f, w, s in CASES],
)
def test_fault_caught_at_its_stage_and_twin_passes(results, fault, world, faulty):
    _caught_at_its_stage(results, fault, faulty)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,world,faulty",
    CASES_MORE,
    ids=[f"{f.name}-{s.block}-tp{w}-{s.settings.dtype}" for f, w, s in CASES_MORE],
)
def test_fault_caught_on_every_block_and_world(results_more, fault, world, faulty):
    _caught_at_its_stage(results_more, fault, faulty)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault,world,faulty",
    CASES_16BIT,
    ids=[f"{f.name}-{s.block}-tp{w}-{s.settings.dtype}" for f, w, s in CASES_16BIT],
)
def test_fault_caught_in_16_bit_and_twin_passes(results_16bit, fault, world, faulty):
    first = caught_and_twin_passes(results_16bit, faulty)
    # caught where the fault acts or later (where its
    # effect first exceeds 16-bit rounding), never before
    earliest = (first_step(fault), ORDER.index(fault.expected_stage), FIRST_PASS.get(fault.name, 0))
    seen = (first["step"], ORDER.index(first["stage"]), decode_pass(first["name"]))
    assert seen >= earliest, first["summary"]


def test_seed_missing_backward_reduce_is_localized_to_the_grad_entering_the_tp_region():
    (r,) = check(
        [
            CaseSpec(
                block="mlp",
                preset="seed",
                world_size=2,
                run=RunSettings(steps=1, optimizer="sgd"),
                fault="missing_backward_reduce",
            )
        ]
    )
    d = r["diagnosis"]
    # the gradient of the norm's output: the tensor right after the norm, where the
    # copy-to-TP-region backward all-reduce should have summed the ranks' partial input grads
    assert (d["tensor"], d["stage"], d["signature"]) == ("actgrad:norm", "backward", "partial_sum")
    assert d["ranks"] == [0, 1]
    # forward bit-identical: nothing in forward or loss failed
    assert not [c for c in r["checks"] if c["stage"] in ("forward", "loss") and not c["passed"]]


def test_ledger_names_missing_and_extra_collectives(results):
    by_fault = {
        s.fault: r
        for s, r in results.items()
        if s.world_size == 2 and s.fault and s.block == "mlp" and s.settings.dtype == "float32"
    }
    missing = by_fault["missing_forward_reduce"]["ledger"]["problems"]
    assert [(p["kind"], p["op"], p["site"], p["phase"]) for p in missing] == [
        ("missing", "all_reduce", "down", "forward")
    ]
    extra = by_fault["reduced_twice"]["ledger"]["problems"]
    # one forward all-reduce per micro-batch per step, 3 steps
    mb = CaseSpec(block="mlp").settings.micro_batches
    assert [(p["kind"], p["expected"], p["observed"]) for p in extra] == [("extra", 3 * mb, 6 * mb)]
    # a collective on a temporary was issued: the ledger is clean while the numbers are partial sums
    assert by_fault["collective_on_temporary"]["ledger"]["problems"] == []
    twin = next(
        r
        for s, r in results.items()
        if s.world_size == 2
        and not s.fault
        and s.block == "mlp"
        and s.settings.dtype == "float32"
        and not s.sequence_parallel
    )
    assert twin["ledger"]["problems"] == []


def test_collective_on_some_ranks_ends_as_a_hang_in_seconds():
    (r,) = check(
        [
            CATALOGUE["collective_on_some_ranks"].prepare(
                CaseSpec(block="mlp", preset="tiny", world_size=2)
            )
        ],
        timeout_s=2,
    )
    assert r["verdict"] == "hang" and r["as_expected"]
    assert "hang detected" in r["summary"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "faulty",
    [s for f, _, s in CASES_16BIT if f.expected_stage == "optimizer"],
    ids=lambda s: f"{s.fault}-{s.block}-tp{s.world_size}-{s.settings.dtype}",
)
def test_optimizer_faults_are_caught_in_16_bit_by_the_replay(results_16bit, faulty):
    """The optimizer stage replays the dense rule on the TP side's own weights and grads: bitwise,
    so a wrong lr, betas, decay, reset or missing state is caught in 16-bit runs as in
    float32, at its step (a clipping fault at the norms, compared before the step)."""
    r = results_16bit[faulty]
    assert r["verdict"] == "not equivalent" and r["as_expected"], r["summary"]
    # a clipping fault: at the norms' check, which comes before the step
    assert r["first_divergence"]["name"].startswith(("update:", "state:", "clip:")), r["summary"]


def test_optimizer_faults_show_at_their_first_step(results):
    """Each optimizer fault is first seen at the step where it first acts: step 1, except a state
    reset (the first step starts from empty state anyway)."""
    for f, _, faulty in CASES:
        if f.expected_stage == "optimizer" and f.name != "optimizer_differs_across_ranks":
            want = 2 if f.name == "state_reset_on_sharded" else 1
            assert results[faulty]["first_divergence"]["step"] == want, (
                f.name,
                results[faulty]["summary"],
            )
