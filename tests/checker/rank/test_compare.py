"""A Check is complete when `Comparator.compare` returns it: what only the caller knows (the loader
that loaded a weight, the place of a held activation in execution order, the error before an
allowance) goes in as keyword arguments, and nothing outside the comparator writes to a check. The
evidence is kept under (stage, step, name) and leaves the rank under the payload's key."""

import math
import re

import pytest
import torch

from tpcheck.checker.checkid import CheckId
from tpcheck.checker.payload import evidence_key
from tpcheck.checker.rank import tolerance
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.rank.ledger import CollectiveTap
from tpcheck.checker.rank.tolerance import EXACT
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Replicate

from paths import REPO


def _comparator() -> Comparator:
    group = TPGroup(rank=0, world_size=1, tap=CollectiveTap(0))
    return Comparator(group, group.tap, torch.float32, "float32")


def test_the_callers_fields_are_in_the_check_and_its_control_keeps_the_bounds_own():
    cmp, w = _comparator(), torch.arange(4.0)
    check = cmp.compare(
        "weights",
        0,
        CheckId.parse("param:w"),
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
    held = cmp.compare(
        "forward", 1, CheckId.parse("act:a"), a, a, a.double(), Replicate(), seq=place
    )
    assert held.seq == place < cmp.seq  # the counter moved on; the held tensor keeps its place
    raw = a + 0.5
    relaxed = cmp.compare(
        "optimizer", 1, CheckId.parse("param:w"), a + 0.25, a, a.double(), Replicate(), raw=raw
    )
    assert (relaxed.error, relaxed.raw_error) == (0.25, 0.5)
    same = cmp.compare(
        "optimizer", 2, CheckId.parse("param:w"), raw, a, a.double(), Replicate(), raw=raw
    )
    assert same.raw_error is None  # nothing excused: no second figure


def test_a_control_is_planted_once_per_stage_step_and_kind():
    cmp = _comparator()
    assert cmp.take_control(("forward", 1, "rng")) and not cmp.take_control(("forward", 1, "rng"))
    assert cmp.take_control(("forward", 2, "rng"))


def test_evidence_is_kept_by_tuple_and_sent_under_the_payloads_key():
    cmp, w = _comparator(), torch.arange(4.0)
    cmp.compare("weights", 0, CheckId.parse("param:w"), w.clone(), w, w, Replicate(), exact=True)
    assert ("weights", 0, CheckId.parse("param:w")) in set(cmp.evidence)
    sent = cmp.evidence.sent({("weights", 0, CheckId.parse("param:w"))})
    assert set(sent) == {
        evidence_key("weights", 0, CheckId.parse("param:w")),
        evidence_key("weights", 0, CheckId.parse("control:param:w")),
    }
    # controls always go
    assert set(cmp.evidence.sent(set())) == {
        evidence_key("weights", 0, CheckId.parse("control:param:w"))
    }


def test_a_control_is_the_real_tp_tensor_moved_by_the_published_detectability():
    """The control goes through `compare` itself, on a copy of the TP tensor (its real error kept),
    one element moved away from the reference by the working dtype's detectability."""
    cmp = _comparator()
    ref = torch.linspace(-1.0, 2.0, 64)
    tp = ref.clone()
    tp[3] += 0.5  # a real error elsewhere than the planted element
    real = cmp.compare("forward", 1, CheckId.parse("act:a"), tp, ref, ref.double(), Replicate())
    control = cmp.checks[-1]
    assert control.control and control.name == "control:act:a"
    assert control.planted == pytest.approx(tolerance.CONTROL_RELATIVE[torch.float32] * 2.0)
    assert real.error == pytest.approx(0.5) and control.error == pytest.approx(0.5)
    kept = cmp.evidence.kept[evidence_key("forward", 1, CheckId.parse("control:act:a"))]
    assert float((kept["tp"] - kept["ref"]).abs().max()) >= control.planted * 0.99


def test_a_float16_control_near_the_top_of_the_range_stays_finite():
    """65000 + 2% is past float16's 65504: the control moves toward zero instead, and is flagged."""
    group = TPGroup(rank=0, world_size=1, tap=CollectiveTap(0))
    cmp = Comparator(group, group.tap, torch.float16, "float16")
    t = torch.tensor([65000.0, 1.0, -3.0], dtype=torch.float16)
    cmp.compare("forward", 1, CheckId.parse("act:big"), t.clone(), t, t.double(), Replicate())
    control = cmp.checks[-1]
    assert math.isfinite(control.error) and control.error >= control.planted / 2
    assert control.error > control.bound


def test_the_planted_errors_are_the_published_detectability():
    """tolerance.CONTROL_RELATIVE is the detectability table of docs/tolerances.md: per dtype, the
    largest threshold over world sizes of the calibrated row."""
    table = (REPO / "docs" / "tolerances.md").read_text()
    for dtype in ("float32", "float16", "bfloat16"):
        row = re.search(rf"^\| partial \| {dtype} *\|([^|]+)\|([^|]+)\|([^|]+)\|", table, re.M)
        published = max(float(v) for v in row.groups())
        assert tolerance.CONTROL_RELATIVE[getattr(torch, dtype)] == published, dtype


def test_a_nonfinite_reference_names_float16_overflow_and_adamw_only_where_they_fit():
    group = TPGroup(rank=0, world_size=1, tap=CollectiveTap(0))
    bad = torch.tensor([float("inf"), 1.0], dtype=torch.float16)
    for masters, step, adamw in ((True, 2, False), (False, 1, False), (False, 2, True)):
        cmp = Comparator(group, group.tap, torch.float16, "float16", masters=masters)
        with pytest.raises(UsageError) as e:
            cmp.compare("forward", step, CheckId.parse("act:x"), bad, bad, None, Replicate())
        assert "float16 overflows past 65504" in str(e.value)
        assert ("AdamW" in str(e.value)) == adamw, (masters, step)
