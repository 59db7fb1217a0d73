"""Models that work in place on what tpcheck compares: each side's tensors are taken as they were
produced. A module's output changed in place after its forward (`h.mul_(2)`), a gradient changed in
place by the backward that consumes it, a forward input changed in place, the model's output changed
in place by the loss: in each, a correct TP model must pass with bounds calibrated on what the dense
side computed, and the same model with a planted bug (the row-parallel bias added before the
all-reduce) must still be caught. Checker mutants: the dense side keeping references instead of
copies, or every side sharing the batch's tensors, must fail the correct models or
miscalibrate their bounds."""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings, Shard
from tpcheck.api import check
from tpcheck.checker.casefile import file_spec, register
from tpcheck.checker.rank.tolerance import FLOOR_ULPS, SMALL_FLOOR_ULPS, SMALL_NUMEL, eps

from paths import example

EX = example("own_module")  # its column- and row-parallel autograd functions
capture = importlib.import_module("tpcheck.checker.rank.capture")
passes = importlib.import_module("tpcheck.checker.rank.passes")
sides = importlib.import_module("tpcheck.checker.rank.sides")

SEQ, BATCH, HIDDEN, FFN = 4, 2, 8, 16
MODES = ("output", "grad", "input", "loss")


class TwiceInBackward(torch.autograd.Function):
    """Identity forward; its backward doubles the incoming
    gradient in place (a user's custom backward)."""

    @staticmethod
    def forward(ctx, h):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g):
        return g.mul_(2.0)


class Twice(nn.Module):
    def forward(self, h):
        return TwiceInBackward.apply(h)


class Block(nn.Module):
    """x + fc2(gelu(twice(fc1(x)))) * scale; dense when `group` is None, else fc1 column- and fc2
    row-parallel. `mode` says what it changes in place."""

    def __init__(self, group=None, dtype=None, mode="output", bias_before_reduce=False):
        super().__init__()
        tp = 1 if group is None else group.world_size
        self.pg, self.mode, self.bias_before_reduce = (
            None if group is None else group.pg,
            mode,
            bias_before_reduce,
        )
        self.fc1 = nn.Linear(HIDDEN, FFN // tp, dtype=dtype)
        self.twice = Twice()
        self.fc2 = nn.Linear(FFN // tp, HIDDEN, dtype=dtype)

    def forward(self, x, scale):
        h = self.fc1(x if self.pg is None else EX.CopyToTP.apply(x, self.pg))
        if self.mode == "output":
            h.mul_(2.0)  # fc1's output, captured, changed after its forward
        if self.mode == "grad":
            # twice's output, captured; its gradient is doubled in place after the hook
            h = self.twice(h)
        if self.mode == "input":
            scale = scale.mul_(2.0)  # a forward input that needs no gradient
        h = F.gelu(h)
        if self.pg is None:
            out = self.fc2(h)
        elif self.bias_before_reduce:
            out = EX.ReduceFromTP.apply(F.linear(h, self.fc2.weight, self.fc2.bias), self.pg)
        else:
            out = EX.ReduceFromTP.apply(F.linear(h, self.fc2.weight), self.pg) + self.fc2.bias
        return x + out * scale


def make_batch(g, dtype):
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    scale = torch.rand(HIDDEN, generator=g) + 0.5
    return {"x": x.to(dtype), "scale": scale.to(dtype)}, torch.randn(
        SEQ, BATCH, HIDDEN, generator=g
    ).to(dtype)


def loss_in_place(out, target):
    """A loss that works in place on the model's output
    (as fused cross-entropies do on the logits)."""
    d = out.sub_(target)
    return (d * d).mean()


def _case(mode: str, bug: bool) -> Case:
    plan = Plan(
        params={
            "fc1.weight": Shard(0),
            "fc1.bias": Shard(0),
            "fc2.weight": Shard(1),
            "fc2.bias": Replicate(),
        },
        activations={"fc1": Shard(2), "twice": Shard(2)} if mode == "grad" else {"fc1": Shard(2)},
    )
    extra = {"loss": loss_in_place} if mode == "loss" else {}
    return register(
        Case(
            name=f"in_place_{mode}{'_bug' if bug else ''}",
            build_dense=lambda dtype: Block(None, dtype, mode),
            build_tp=lambda group, dtype: Block(group, dtype, mode, bias_before_reduce=bug),
            plan=plan,
            make_batch=make_batch,
            grad_inputs=("x",),
            no_grad_forward=True,
            run=RunSettings(steps=1),
            **extra,
        )
    )


def _run(cases: list[Case]) -> dict[str, dict]:
    return {r["name"].split("/")[0]: r for r in check([file_spec(c, 2) for c in cases])}


def _failed(result: dict) -> set[str]:
    return {c["name"] for c in result["checks"] if not c["passed"]}


def _miscalibrated(result: dict) -> list[str]:
    """The checks whose bound was calibrated on a dense error against float64 above
    1e-3 of the tensor's
    scale: in float32 that is no rounding error, the truth did not compute from what the dense side
    computed from (its bound then passes anything of that size)."""
    bad = []
    for c in result["checks"]:
        if c["kind"] == "calibrated" and c["ref_error"] is not None and c["floor"]:
            scale = c["floor"] / (
                (FLOOR_ULPS if c["numel"] >= SMALL_NUMEL else SMALL_FLOOR_ULPS) * eps(torch.float32)
            )
            if c["ref_error"] > 1e-3 * scale:
                bad.append(c["name"])
    return bad


def test_in_place_changes_are_not_divergences_and_a_bug_is_still_caught():
    results = _run([_case(mode, bug) for mode in MODES for bug in (False, True)])
    for mode in MODES:
        ok, bad = results[f"in_place_{mode}"], results[f"in_place_{mode}_bug"]
        assert ok["verdict"] == "equivalent", (mode, ok["summary"])
        assert not _miscalibrated(ok), (mode, _miscalibrated(ok))
        assert bad["verdict"] == "not equivalent", (mode, bad["summary"])
        assert bad["diagnosis"]["signature"] == "offset", (mode, bad["diagnosis"])
    # what the model changed in place was compared, as its module produced it
    assert {"act:fc1", "actgrad:twice", "output:no_grad"} <= {
        c["name"] for r in results.values() for c in r["checks"]
    }


def test_captures_are_kept_as_produced():
    dense = capture.Recorder()
    h = torch.ones(3)
    dense("forward", "fc1", h)
    h.mul_(2.0)
    truth = capture.Calibrating(dense, lambda d, t: (d.clone(), t.clone()))
    ht, odd = torch.full((3,), 1.5, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    truth("forward", "fc1", ht)
    truth("forward", "fc1", odd)  # a second capture the dense side did not make: kept as a copy
    ht.zero_()
    odd.add_(1.0)
    d, t = truth.take("forward", "fc1")  # calibrated as both were produced
    assert torch.equal(d, torch.ones(3)) and torch.equal(
        t, torch.full((3,), 1.5, dtype=torch.float64)
    )
    assert torch.equal(truth.take("forward", "fc1"), torch.zeros(2, dtype=torch.float64))
    assert torch.equal(dense.take("forward", "fc1"), torch.ones(3))


def test_checker_mutant_keeping_references_fails_or_miscalibrates_the_correct_models(monkeypatch):
    """The dense side keeps the model's own tensors, not copies: each is compared, or calibrates its
    bound, as changed later."""
    monkeypatch.setattr(capture, "snapshot", lambda t: t.detach())
    results = _run([_case(mode, False) for mode in ("output", "grad", "loss")])
    for name, result in results.items():
        assert result["verdict"] != "equivalent" or _miscalibrated(result), (
            name,
            result["summary"],
        )


def test_checker_mutant_sharing_the_batch_miscalibrates_the_correct_model(monkeypatch):
    """Every side takes the batch's own tensors where the dtype matches: the dense side's change to
    its input reaches the truth and the TP side, which then compute from another input
    than the dense side."""
    shared = lambda t, dtype: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    monkeypatch.setattr(passes, "cast", shared)  # the dense and truth passes
    monkeypatch.setattr(sides, "cast", shared)  # the TP side's inputs
    result = _run([_case("input", False)])["in_place_input"]
    assert result["verdict"] != "equivalent" or _miscalibrated(result), result["summary"]
