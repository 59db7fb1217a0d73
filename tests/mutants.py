"""Checker mutants shared by the self-test tests (a plain module, as paths.py): each breaks one
piece of the comparison path through `monkeypatch`; a run under it must end in "error"."""

import dataclasses

import torch

from tpcheck.checker.rank import passes, tolerance
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.verdict import result as result_module


def records_zero(monkeypatch):
    """compare records an error of 0, whatever it measured."""
    record = Comparator._record

    def zero(self, stage, step, check_id, error, bound, placement):
        return record(self, stage, step, check_id, 0.0, bound, placement)

    monkeypatch.setattr(Comparator, "_record", zero)


def tolerance_times_1000(monkeypatch):
    """Every calibrated bound 1000 times as wide (each magnitude bin's too)."""
    calibrated = tolerance.calibrated

    def loose(*args, **kwargs):
        bound = calibrated(*args, **kwargs)
        bins = bound.bins and tuple((b * 1000, *rest) for b, *rest in bound.bins)
        return dataclasses.replace(bound, value=bound.value * 1000, bins=bins)

    monkeypatch.setattr(tolerance, "calibrated", loose)


# ------------------------------------------------------------------------------------------------
# Mutants that passed the runtime self-test before it was structural (each turned a caught bug into
# "equivalent" with every control flagged); the self-test must now turn each into "error".


def reference_vs_itself(monkeypatch):
    """compare measures the plan's shard of the reference against itself, not the TP tensor."""
    compare = Comparator.compare

    def itself(self, stage, step, name, tp_local, dense, truth, placement, *args, **kwargs):
        ref = placement.shard(dense, self.group.rank, self.group.world_size).to(tp_local.dtype)
        return compare(self, stage, step, name, ref, dense, truth, placement, *args, **kwargs)

    monkeypatch.setattr(Comparator, "compare", itself)


def steps_after_first_dropped(monkeypatch):
    """The checks of steps > 1 are dropped as recorded (a loop that compares its first step)."""
    record = Comparator._record

    def first_step_only(self, stage, step, check_id, error, bound, placement):
        check = record(self, stage, step, check_id, error, bound, placement)
        if step > 1:
            self.checks.pop()
        return check

    monkeypatch.setattr(Comparator, "_record", first_step_only)


def verdict_reads_rank_0(monkeypatch):
    """The verdict reads rank 0's failures only."""
    failing = result_module.failing
    monkeypatch.setattr(
        result_module, "failing", lambda checks: [c for c in failing(checks) if c.rank == 0]
    )


def dense_error_times_1000(monkeypatch):
    """The dense model's own error is read 1000 times too large: every calibrated bound widens
    with it (and, before the self-test measured that error apart, every control was skipped)."""
    calibrated = tolerance.calibrated

    def inflated(*args, **kwargs):
        b = calibrated(*args, **kwargs)
        if b.ref_error is None:
            return b
        return dataclasses.replace(
            b, value=1000 * (b.value - b.floor) + b.floor, ref_error=1000 * b.ref_error
        )

    monkeypatch.setattr(tolerance, "calibrated", inflated)


def factor_times_50(monkeypatch):
    """The calibrated bound's factor 50 times too large."""
    factor = tolerance.factor
    monkeypatch.setattr(tolerance, "factor", lambda *args: 50 * factor(*args))


def replicas_not_compared(monkeypatch):
    """The replicated tensors held for the cross-rank comparison are dropped, never compared."""
    monkeypatch.setattr(Comparator, "flush_replicas", lambda self: self.pending_replicas.clear())


def floor_16bit_times_64(monkeypatch):
    """The floor of a 16-bit bound 64 ulps of the scale instead of 1 (or 8)."""
    calibrated = tolerance.calibrated

    def wide(dense, truth, dtype, world_size):
        b = calibrated(dense, truth, dtype, world_size)
        if dtype not in (torch.bfloat16, torch.float16) or b.floor is None:
            return b
        return dataclasses.replace(b, value=b.value + 63 * b.floor, floor=64 * b.floor)

    monkeypatch.setattr(tolerance, "calibrated", wide)


def activations_not_compared(monkeypatch):
    """The TP side's captured module outputs are dropped: the plan's activations never compared
    (the first divergence is then placed at the output, not at the module that made it)."""
    monkeypatch.setattr(passes.TPActivations, "__call__", lambda self, stage, name, t: None)
