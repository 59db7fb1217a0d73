"""`tpcheck.checker.rank.ledger` on synthetic ledgers, without processes: `check_ledger` against the
expected collectives (missing, extra, rank-asymmetric; micro-batches scale forward/backward only),
`summarize` totals, and `ledger_diff`'s account of where two ranks' lists first part."""

import pytest

from tpcheck.checker.payload import ledger_diff
from tpcheck.checker.verdict.collectives import check_ledger, summarize

FWD = ("forward", "all_reduce", "attn.o_proj")
BWD = ("backward", "all_reduce", "attn.qkv")
OPT = ("optimizer", "all_reduce", "grad_norm")
EXPECTED = (FWD, BWD, OPT)


def ledger(
    world: int, steps: int, micro: int, per_micro=(FWD, BWD), per_step=(OPT,), nbytes=256
) -> list[dict]:
    """What a correct run issues: every collective of `per_micro` once per micro-batch, `per_step`
    once per step, on every rank."""
    out = []
    for rank in range(world):
        for _ in range(steps):
            for _ in range(micro):
                out += [entry(rank, *k, nbytes) for k in per_micro]
            out += [entry(rank, *k, 8) for k in per_step]
    return out


def entry(rank, phase, op, site, nbytes=256) -> dict:
    return {"rank": rank, "phase": phase, "op": op, "site": site, "nbytes": nbytes}


def kinds(result) -> list[str]:
    return [p["kind"] for p in result["problems"]]


# --- check_ledger ---------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_matching_ledger_has_no_problems(world):
    r = check_ledger(ledger(world, steps=2, micro=1), EXPECTED, world, steps=2, micro=1)
    assert r["problems"] == []
    assert r["expected"] == [
        {"phase": "backward", "op": "all_reduce", "site": "attn.qkv", "count": 2},
        {"phase": "forward", "op": "all_reduce", "site": "attn.o_proj", "count": 2},
        {"phase": "optimizer", "op": "all_reduce", "site": "grad_norm", "count": 2},
    ]


def test_micro_batches_multiply_forward_and_backward_not_optimizer():
    r = check_ledger(ledger(2, steps=3, micro=4), EXPECTED, 2, steps=3, micro=4)
    assert r["problems"] == []
    counts = {e["phase"]: e["count"] for e in r["expected"]}
    assert counts == {"forward": 12, "backward": 12, "optimizer": 3}
    # A ledger with the optimizer collective once per micro-batch is then an extra, not a match.
    wrong = ledger(2, steps=3, micro=4, per_micro=(FWD, BWD, OPT), per_step=())
    r = check_ledger(wrong, EXPECTED, 2, steps=3, micro=4)
    assert [(p["kind"], p["site"], p["expected"], p["observed"]) for p in r["problems"]] == [
        ("extra", "grad_norm", 3, 12)
    ]


def test_missing_collective_on_every_rank():
    # The forward all-reduce was dropped in the second
    # step on both ranks: symmetric, so only "missing".
    entries = ledger(2, steps=2, micro=1)
    for rank in range(2):
        entries.remove(entry(rank, *FWD))
    r = check_ledger(entries, EXPECTED, 2, steps=2, micro=1)
    assert kinds(r) == ["missing"]
    p = r["problems"][0]
    assert (p["phase"], p["op"], p["site"]) == FWD
    assert (p["expected"], p["observed"]) == (2, 1)
    assert "missing collective" in p["text"] and "'attn.o_proj'" in p["text"]
    assert "expected 2, issued 1" in p["text"]


def test_collective_never_issued_is_missing_with_zero_observed():
    entries = ledger(2, steps=2, micro=1, per_micro=(FWD,))
    r = check_ledger(entries, EXPECTED, 2, steps=2, micro=1)
    assert [(p["kind"], p["site"], p["expected"], p["observed"]) for p in r["problems"]] == [
        ("missing", "attn.qkv", 2, 0)
    ]


def test_extra_collective():
    # A redundant all-reduce at an unexpected site, once per micro-batch, on every rank.
    extra = ("backward", "all_reduce", "mlp.down")
    entries = ledger(2, steps=2, micro=2, per_micro=(FWD, BWD, extra))
    r = check_ledger(entries, EXPECTED, 2, steps=2, micro=2)
    assert kinds(r) == ["extra"]
    p = r["problems"][0]
    assert (p["phase"], p["op"], p["site"]) == extra
    assert (p["expected"], p["observed"]) == (0, 4)
    assert "extra collective" in p["text"] and "'mlp.down'" in p["text"]


def test_repeated_expected_collective_is_extra():
    entries = ledger(2, steps=1, micro=1) + [entry(r, *BWD) for r in range(2)]
    r = check_ledger(entries, EXPECTED, 2, steps=1, micro=1)
    assert [(p["kind"], p["site"], p["expected"], p["observed"]) for p in r["problems"]] == [
        ("extra", "attn.qkv", 1, 2)
    ]


def test_asymmetric_collective():
    # Rank 1 issues one backward all-reduce fewer than rank 0 (which matches the expectation).
    entries = ledger(2, steps=2, micro=1)
    entries.remove(entry(1, *BWD))
    r = check_ledger(entries, EXPECTED, 2, steps=2, micro=1)
    assert kinds(r) == ["asymmetric"]
    assert "rank 0: 6; rank 1: 5" in r["problems"][0]["text"]


def test_asymmetric_with_equal_totals_is_still_reported():
    # Same number of collectives, different sites: the Counters differ even though the totals agree.
    entries = ledger(2, steps=1, micro=1)
    entries.remove(entry(1, *BWD))
    entries.append(entry(1, "backward", "all_reduce", "mlp.up"))
    r = check_ledger(entries, None, 2, steps=1, micro=1)
    assert kinds(r) == ["asymmetric"]
    assert "rank 0: 3; rank 1: 3" in r["problems"][0]["text"]


def test_asymmetric_is_reported_without_expectations():
    entries = ledger(2, steps=1, micro=1) + [entry(0, "forward", "all_gather", "lm_head")]
    r = check_ledger(entries, None, 2, steps=1, micro=1)
    assert kinds(r) == ["asymmetric"]
    assert r["expected"] == []


def test_asymmetric_and_missing_together():
    # Rank 0 (the reference for counts) lacks a forward all-reduce that rank 1 issued.
    entries = ledger(2, steps=2, micro=1)
    entries.remove(entry(0, *FWD))
    r = check_ledger(entries, EXPECTED, 2, steps=2, micro=1)
    assert kinds(r) == ["asymmetric", "missing"]
    assert r["problems"][1]["site"] == "attn.o_proj"


def test_world_1_expects_nothing():
    entries = ledger(1, steps=2, micro=2)
    r = check_ledger(entries, EXPECTED, 1, steps=2, micro=2)
    assert r["expected"] == [] and r["problems"] == []
    assert r["per_rank"]["0"]["forward"]["all_reduce"]["count"] == 4


def test_no_expectation_no_count_problems():
    entries = ledger(2, steps=1, micro=1, per_micro=(FWD, ("forward", "all_gather", "x")))
    r = check_ledger(entries, None, 2, steps=1, micro=1)
    assert r["problems"] == [] and r["expected"] == []


# --- summarize ------------------------------------------------------------------------------------


def test_summarize_totals_count_and_bytes():
    entries = [
        entry(0, "forward", "all_reduce", "a", 100),
        entry(0, "forward", "all_reduce", "b", 50),
        entry(0, "forward", "all_gather", "c", 7),
        entry(0, "optimizer", "all_reduce", "n", 8),
        entry(1, "backward", "reduce_scatter", "d", 30),
    ]
    s = summarize(entries, 3)
    assert s == {
        "0": {
            "forward": {
                "all_reduce": {"count": 2, "bytes": 150},
                "all_gather": {"count": 1, "bytes": 7},
            },
            "optimizer": {"all_reduce": {"count": 1, "bytes": 8}},
        },
        "1": {"backward": {"reduce_scatter": {"count": 1, "bytes": 30}}},
        "2": {},  # a rank that issued nothing is still listed
    }


def test_check_ledger_per_rank_is_the_summary():
    entries = ledger(2, steps=2, micro=3, nbytes=64)
    r = check_ledger(entries, EXPECTED, 2, steps=2, micro=3)
    assert r["per_rank"] == summarize(entries, 2)
    assert r["per_rank"]["1"]["backward"]["all_reduce"] == {"count": 6, "bytes": 6 * 64}
    assert r["per_rank"]["1"]["optimizer"]["all_reduce"] == {"count": 2, "bytes": 2 * 8}


# --- ledger_diff ----------------------------------------------------------------------------------

A = "forward all_reduce at 'attn.o_proj'"
B = "backward all_reduce at 'attn.qkv'"
C = "backward all_gather at 'lm_head'"


def test_equal_ledgers_agree():
    text = ledger_diff({0: [A, B], 1: [A, B]})
    assert text.endswith("agree")
    assert "rank 0: 2" in text and "rank 1: 2" in text
    assert "differ" not in text


def test_empty_ledgers_agree():
    assert ledger_diff({0: [], 1: []}).endswith("agree")
    assert ledger_diff({}).endswith("agree")


def test_first_difference_is_named_with_each_rank_entry():
    text = ledger_diff({0: [A, B, A], 1: [A, C, B]})
    assert "first differ at #2:" in text
    assert text.endswith(f"rank 0: {B}; rank 1: {C}")
    assert "#3" not in text


def test_shorter_ledger_shows_nothing():
    text = ledger_diff({0: [A, B], 1: [A]})
    assert "first differ at #2:" in text
    assert text.endswith(f"rank 0: {B}; rank 1: nothing")
    assert "rank 0: 2, rank 1: 1" in text


def test_ranks_are_listed_in_order_whatever_the_dict_order():
    text = ledger_diff({2: [B], 0: [A], 1: [A]})
    assert "(rank 0: 1, rank 1: 1, rank 2: 1)" in text
    assert text.endswith(f"first differ at #1: rank 0: {A}; rank 1: {A}; rank 2: {B}")
