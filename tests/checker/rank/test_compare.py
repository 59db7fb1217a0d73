"""A Check is complete when `Comparator.compare` returns it: what only the caller knows (the loader
that loaded a weight, the place of a held activation in execution order, the error before an
allowance) goes in as keyword arguments, and nothing outside the comparator writes to a check. The
evidence is kept under (stage, step, name) and leaves the rank under the payload's key."""

import torch

from tpcheck.checker.payload import evidence_key
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.rank.ledger import CollectiveTap
from tpcheck.checker.rank.tolerance import EXACT
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Replicate


def _comparator() -> Comparator:
    group = TPGroup(rank=0, world_size=1, tap=CollectiveTap(0))
    return Comparator(group, group.tap, torch.float32, "float32")


def test_the_callers_fields_are_in_the_check_and_its_control_keeps_the_bounds_own():
    cmp, w = _comparator(), torch.arange(4.0)
    check = cmp.compare(
        "weights",
        0,
        "param:w",
        w.clone(),
        w,
        w,
        Replicate(),
        exact=True,
        reason="bitwise: the plan's shard, as loaded by your load_tp (case.py:3)",
        loaded_by="your load_tp (case.py:3)",
    )
    control = cmp.checks[-1]
    assert (check.reason, check.loaded_by, check.numel) == (
        "bitwise: the plan's shard, as loaded by your load_tp (case.py:3)",
        "your load_tp (case.py:3)",
        4,
    )
    assert control.control and (control.reason, control.loaded_by) == (EXACT.reason, None)


def test_a_held_activation_keeps_its_place_and_an_allowance_its_raw_error():
    cmp, a = _comparator(), torch.ones(3)
    place = cmp.next_seq()  # where the tensor was produced, while its placement was not known
    held = cmp.compare("forward", 1, "act:a", a, a, a.double(), Replicate(), seq=place)
    assert held.seq == place < cmp.seq  # the counter moved on; the held tensor keeps its place
    raw = a + 0.5
    relaxed = cmp.compare("optimizer", 1, "param:w", a + 0.25, a, a.double(), Replicate(), raw=raw)
    assert (relaxed.error, relaxed.raw_error) == (0.25, 0.5)
    same = cmp.compare("optimizer", 2, "param:w", raw, a, a.double(), Replicate(), raw=raw)
    assert same.raw_error is None  # nothing excused: no second figure


def test_a_control_is_planted_once_per_stage_step_and_kind():
    cmp = _comparator()
    assert cmp.take_control(("forward", 1, "rng")) and not cmp.take_control(("forward", 1, "rng"))
    assert cmp.take_control(("forward", 2, "rng"))


def test_evidence_is_kept_by_tuple_and_sent_under_the_payloads_key():
    cmp, w = _comparator(), torch.arange(4.0)
    cmp.compare("weights", 0, "param:w", w.clone(), w, w, Replicate(), exact=True)
    assert ("weights", 0, "param:w") in set(cmp.evidence)
    sent = cmp.evidence.sent({("weights", 0, "param:w")})
    assert set(sent) == {
        evidence_key("weights", 0, "param:w"),
        evidence_key("weights", 0, "control:param:w"),
    }
    # controls always go
    assert set(cmp.evidence.sent(set())) == {evidence_key("weights", 0, "control:param:w")}
