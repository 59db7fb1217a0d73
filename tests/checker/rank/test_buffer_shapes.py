"""Buffers whose shape changes during the run (checker/rank/buffers.py): rotary cos/sin caches grown
lazily in the forward under sequence parallelism (case_files/rotary_growth.py), starting empty or
with 2 positions, are compared at their current shapes, placed again where they changed: the whole
cache on every rank (Megatron-style) or the rows of the rank's own positions (Ulysses-style). An
empty cache is not compared, and the notes say so; a cache one side has filled and the other not is
noted, not failed; one grown to a shape no placement gives fails as a layout check. A cache rebuilt
from the wrong base, or from the rank's local sequence length without its position offset, is
caught at the rotary module that returns it and at its buffers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tpcheck.api import check
from tpcheck.checker.casefile import file_spec
from tpcheck.checker.rank import buffers
from tpcheck.checker.rank.plan_inference import candidates
from tpcheck.errors import UsageError
from tpcheck.plan import Fused, Replicate, Shard

CASES = Path(__file__).parent / "case_files" / "rotary_growth.py"
CACHES = ("buffer:rotary_emb.cos", "buffer:rotary_emb.sin")
CORRECT = ("correct_empty", "correct_short", "ulysses_empty", "ulysses_short")


def _run(names, world=2, **given):
    """{case attribute name: its result}; results come back in the order the cases finish."""
    specs = [file_spec(f"{CASES}:{n}", world, **given) for n in names]
    named = {spec.name: n for spec, n in zip(specs, names)}
    results = {named[r["name"]]: r for r in check(specs)}
    assert set(results) == set(names)
    return results


def _placements(result, name="buffer:rotary_emb.cos"):
    """{step: the placements its buffers-stage checks were made through, over every rank}."""
    out: dict[int, set[str]] = {}
    for c in result["checks"]:
        if c["stage"] == "buffers" and c["name"] == name:
            out.setdefault(c["step"], set()).add(c["placement"])
    return out


def _failed(result):
    return {
        (c["stage"], c["step"], c["name"], c["rank"]) for c in result["checks"] if not c["passed"]
    }


def _empty_notes(*steps):
    return [
        f"buffer 'rotary_emb.{w}': empty on both sides (dense [0, 8]) at step(s) {list(steps)} "
        "(not compared there)"
        for w in ("cos", "sin")
    ]


def _assert_equivalent(r, world):
    """The correct caches of rotary_growth.py, as `_run` returns them, at `world` ranks."""
    for name, result in r.items():
        assert result["verdict"] == "equivalent", (name, result["summary"])
        assert result["self_test"]["failures"] == [], name
        assert all(math.isfinite(c["error"]) for c in result["checks"]), name
    # the whole cache on every rank, compared from step 1 on (empty at step 0, and noted)
    assert _placements(r["correct_empty"]) == {1: {"replicate"}, 2: {"replicate"}}
    assert r["correct_empty"]["notes"] == _empty_notes(0)
    assert _placements(r["correct_short"]) == {s: {"replicate"} for s in range(3)}
    assert r["correct_short"].get("notes") is None
    # the rows of the rank's own positions once grown: placed again as a shard at step 1
    grown = {1: {"shard(dim=0)"}, 2: {"shard(dim=0)"}}
    assert _placements(r["ulysses_empty"]) == grown
    assert r["ulysses_empty"]["notes"] == _empty_notes(0)
    assert _placements(r["ulysses_short"]) == {0: {"replicate"}, **grown}
    ranks = {c["rank"] for c in r["ulysses_short"]["checks"] if c["name"] in CACHES}
    assert ranks == set(range(world))


def test_a_lazily_grown_cache_is_compared_at_its_current_shapes():
    _assert_equivalent(_run(CORRECT), 2)


@pytest.mark.parametrize(
    "world, dtype",
    [
        pytest.param(4, "float32", id="tp4", marks=pytest.mark.slow),
        pytest.param(2, "bfloat16", id="bf16", marks=pytest.mark.slow),
        pytest.param(4, "bfloat16", id="tp4bf16", marks=pytest.mark.slow),
    ],
)
def test_a_lazily_grown_cache_stays_equivalent_at_4_ranks_and_in_bfloat16(world, dtype):
    _assert_equivalent(_run(CORRECT, world, dtype=dtype), world)


def test_caches_rebuilt_with_the_wrong_base_or_positions_are_caught_at_the_cache():
    names = (
        "wrong_base_empty",
        "wrong_base_short",
        "ulysses_no_offset_empty",
        "ulysses_no_offset_short",
    )
    r = _run(names)
    for name, result in r.items():
        assert result["verdict"] == "not equivalent", (name, result["summary"])
        assert result["self_test"]["failures"] == [], name
        f = result["first_divergence"]
        # the rotary module's output (cos, sin) is where the rebuilt cache is first used
        assert (f["stage"], f["step"], f["name"]) == ("forward", 1, "act:rotary_emb"), name
        for c in result["checks"]:
            if c["name"] in CACHES and c["stage"] == "buffers" and not c["passed"]:
                assert math.isfinite(c["error"]) and c["error"] > 0.01, (name, c)
    for name in names[:2]:  # every rank rebuilds the whole cache with the default base
        wrong = {("buffers", s, n, rank) for s in (1, 2) for n in CACHES for rank in (0, 1)}
        assert {x for x in _failed(r[name]) if x[0] == "buffers"} == wrong, name
        assert _placements(r[name])[1] == {"replicate"}
        assert r[name]["diagnosis"]["ranks"] == [0, 1]
    for name in names[2:]:  # rank 1 holds rank 0's positions; rank 0 is right
        assert r[name]["diagnosis"]["signature"] == "rank0_shard", name
        assert r[name]["diagnosis"]["ranks"] == [1]
        wrong = {("buffers", s, n, 1) for s in (1, 2) for n in CACHES}
        assert {x for x in _failed(r[name]) if x[0] == "buffers"} == wrong, name
        assert _placements(r[name])[1] == {"shard(dim=0)"}


def test_a_cache_filled_on_one_side_only_is_noted_and_one_grown_past_the_dense_one_fails():
    r = _run(("eager_tp", "grown_past"))
    eager, past = r["eager_tp"], r["grown_past"]
    # the TP caches built in the constructor, the dense ones grown at step 1: equal from there on
    assert eager["verdict"] == "equivalent", eager["summary"]
    assert _placements(eager) == {1: {"replicate"}, 2: {"replicate"}}
    assert eager["notes"] == [
        f"buffer 'rotary_emb.{w}': empty on one side only (dense [0, 8], TP [8, 8] on rank(s) "
        "[0, 1]) at step(s) [0] (not compared there)"
        for w in ("cos", "sin")
    ]
    assert past["verdict"] == "not equivalent", past["summary"]
    f = past["first_divergence"]
    assert (f["stage"], f["step"], f["name"]) == ("buffers", 1, "buffer:rotary_emb.cos")
    assert past["diagnosis"]["signature"] == "no_placement"
    assert "[9, 8]" in f["reason"] and "[8, 8]" in f["reason"]
    assert {(s, n) for _, s, n, _ in _failed(past)} == {(s, n) for s in (1, 2) for n in CACHES}
    assert past["self_test"]["failures"] == []


# ------------------------------------------------------------------ empty shapes, without ranks


def test_an_empty_dim_is_sharded_never_fused():
    assert candidates((0, 8), 2) == [Replicate(), Shard(0), Shard(1), Fused(1, (4, 4))]
    with pytest.raises(UsageError, match="a fused part has 0 units"):
        Fused(0, (0, 0)).shard(torch.empty(0, 8), 1, 2)
    dense = {"cos": torch.empty(0, 8)}
    said = [buffers.propose(dense, {"cos": torch.empty(0, 8)}, {}, {}, r, 2) for r in range(2)]
    assert buffers.decide(said, dense, {}, 2) == ([("cos", "cos", Replicate())], [])


def test_why_a_buffer_is_not_compared_at_its_shapes():
    empty, full = [0, 8], [8, 8]
    assert buffers.skip_reason(Replicate(), [[empty, empty]] * 2) == (
        "empty on both sides (dense [0, 8])"
    )
    assert buffers.skip_reason(None, [[empty, full], [empty, empty]]) == (
        "empty on one side only (dense [0, 8], TP [8, 8] on rank(s) [0], [0, 8] on rank(s) [1])"
    )
    assert buffers.skip_reason(None, [[full, [0, 8]]] * 2).startswith("empty on one side only")
    assert buffers.skip_reason(Replicate(), [[full, full]] * 2) is None
    assert buffers.skip_reason(None, [[full, [9, 8]]] * 2) is None  # compared: a layout failure
    assert buffers.skip_reason(None, [[full, None], [full, full]]) == (
        "held by one module only, or by neither (rank(s) [0])"
    )
