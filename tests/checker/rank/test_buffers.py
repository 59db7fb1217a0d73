"""Buffers and eval mode (checker/rank/buffers.py): every buffer of the TP module is compared with
the dense module's at step 0 and after every step ("buffers" stage), and the last step runs every
side in eval mode ("output:eval"). A sequence-parallel batch norm whose running statistics come from
the local shard (forward right, every rank's buffer different) is caught at its buffers and at its
eval output; its twin, the running statistics from the all-reduced ones, is equivalent; rotary
caches raise no false alarm (case_files/buffers_eval.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mutants import records_zero
from tpcheck import Plan, Replicate, Shard
from tpcheck.api import check
from tpcheck.checker.casefile import file_spec, load_module, register
from tpcheck.checker.rank import buffers, engine
from tpcheck.errors import UsageError

CASES = Path(__file__).parent / "case_files" / "buffers_eval.py"
BN = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


def _run(names, world=2, **given):
    return {r["name"].split("/")[0]: r for r in check([_spec(n, world, **given) for n in names])}


def _spec(name, world=2, **given):
    return file_spec(f"{CASES}:{name}", world, **given)


def _first(result):
    f = result["first_divergence"]
    return f["stage"], f["step"], f["name"]


def _failed(result):
    return {(c["stage"], c["step"], c["name"]) for c in result["checks"] if not c["passed"]}


def _buffer_checks(result, stage="buffers"):
    return {(c["step"], c["name"]) for c in result["checks"] if c["stage"] == stage}


def test_running_stats_from_the_local_shard_are_caught_and_the_correct_twin_passes():
    r = _run(["correct", "local_stats"])
    ok, bad = r["sp_batchnorm"], r["sp_batchnorm_local_stats"]
    assert ok["verdict"] == "equivalent", ok["summary"]
    every_step = {(s, f"buffer:{b}") for s in range(3) for b in BN}
    assert _buffer_checks(ok) == every_step
    # replicated: each rank's copy held bitwise to the others'
    assert {(s, f"buffer:{b}") for s in range(3) for b in BN} <= _buffer_checks(ok, "replicas")
    assert [c["passed"] for c in ok["checks"] if c["name"] == "output:eval"] == [True, True]
    assert ok["self_test"]["failures"] == []

    assert bad["verdict"] == "not equivalent", bad["summary"]
    # the training forward is right: only the buffers and what eval mode computes with them
    assert _first(bad) == ("buffers", 1, "buffer:bn.running_mean")
    assert bad["diagnosis"]["signature"] == "replicas_differ"
    stats = {f"buffer:{b}" for b in BN[:2]}
    assert _failed(bad) == (
        {(stage, s, n) for stage in ("buffers", "replicas") for s in (1, 2) for n in stats}
        | {("forward", 2, "output:eval")}
    )
    assert bad["self_test"]["failures"] == []


def test_rotary_caches_raise_no_false_alarm_and_a_misfit_cache_is_reported():
    r = _run(["rotary", "rotary_misfit"])
    ok, misfit = r["rotary_caches"], r["rotary_cache_misfit"]
    assert ok["verdict"] == "equivalent", ok["summary"]
    caches = {(s, f"buffer:rope_{w}") for s in range(3) for w in ("cos", "sin")}
    assert _buffer_checks(ok) == caches
    assert {c["placement"] for c in ok["checks"] if c["stage"] == "buffers"} == {"replicate"}
    # the TP module's own counter has no dense buffer: noted, not compared, not failed
    assert ok["notes"] == ["TP buffer(s) ['calls']: no dense buffer stands for them (not compared)"]

    assert misfit["verdict"] == "not equivalent", misfit["summary"]
    assert _first(misfit) == ("buffers", 0, "buffer:rope_cos")
    assert misfit["diagnosis"]["signature"] == "no_placement"
    assert "[4, 17]" in misfit["first_divergence"]["reason"]
    assert {n for _, _, n in _failed(misfit)} == {"buffer:rope_cos"}
    # a layout check plants its own control: no "no control" failure, a verdict
    assert misfit["self_test"]["failures"] == []


def test_a_tp_dropout_that_ignores_eval_mode_is_caught_at_the_eval_forward():
    r = _run(["dropout_eval", "dropout_always"])
    ok, bad = r["dropout_eval"], r["dropout_always"]
    assert ok["verdict"] == "equivalent", ok["summary"]
    assert bad["verdict"] == "not equivalent", bad["summary"]
    # right in training (its masks replayed from the dense side's); in eval mode the TP side draws
    # a mask where the dense side draws none
    assert _failed(bad) == {
        ("forward", 2, "output:eval"),
        ("forward", 2, "rng:(model): dropout #1"),
    }
    assert bad["diagnosis"]["signature"] == "dropout_mismatch"
    assert "where the dense side drew none" in bad["first_divergence"]["reason"]


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_the_correct_batch_norm_is_equivalent_in_other_dtypes(dtype):
    r = _run(["correct", "local_stats"], dtype=dtype)
    assert r["sp_batchnorm"]["verdict"] == "equivalent", r["sp_batchnorm"]["summary"]
    assert _first(r["sp_batchnorm_local_stats"]) == ("buffers", 1, "buffer:bn.running_mean")


def test_micro_batches_and_adamw_keep_the_correct_twin_equivalent():
    (ok,) = check([_spec("correct", micro_batches=2, steps=3, optimizer="adamw")])
    assert ok["verdict"] == "equivalent", ok["summary"]
    assert (3, "buffer:bn.running_var") in _buffer_checks(ok)


def _no_buffers(monkeypatch):
    monkeypatch.setattr(buffers.BufferChecks, "compare", lambda self, step: None)


def _no_eval(monkeypatch):
    monkeypatch.setattr(engine, "eval_forward", lambda e, step, inputs: None)


@pytest.mark.parametrize(
    "mutants, seen",
    [
        ((_no_buffers,), {("forward", 2, "output:eval")}),
        ((_no_eval,), {("buffers", 1, "buffer:bn.running_mean")}),
        ((_no_buffers, _no_eval), set()),
    ],
    ids=["no_buffer_stage", "no_eval_forward", "neither"],
)
def test_each_check_sees_the_bug_on_its_own(monkeypatch, mutants, seen):
    """Without the buffers stage the eval forward still sees the bug, and the other way round;
    without both the bug passes: the checks are what see it."""
    for mutant in mutants:
        mutant(monkeypatch)
    (bad,) = check([_spec("local_stats")])
    if not seen:
        assert bad["verdict"] == "equivalent", bad["summary"]
        return
    assert bad["verdict"] == "not equivalent", bad["summary"]
    assert seen <= _failed(bad)


def test_a_comparison_that_records_zero_ends_in_error(monkeypatch):
    records_zero(monkeypatch)
    for r in check([_spec("local_stats"), _spec("rotary_misfit")]):
        assert r["verdict"] == "error", r["summary"]
        assert r["summary"].startswith("the checker failed its control"), r["summary"]


# ------------------------------------------------------------------ names, placements, the plan


def _renamed_cache(group, dtype):
    """The rotary TP module with its cos cache kept under a name of its own."""
    module = load_module(str(CASES)).TPRotaryMLP(group, dtype)
    module.cos = module._buffers.pop("rope_cos")  # what its forward rotates with
    module.register_buffer("cos_cache", module.cos, persistent=False)
    return module


def _growing_cache(group, dtype):
    """The rotary TP module whose first forward grows its cos cache by a row (a cache extended on
    the fly; it rotates with the rows it had): from step 1 on no shard of the dense cache."""
    module = load_module(str(CASES)).TPRotaryMLP(group, dtype)
    forward = module.forward

    def grow_then_forward(x):
        if module.cos is None:
            module.cos = module.rope_cos  # what its forward rotates with
            module.rope_cos = torch.cat([module.cos, module.cos[:1]])
        return forward(x)

    module.forward = grow_then_forward
    return module


def test_a_buffer_resized_after_step_0_fails_there():
    rotary = load_module(str(CASES)).rotary
    grown = dataclasses.replace(rotary, name="grown", build_tp=_growing_cache)
    (r,) = check([file_spec(register(grown), 2)])
    assert r["verdict"] == "not equivalent", r["summary"]
    assert _first(r) == ("buffers", 1, "buffer:rope_cos")
    assert {n for _, _, n in _failed(r)} == {"buffer:rope_cos"}
    assert r["self_test"]["failures"] == []


def test_a_renamed_buffer_is_compared_once_named_and_noted_until_then():
    rotary = load_module(str(CASES)).rotary
    plan = dataclasses.replace(rotary.plan, tp_names={"rope_cos": "cos_cache"})
    named = dataclasses.replace(rotary, name="renamed", build_tp=_renamed_cache, plan=plan)
    silent = dataclasses.replace(named, name="renamed_silent", plan=rotary.plan)
    r = {
        x["name"].split("/")[0]: x
        for x in check([file_spec(register(c), 2) for c in (named, silent)])
    }
    ok, noted = r["renamed"], r["renamed_silent"]
    assert ok["verdict"] == "equivalent", ok["summary"]
    assert {n for _, n in _buffer_checks(ok)} == {"buffer:rope_cos", "buffer:rope_sin"}
    assert noted["verdict"] == "equivalent", noted["summary"]
    assert {n for _, n in _buffer_checks(noted)} == {"buffer:rope_sin"}
    assert noted["notes"] == [
        "buffer 'rope_cos': the dense module has it, the TP module none (not compared; if it is "
        "there under another name, name it in the tp_names of the plan or case)",
        "TP buffer(s) ['calls', 'cos_cache']: no dense buffer stands for them (not compared)",
    ]


def test_a_tp_buffer_is_found_under_a_renamed_module_or_a_wrapper():
    tp = {"module.up_proj.running_mean", "module.other.calls", "norm.scale"}
    renames = {"fc1.weight": "module.up_proj.weight"}
    assert buffers.tp_buffer_name("fc1.running_mean", renames, tp) == "module.up_proj.running_mean"
    assert buffers.tp_buffer_name("other.calls", {}, tp) == "module.other.calls"
    assert buffers.tp_buffer_name("norm.scale", {}, tp) == "norm.scale"
    assert buffers.tp_buffer_name("norm.scale", {"norm.scale": "gone"}, tp) is None
    assert buffers.tp_buffer_name("missing", {}, tp) is None


def test_placements_are_agreed_over_the_ranks_values_first():
    dense = {"slopes": torch.arange(4.0), "zeros": torch.zeros(4), "odd": torch.ones(3)}
    # rank r holds its half of the slopes (a Shard(0) buffer), the whole of the zeros, and a
    # buffer of no placement of the dense one's
    said = [
        buffers.propose(
            dense,
            {
                "slopes": torch.arange(4.0)[2 * r : 2 * r + 2],
                "zeros": torch.zeros(4),
                "odd": torch.ones(2),
            },
            {},
            {},
            r,
            2,
        )
        for r in range(2)
    ]
    said = [json.loads(json.dumps(s)) for s in said]  # as the store carries them
    watched, notes = buffers.decide(said, dense, {}, 2)
    assert watched == [
        ("slopes", "slopes", Shard(0)),
        ("zeros", "zeros", Replicate()),
        ("odd", "odd", None),
    ]
    assert notes == []
    # one rank only: noted, not compared
    said[1]["buffers"]["zeros"] = None
    watched, notes = buffers.decide(said, dense, {}, 2)
    assert [w[0] for w in watched] == ["slopes", "odd"]
    assert notes and "rank(s) [0] only" in notes[0]


def test_a_written_buffer_placement_is_held_to_the_dense_buffers():
    module = load_module(str(CASES))
    dense = module.DenseBlock()
    plan = dataclasses.replace(module.BN_PLAN, buffers={"bn.running_mean": Replicate()})
    plan.check_against(dense, 2)
    with pytest.raises(UsageError, match=r"'bn.running_maen'.*did you mean 'bn.running_mean'"):
        dataclasses.replace(plan, buffers={"bn.running_maen": Replicate()}).check_against(dense, 2)
    with pytest.raises(UsageError, match=r"buffer 'bn.running_var' \[16\]"):
        Plan(params=plan.params, buffers={"bn.running_var": Shard(0)}).check_against(dense, 3)


def test_a_gqa_kv_cache_replicated_over_ranks_is_a_candidate_placement():
    """A KV cache [seq, batch, kv_heads, head_dim] with 2 KV heads at 4 ranks: ranks 0-1 hold head
    0, ranks 2-3 head 1 (the decode block at tp 4 is equivalent with it inferred)."""
    import torch

    from tpcheck.checker.rank.plan_inference import candidates, matches
    from tpcheck.plan import Fused

    assert Fused(2, (2,)) in candidates((12, 2, 2, 8), 4)
    dense = torch.randn(12, 2, 2, 8)
    for rank in range(4):
        found = matches(dense, dense[:, :, rank // 2 : rank // 2 + 1], rank, 4)
        assert [candidates((12, 2, 2, 8), 4)[i] for i in found] == [Fused(2, (2,))]
