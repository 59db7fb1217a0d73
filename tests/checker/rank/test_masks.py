"""Dropout and RNG placement (checker/rank/masks.py, parallel/random.py): models that train with
dropout are checked as exactly as without it (each mask drawn once in the dense layout, each rank
given its part), and the TP side's own draws are held to the RNG rule of their region: different
masks on ranks holding different shards (else `rng_not_forked`), the same mask on replicas (else
`rng_diverged`). The two catalogue faults are exercised on every block with dropout by
tests/faults/test_catalogue.py; the case file examples/own_dropout.py by
tests/examples/test_examples.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, CaseSpec, Plan, Replicate, RunSettings, Shard, check
from tpcheck.checker.casefile import register
from tpcheck.checker.rank import rng
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.rank.masks import (
    DIFFER,
    SAME,
    MaskBook,
    _sdpa_math,
    infer_placement,
    violations,
)
from tpcheck.faults import CATALOGUE
from tpcheck.models.config import ModelConfig
from tpcheck.parallel.random import ParallelDropout, RNGTracker

DROPOUT = (("dropout", 0.1), ("attention_dropout", 0.1))


# --------------------------------------------------------------------------- the pieces, in process


def test_mask_placement_is_inferred_from_shapes_only_where_unambiguous():
    assert infer_placement((2, 4, 8, 8), (2, 4, 8, 8), 2) == Replicate()
    assert infer_placement((2, 2, 8, 8), (2, 4, 8, 8), 2) == Shard(1)  # a rank's heads
    assert infer_placement((2, 2, 32), (8, 2, 32), 4) == Shard(0)  # a sequence shard
    assert infer_placement((2, 2, 16), (8, 2, 32), 4) is None  # two dims differ
    assert infer_placement((3, 2, 32), (8, 2, 32), 2) is None  # not a 1/world part
    assert infer_placement((16,), (8, 2), 2) is None


def test_the_rng_rule_of_each_region():
    # a sharded region: a rank breaks the rule with
    # ranks that drew the same mask from the same state
    assert violations(DIFFER, ["a", "b", "c"], ["m", "n", "o"], 0) == []
    assert violations(DIFFER, ["a", "a", "c"], ["m", "m", "o"], 0) == [1]
    # the same state but another mask (an offset-based generator, as DTensor's on CUDA) is a fork
    assert violations(DIFFER, ["a", "a"], ["m", "n"], 1) == []
    # a replicated region: every rank the same state and mask
    assert violations(SAME, ["a", "a", "a"], ["m", "m", "m"], 2) == []
    assert violations(SAME, ["a", "b", "a"], ["m", "m", "m"], 0) == [1]
    assert violations(SAME, ["a", "a"], ["m", "n"], 0) == [1]


@pytest.mark.parametrize(
    "kw",
    [
        {"is_causal": True},
        {},
        {"attn_mask": "bool"},
        {"attn_mask": "float"},
        {"enable_gqa": True, "is_causal": True},
        {"scale": 0.3},
    ],
)
def test_sdpa_in_plain_math_is_torchs_sdpa(kw):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64)
    heads_kv = 2 if kw.get("enable_gqa") else 4
    k, v = (torch.randn(2, heads_kv, 5, 8, generator=g, dtype=torch.float64) for _ in range(2))
    if kw.get("attn_mask") == "bool":
        kw = {"attn_mask": torch.rand(5, 5, generator=g) > 0.3}
        kw["attn_mask"][:, 0] = True
    elif kw.get("attn_mask") == "float":
        kw = {"attn_mask": torch.randn(5, 5, generator=g, dtype=torch.float64)}
    keep_all = torch.ones(2, 4, 5, 5, dtype=torch.bool)
    assert torch.allclose(
        _sdpa_math(keep_all, 0.0, q, k, v, **kw), F.scaled_dot_product_attention(q, k, v, **kw)
    )


class _Net(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.fc = nn.Linear(8, 8, dtype=dtype)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = F.dropout(self.fc(x), 0.25)  # a functional draw inside the root module
        return self.drop(h) * torch.bernoulli(torch.full_like(h, 0.5))


def test_the_dense_draws_are_replayed_exactly_and_leave_the_default_generator_alone():
    dense = _Net()
    truth = _Net(torch.float64)
    truth.load_state_dict({k: v.double() for k, v in dense.state_dict().items()})
    x = torch.randn(4, 8)
    book = MaskBook(torch.Generator().manual_seed(3))
    before = torch.get_rng_state()
    with book.draw(dense):
        out = dense(x)
    assert torch.equal(before, torch.get_rng_state())
    assert [d.label for d in book.draws] == ["(model): dropout #1", "drop", "(model): bernoulli #1"]
    assert [d.kind for d in book.draws] == ["dropout", "dropout", "bernoulli"]
    kept = book.draws[0].mask.float().mean().item()
    assert 0.5 < kept < 0.95 and (out == 0).any()  # masks drawn and applied
    with book.replay(truth):
        out_truth = truth(x.double())
    assert torch.allclose(out_truth.float(), out, atol=1e-6)  # the same masks, float64 arithmetic
    assert torch.equal(out_truth == 0, out == 0)


def test_the_model_parallel_tracker_forks_per_rank_and_leaves_the_default_stream_alone():
    class G:
        def __init__(self, rank):
            self.rank, self.world_size = rank, 2

    masks = []
    for rank in (0, 1):
        torch.manual_seed(0)
        drop = ParallelDropout(0.5, RNGTracker(G(rank), seed=5))
        first = drop(torch.ones(64))
        second = drop(torch.ones(64))
        assert not torch.equal(first, second)  # the forked stream advances
        # default untouched
        assert torch.equal(torch.get_rng_state(), torch.manual_seed(0).get_state())
        masks.append(first)
    assert not torch.equal(masks[0], masks[1])
    unforked = [RNGTracker(G(r), 5) for r in (0, 1)]
    for t in unforked:
        t.seed(5, by_rank=False)
    assert torch.equal(*(ParallelDropout(0.5, t)(torch.ones(64)) for t in unforked))


def test_dropout_probabilities_are_validated():
    for bad in (-0.1, 1.0, True, "0.1"):
        with pytest.raises(Exception, match="dropout must be a probability"):
            ModelConfig(seq=4, batch=1, hidden=8, ffn=8, dropout=bad)


# ---------------------------------------------------------------------------- the built-in blocks


def _specs(worlds, blocks=("mlp", "attention", "layer", "lm")):
    out = []
    for block in blocks:
        for world in worlds:
            for dtype in ("float32", "bfloat16"):
                for sp in (False, True):
                    out.append(
                        CaseSpec(
                            block=block,
                            preset="tiny",
                            world_size=world,
                            run=RunSettings(dtype=dtype),
                            sequence_parallel=sp,
                            overrides=DROPOUT,
                        )
                    )
    return out


@pytest.fixture(scope="module")
def blocks():
    """The layer and the LM (every dropout site of mlp and attention is in them) at world 2; the
    blocks alone are the correct twins of the catalogue's RNG faults, and world 4 is slow."""
    specs = _specs((2,), ("layer", "lm"))
    return dict(zip(specs, check(specs)))


def _rng_checks(result):
    return {(c["name"], c["placement"]) for c in result["checks"] if c["kind"] == "rng"}


def _all_equivalent(results: dict) -> None:
    for spec, r in results.items():
        assert r["verdict"] == "equivalent", (spec.name, r["summary"])
        assert r["self_test"]["failures"] == []


def test_blocks_with_dropout_are_equivalent_at_world_2_in_float32_and_bfloat16(blocks):
    _all_equivalent(blocks)


@pytest.mark.slow
def test_blocks_with_dropout_are_equivalent_at_world_4_in_float32_and_bfloat16():
    specs = _specs((4,))
    results = dict(zip(specs, check(specs)))
    _all_equivalent(results)
    lm = next(r for s, r in results.items() if s.block == "lm" and s.sequence_parallel)
    assert ("rng:embed_dropout", "shard(dim=0)") in _rng_checks(lm)
    # every step, every micro-batch, every rank: 3 steps x 2 micro-batches x 4 ranks per draw
    assert sum(c["name"] == "rng:embed_dropout" for c in lm["checks"]) == 3 * 2 * 4


def test_each_draw_is_checked_under_its_regions_rule(blocks):
    layer = {
        sp: next(
            r
            for s, r in blocks.items()
            if s.block == "layer"
            and s.world_size == 2
            and s.settings.dtype == "float32"
            and s.sequence_parallel == sp
        )
        for sp in (False, True)
    }
    assert _rng_checks(layer[False]) == {
        ("rng:attention.attn_dropout", "shard(dim=1)"),
        ("rng:attention.dropout", "replicate"),
        ("rng:mlp.dropout", "replicate"),
    }
    assert _rng_checks(layer[True]) == {
        ("rng:attention.attn_dropout", "shard(dim=1)"),
        ("rng:attention.dropout", "shard(dim=0)"),
        ("rng:mlp.dropout", "shard(dim=0)"),
    }
    lm = next(r for s, r in blocks.items() if s.block == "lm" and s.sequence_parallel)
    assert ("rng:embed_dropout", "shard(dim=0)") in _rng_checks(lm)
    # every step, every micro-batch, every rank: 3 steps x 2 micro-batches x 2 ranks per draw
    assert sum(c["name"] == "rng:embed_dropout" for c in lm["checks"]) == 3 * 2 * 2


def test_masks_are_applied_a_tp_side_without_dropout_is_caught(monkeypatch):
    """A TP layer that forgot its dropout (p=0 on the TP side only) is not equivalent: the dense
    side's masks change the values, and the missing draws are named."""
    spec = CaseSpec(
        block="layer", preset="tiny", world_size=2, run=RunSettings(steps=1), overrides=DROPOUT
    )
    from tpcheck.blocks.base import config_for
    from tpcheck.blocks.layer import BLOCK

    case = BLOCK.case(spec, config_for(spec))

    def no_dropout(group, dtype):
        tp = case.build_tp(group, dtype)
        for m in tp.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        return tp

    bad = register(dataclasses.replace(case, name="layer_without_tp_dropout", build_tp=no_dropout))
    good = register(dataclasses.replace(case, name="layer_with_tp_dropout"))
    r_bad, r_good = check(
        [
            CaseSpec(block=bad, world_size=2, run=RunSettings(steps=1)),
            CaseSpec(block=good, world_size=2, run=RunSettings(steps=1)),
        ]
    )
    assert r_good["verdict"] == "equivalent", r_good["summary"]
    assert r_bad["verdict"] == "not equivalent"
    assert r_bad["first_divergence"]["stage"] == "forward"
    missing = [c for c in r_bad["checks"] if c["kind"] == "rng" and not c["passed"]]
    assert (
        missing
        and "none where the dense side drew at attention.attn_dropout" in missing[0]["reason"]
    )


# ---------------------------------------------------------------------------- checker mutants


CATALOGUE_SPEC = CATALOGUE["rng_not_forked"].prepare(
    CaseSpec(
        block="attention",
        preset="tiny",
        world_size=2,
        run=RunSettings(steps=1),
        fault="rng_not_forked",
    )
)


def _no_violations(monkeypatch):
    monkeypatch.setattr(rng, "violations", lambda *args: [])


def _rng_records_zero(monkeypatch):
    record = Comparator.record_rng
    monkeypatch.setattr(
        Comparator,
        "record_rng",
        lambda self, step, name, seq, error, *a, **k: record(self, step, name, seq, 0, *a, **k),
    )


@pytest.mark.parametrize(
    "mutant", [_no_violations, _rng_records_zero], ids=lambda m: m.__name__.strip("_")
)
def test_a_blind_rng_check_ends_in_error_not_a_verdict(monkeypatch, mutant):
    mutant(monkeypatch)
    (r,) = check([CATALOGUE_SPEC])
    assert r["verdict"] == "error", r["summary"]
    assert "control:rng:" in r["summary"]


def test_swapped_rules_fail_the_correct_twin(monkeypatch):
    """A checker that holds sharded draws to the
    replicated rule (and back) fails a correct model."""
    swap = {DIFFER: SAME, SAME: DIFFER}
    tp = MaskBook._tp

    def swapped(self, *args):
        out = tp(self, *args)
        self.tp_draws[-1].rule = swap.get(self.tp_draws[-1].rule)
        return out

    monkeypatch.setattr(MaskBook, "_tp", swapped)
    (r,) = check([dataclasses.replace(CATALOGUE_SPEC, fault=None)])
    assert r["verdict"] == "not equivalent"


def test_the_unmutated_checker_catches_the_fault_and_passes_its_twin():
    r_bad, r_good = check([CATALOGUE_SPEC, dataclasses.replace(CATALOGUE_SPEC, fault=None)])
    assert (
        r_bad["verdict"] == "not equivalent" and r_bad["diagnosis"]["signature"] == "rng_not_forked"
    )
    assert r_good["verdict"] == "equivalent", r_good["summary"]


# ---------------------------------------------------------------------------- other randomness


class _RandLikeMask(nn.Module):
    def __init__(self, dtype=None, group=None):
        super().__init__()
        self.fc = nn.Linear(8, 8, dtype=dtype)

    def forward(self, x):
        return self.fc(x) * (torch.rand_like(x) > 0.1)


def test_a_mask_drawn_with_rand_like_is_refused_with_the_way_out():
    case = Case(
        name="rand_like_mask",
        build_dense=lambda dtype: _RandLikeMask(dtype),
        build_tp=lambda group, dtype: _RandLikeMask(dtype),
        plan=Plan(params={"fc.weight": Replicate(), "fc.bias": Replicate()}),
        make_batch=lambda g, dtype: (
            {"x": torch.randn(4, 8, generator=g)},
            torch.randn(4, 8, generator=g),
        ),
    )
    (r,) = check([CaseSpec(block=register(case), world_size=1)])
    assert r["verdict"] == "invalid"
    assert "torch.rand" in r["summary"] and "torch.bernoulli" in r["summary"]


def test_ambiguous_mask_shapes_ask_for_a_placement():
    # the TP side's mask is smaller on two dims: no 1/world part of the dense one
    class Fold(nn.Module):
        def __init__(self, dtype=None, world=1):
            super().__init__()
            self.fc = nn.Linear(8, 8, dtype=dtype)
            self.world = world

        def forward(self, x):
            h = self.fc(x)
            return h + F.dropout(h[: 4 // self.world, : 8 // self.world], 0.2).sum()

    case = Case(
        name="ambiguous_mask",
        build_dense=lambda dtype: Fold(dtype),
        build_tp=lambda group, dtype: Fold(dtype, group.world_size),
        plan=Plan(params={"fc.weight": Replicate(), "fc.bias": Replicate()}),
        make_batch=lambda g, dtype: (
            {"x": torch.randn(4, 8, generator=g)},
            torch.randn(4, 8, generator=g),
        ),
    )
    (r,) = check([CaseSpec(block=register(case), world_size=2, run=RunSettings(steps=1))])
    assert r["verdict"] == "invalid"
    assert "Case(dropout={'(model): dropout #1': Shard(dim)})" in r["summary"]


def test_a_named_placement_overrides_the_shapes():
    """`Case.dropout` names the part of the mask a rank holds where the shapes would mislead: rows
    taken round-robin look like a contiguous shard."""
    from tpcheck.plan import Placement

    class EveryOtherRow(Placement):
        def shard(self, dense, rank, world):
            return dense[rank::world]

    class Rows(nn.Module):
        def __init__(self, rows):
            super().__init__()
            self.rows = rows

        def forward(self, x):
            return F.dropout(x[: self.rows], 0.5)

    label = "(model): dropout #1"
    for placements, expect in (
        ({}, lambda m: m[2:4]),
        ({label: EveryOtherRow()}, lambda m: m[1::2]),
    ):
        book = MaskBook(torch.Generator().manual_seed(1), placements)
        with book.draw(Rows(4)):
            Rows(4)(torch.ones(4, 64))
        with book.tp(Rows(2), 1, 2, lambda: 0):
            out = Rows(2)(torch.ones(4, 64))
        assert torch.equal(out != 0, expect(book.draws[0].mask))
        assert ("EveryOtherRow" in book.tp_draws[0].placement) == bool(placements)
