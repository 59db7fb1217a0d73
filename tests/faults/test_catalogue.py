"""Mutation score: every catalogue fault is caught at every world size where it applies, with its
expected stage and signature; and the correct twin of each case passes."""
import dataclasses

import pytest

from tpcheck import CaseSpec, check
from tpcheck.faults import CATALOGUE

WORLDS = (2, 4)


def _cases():
    """(fault, world, faulty spec) for every fault on every block it names, at every world size in
    WORLDS where it applies (the tiny preset has every block)."""
    out = []
    for fault in CATALOGUE.values():
        if fault.expected_stage == "hang":
            continue
        for block in fault.blocks:
            for world in WORLDS:
                if fault.applies(block, world, "adamw"):
                    out.append((fault, world, fault.prepare(CaseSpec(block=block, preset="tiny",
                                                                      world_size=world))))
    return out


CASES = _cases()


OPTIMIZER_FAULTS = [f for f in CATALOGUE.values() if f.expected_stage == "optimizer"]


@pytest.fixture(scope="module")
def results():
    specs = []
    for _, _, faulty in CASES:
        specs += [faulty, dataclasses.replace(faulty, fault=None)]  # the fault and its correct twin
    specs += [dataclasses.replace(faulty, dtype="bfloat16") for faulty in _optimizer_cases("bfloat16")]
    unique = list(dict.fromkeys(specs))  # correct twins repeat across faults: run each once
    return dict(zip(unique, check(unique)))


def _optimizer_cases(dtype="float32"):
    return [s for f, w, s in CASES if f.expected_stage == "optimizer" and s.block in ("mlp", "lm")
            and f.applies(s.block, w, "adamw", dtype)]


def test_every_fault_is_exercised():
    assert {f.name for f, _, _ in CASES} == {n for n, f in CATALOGUE.items() if f.expected_stage != "hang"}


@pytest.mark.parametrize("fault,world,faulty", CASES, ids=[f"{f.name}-{s.block}-tp{w}" for f, w, s in CASES])
def test_fault_caught_with_its_signature_and_twin_passes(results, fault, world, faulty):
    r = results[faulty]
    assert r["verdict"] == "not equivalent" and r["as_expected"], r["summary"]
    assert r["first_divergence"]["stage"] == fault.expected_stage, r["summary"]
    assert r["diagnosis"]["signature"] == fault.expected_signature, r["summary"]
    twin = results[dataclasses.replace(faulty, fault=None)]
    assert twin["verdict"] == "equivalent" and twin["as_expected"], twin["summary"]


def test_seed_missing_backward_reduce_is_localized_to_the_grad_entering_the_tp_region():
    (r,) = check([CaseSpec(block="mlp", preset="seed", world_size=2, steps=1, optimizer="sgd",
                           fault="missing_backward_reduce")])
    d = r["diagnosis"]
    # the gradient of the norm's output: the tensor right after the norm, where the copy-to-TP-region
    # backward all-reduce should have summed the ranks' partial input grads
    assert (d["tensor"], d["stage"], d["signature"]) == ("actgrad:norm", "backward", "partial_sum")
    assert d["ranks"] == [0, 1]
    # forward bit-identical: nothing in forward or loss failed
    assert not [c for c in r["checks"] if c["stage"] in ("forward", "loss") and not c["passed"]]


def test_ledger_names_missing_and_extra_collectives(results):
    by_fault = {s.fault: r for s, r in results.items() if s.world_size == 2 and s.fault and s.block == "mlp"}
    missing = by_fault["missing_forward_reduce"]["ledger"]["problems"]
    assert [(p["kind"], p["op"], p["site"], p["phase"]) for p in missing] == [("missing", "all_reduce", "down", "forward")]
    extra = by_fault["reduced_twice"]["ledger"]["problems"]
    assert [(p["kind"], p["expected"], p["observed"]) for p in extra] == [("extra", 3, 6)]
    # a collective on a temporary was issued: the ledger is clean while the numbers are partial sums
    assert by_fault["collective_on_temporary"]["ledger"]["problems"] == []
    twin = next(r for s, r in results.items() if s.world_size == 2 and not s.fault and s.block == "mlp")
    assert twin["ledger"]["problems"] == []


def test_collective_on_some_ranks_ends_as_a_hang_in_seconds():
    (r,) = check([CATALOGUE["collective_on_some_ranks"].prepare(CaseSpec(block="mlp", preset="tiny",
                                                                             world_size=2))], timeout_s=2)
    assert r["verdict"] == "hang" and r["as_expected"]
    assert "hang detected" in r["summary"]


@pytest.mark.parametrize("faulty", _optimizer_cases("bfloat16"), ids=lambda s: f"{s.fault}-{s.block}-tp{s.world_size}")
def test_optimizer_faults_are_caught_in_bfloat16_by_the_replay(results, faulty):
    """The optimizer stage replays the dense rule on the TP side's own weights and grads: bitwise, so a
    wrong lr, betas, decay, reset or missing state is caught in bfloat16 as in float32, at its step."""
    r = results[dataclasses.replace(faulty, dtype="bfloat16")]
    assert r["verdict"] == "not equivalent" and r["as_expected"], r["summary"]
    assert r["first_divergence"]["stage"] == "optimizer", r["summary"]
    assert r["first_divergence"]["name"].startswith(("update:", "state:")), r["summary"]


def test_optimizer_faults_show_at_their_first_step(results):
    """Each optimizer fault is first seen at the step where it first acts: step 1, except a state reset
    (the first step starts from empty state anyway)."""
    for f, _, faulty in CASES:
        if f.expected_stage == "optimizer" and f.name != "optimizer_differs_across_ranks":
            want = 2 if f.name == "state_reset_on_sharded" else 1
            assert results[faulty]["first_divergence"]["step"] == want, (f.name, results[faulty]["summary"])
