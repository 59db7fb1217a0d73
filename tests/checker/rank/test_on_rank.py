"""A parameter that exists on one TP rank only (`OnRank(r)`): a row-parallel bias created on rank 0,
`None` elsewhere, added to rank 0's partial sum before the all-reduce (case_files/
bias_on_one_rank.py). Inferred with no plan written, usable in a written plan; checked where it
lives (weights, gradient, update, optimizer state) and absent elsewhere; its bugs caught at the
check that sees them, their correct twins equivalent."""

import importlib
from pathlib import Path

from tpcheck.api import check
from tpcheck.checker.casefile import file_spec

CASES = Path(__file__).parent / "case_files" / "bias_on_one_rank.py"


def _run(names, world, more=()):
    specs = [file_spec(f"{CASES}:{n}", world) for n in names] + list(more)
    return {r["name"]: r for r in check(specs)}


def _engine_loads(name, dtype):
    """The case file's `name` with tpcheck loading the weights through its plan (no load_tp)."""
    import dataclasses

    from tpcheck.checker.casefile import load_module, register

    case = getattr(load_module(str(CASES)), name)
    mine = dataclasses.replace(case, name=f"{case.name}_engine_loads", load_tp=None)
    return file_spec(register(mine), 2, dtype=dtype)


def _first(result):
    f = result["first_divergence"]
    return f["stage"], f["step"], f["name"], f["ranks"]


def _of(result, name):
    return [c for c in result["checks"] if c["name"] == name]


def test_a_bias_on_one_rank_is_checked_there_and_its_bugs_caught():
    names = [
        "no_plan",
        "written",
        "on_rank1",
        "on_rank1_no_plan",
        "grad_doubled",
        "grad_doubled_on_rank1",
        "added_after_reduce",
        "on_two_ranks",
        "planned_replicate",
    ]
    # tpcheck loading the weights through the plan, in bfloat16 (float32 master weights)
    more = [_engine_loads("on_rank1", "bfloat16"), _engine_loads("on_two_ranks", "bfloat16")]
    r = _run(names, 2, more)
    assert r["bias_on_rank1_engine_loads/tp2/bfloat16"]["verdict"] == "equivalent"
    engine_two = r["bias_on_two_ranks_engine_loads/tp2/bfloat16"]
    assert _first(engine_two) == ("weights", 0, "param:fc2.bias", [1])
    for good in (
        "bias_on_rank0_no_plan",
        "bias_on_rank0",
        "bias_on_rank1",
        "bias_on_rank1_no_plan",
    ):
        assert r[f"{good}/tp2/float32"]["verdict"] == "equivalent", r[f"{good}/tp2/float32"]
    inferred = r["bias_on_rank0_no_plan/tp2/float32"]
    assert "'fc2.bias': OnRank(rank=0)," in inferred["inferred_plan"]
    assert "'fc2.bias': OnRank(rank=1)," in r["bias_on_rank1_no_plan/tp2/float32"]["inferred_plan"]

    # where it lives: every stage on rank 0; on rank 1 its absence, at the weights stage
    ok = r["bias_on_rank0/tp2/float32"]
    weights = _of(ok, "param:fc2.bias")
    assert {(c["stage"], c["rank"]) for c in weights} == {
        ("weights", 0),
        ("weights", 1),
        ("optimizer", 0),
    }
    absent = next(c for c in weights if c["rank"] == 1)
    assert absent["reason"].startswith("absent: the plan holds 'fc2.bias' on rank 0 only")
    assert absent["error"] == 0 and absent["bound"] == 0
    assert {c["rank"] for c in _of(ok, "grad:fc2.bias")} == {0}
    assert {c["rank"] for c in _of(ok, "update:fc2.bias")} == {0}
    assert {c["rank"] for c in _of(ok, "state:fc2.bias.exp_avg")} == {0}
    # no replica check: no other rank holds it
    assert not [c for c in ok["checks"] if c["stage"] == "replicas" and "fc2.bias" in c["name"]]

    # on rank 1: rank 1 compares alone, with the bound rank 0 computed from the float64 truth
    grads1 = _of(r["bias_on_rank1/tp2/float32"], "grad:fc2.bias")
    assert {c["rank"] for c in grads1} == {1}
    on1 = grads1[0]
    assert on1["kind"] == "calibrated" and on1["bound"] > 0

    bad = r["bias_on_rank0_grad_doubled/tp2/float32"]
    assert bad["verdict"] == "not equivalent"
    assert _first(bad) == ("grads", 1, "grad:fc2.bias", [0])
    bad1 = r["bias_on_rank1_grad_doubled/tp2/float32"]
    assert _first(bad1) == ("grads", 1, "grad:fc2.bias", [1])
    assert bad1["first_divergence"]["bound"] == on1["bound"]  # the bound its twin passes

    after = r["bias_on_rank0_after_reduce/tp2/float32"]
    assert after["verdict"] == "not equivalent"
    # rank 1's output of fc2 (the module that adds it) lacks the bias
    assert _first(after) == ("forward", 1, "act:fc2", [1])

    # the plan says rank 0 only; rank 1 has it too (and adds it): named at the weights stage
    two = r["bias_on_two_ranks/tp2/float32"]
    assert two["verdict"] == "not equivalent"
    assert _first(two) == ("weights", 0, "param:fc2.bias", [1])
    assert two["diagnosis"]["signature"] == "held_off_rank"
    assert two["diagnosis"]["evidence"] == {"held_on": 0, "present_on": [1]}

    replicate = r["bias_on_rank0_planned_replicate/tp2/float32"]
    assert replicate["verdict"] == "invalid"
    assert "TP module has no parameter(s) ['fc2.bias'] on rank 1" in replicate["summary"]
    assert "place it OnRank(r) in the plan" in replicate["summary"]


def test_a_bias_on_one_rank_of_four():
    """World 4: inferred and written, equivalent; created on ranks 0 and 1 only, it is named at the
    weights stage (written plan) or refused naming the ranks (no plan)."""
    r = _run(["no_plan", "written", "on_two_ranks", "on_two_ranks_no_plan"], 4)
    for good in ("bias_on_rank0_no_plan", "bias_on_rank0"):
        assert r[f"{good}/tp4/float32"]["verdict"] == "equivalent", r[f"{good}/tp4/float32"]
    absent = [c for c in _of(r["bias_on_rank0/tp4/float32"], "param:fc2.bias") if c["rank"]]
    assert sorted(c["rank"] for c in absent if c["reason"].startswith("absent")) == [1, 2, 3]
    two = r["bias_on_two_ranks/tp4/float32"]
    assert _first(two) == ("weights", 0, "param:fc2.bias", [1])
    assert two["diagnosis"]["signature"] == "held_off_rank"
    refused = r["bias_on_two_ranks_no_plan/tp4/float32"]
    assert refused["verdict"] == "invalid"
    assert (
        "the TP module has parameter 'fc2.bias' [16] on ranks [0, 1] but not on [2, 3]"
        in refused["summary"]
    )


def test_checker_mutants_on_a_bias_on_one_rank_give_no_pass(monkeypatch):
    """Checker mutants: (1) rank 0 never sends the bound of the bias rank 1 alone compares: no
    verdict (error), never a pass; (2) the absence check never flags a parameter present where the
    plan says it is not: the bias rank 1 adds too still fails the case (at fc2's output)."""
    params = importlib.import_module("tpcheck.checker.rank.params")
    compare = importlib.import_module("tpcheck.checker.rank.compare")
    monkeypatch.setattr(params, "owner_bound", lambda *args: None)
    real_absent = compare.Comparator.absent
    monkeypatch.setattr(
        compare.Comparator,
        "absent",
        lambda self, name, tp_name, present, placement: real_absent(
            self, name, tp_name, False, placement
        ),
    )
    r = _run(["grad_doubled_on_rank1", "on_two_ranks"], 2)
    no_bound = r["bias_on_rank1_grad_doubled/tp2/float32"]
    assert no_bound["verdict"] == "error" and "grad:fc2.bias" in no_bound["summary"]
    present = r["bias_on_two_ranks/tp2/float32"]
    assert present["verdict"] == "not equivalent"
    assert _first(present)[:3] == ("forward", 1, "act:fc2")
