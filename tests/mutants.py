"""Checker mutants shared by the self-test tests (a plain module, as paths.py): each breaks one
piece of the comparison path through `monkeypatch`; a run under it must end in "error"."""

import dataclasses

import torch

from tpcheck.checker.pool import session
from tpcheck.checker.rank import passes, tolerance
from tpcheck.checker.rank.compare import Comparator
from tpcheck.checker.rank.optimizer import Replay
from tpcheck.checker.verdict import float64_run
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
    """The verdict reads rank 0's failures only (the one list of failures filtered)."""
    failing = result_module.failing
    monkeypatch.setattr(
        result_module, "failing", lambda checks: [c for c in failing(checks) if c.rank == 0]
    )


def verdict_list_rank_0(monkeypatch):
    """The list the verdict is computed from, derived from the failures, holds rank 0's only (the
    self-test's side of the reading left whole)."""
    read = result_module.read_failures

    def rank_0(flagged):
        reading = read(flagged)
        reading.failed = [c for c in reading.failed if c.rank == 0]
        return reading

    monkeypatch.setattr(result_module, "read_failures", rank_0)


def self_test_reads_rank_0(monkeypatch):
    """What the self-test reads of the failures (the controls caught) holds rank 0's only."""
    read = result_module.read_failures

    def rank_0(flagged):
        reading = read(flagged)
        reading.caught = [c for c in reading.caught if c.rank == 0]
        return reading

    monkeypatch.setattr(result_module, "read_failures", rank_0)


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


def factor_constants_times_50(monkeypatch):
    """The bound's factor constants 50 times too large (MAX_FACTOR, SMALL_FACTOR: every calibrated
    bound, each magnitude bin's too)."""
    monkeypatch.setattr(tolerance, "MAX_FACTOR", 50 * tolerance.MAX_FACTOR)
    monkeypatch.setattr(tolerance, "SMALL_FACTOR", 50 * tolerance.SMALL_FACTOR)


def bound_from_the_tp_side(monkeypatch):
    """The calibrated bound takes its error from the TP tensor: factor x max |TP - dense| over the
    rank's shard (where that is larger than the dense error) instead of max |dense - truth|, for
    every bound a rank makes or is given (the other ranks take rank 0's)."""
    compare = Comparator.compare

    def tp_side(self, stage, step, check_id, tp_local, dense, truth, placement, exact=False,
                dtype=None, bound=None, **kw):  # fmt: skip
        if bound is None and truth is not None and not exact:
            bound = self.calibrated(dense, truth, dtype)
        calibrated = bound is not None and bound.kind == "calibrated" and bound.value is not None
        if calibrated and not check_id.control:
            ref = placement.shard(dense, self.group.rank, self.group.world_size)
            if ref.shape == tp_local.shape and ref.numel():
                diff = float((tp_local.double() - ref.double()).abs().max())
                err = max(bound.ref_error or 0.0, diff)
                f = tolerance.factor(self.group.world_size, dense.numel())
                value = f * err + (bound.floor or 0.0)
                bound = dataclasses.replace(bound, value=value, ref_error=err, bins=None)
        return compare(
            self,
            stage,
            step,
            check_id,
            tp_local,
            dense,
            truth,
            placement,
            exact,
            dtype,
            bound,
            **kw,
        )

    monkeypatch.setattr(Comparator, "compare", tp_side)


def replicas_only_control(monkeypatch):
    """The self-test plants the replica control only: the controls of every other stage are
    skipped."""
    monkeypatch.setattr(Comparator, "_control", lambda self, *args, **kwargs: None)


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


def float64_run_ignored(monkeypatch):
    """The float64 run is recorded in the case but its verdict never reaches the case's."""

    def record_only(result, f64, same_as=None):
        result.float64_run = float64_run.record(f64)
        return result

    monkeypatch.setattr(session, "merge_float64", record_only)


def float64_run_failures_dropped(monkeypatch):
    """The float64 run's calibrated failures (bound kind "fp64") are dropped from the failures."""
    failing = result_module.failing
    monkeypatch.setattr(
        result_module, "failing", lambda checks: [c for c in failing(checks) if c.kind != "fp64"]
    )


def replay_update_is_the_tp_sides(monkeypatch):
    """The optimizer replay's update is the TP side's own (its stepped parameters minus the values
    before the step), not the dense rule's on copies: the bitwise update check compares TP with
    itself."""
    init = Replay.__init__

    def keep(self, tp_params, make_rule):
        init(self, tp_params, make_rule)
        self.tp = tp_params

    monkeypatch.setattr(Replay, "__init__", keep)
    monkeypatch.setattr(
        Replay, "update", lambda self, name: self.tp[name].detach() - self.before[name]
    )


def float64_run_never_runs(monkeypatch):
    """No float64 run follows the working run, whatever the settings want."""
    monkeypatch.setattr(session, "float64_spec", lambda spec, result: None)


def decision_margins_times_1000(monkeypatch):
    """The discrete-decision replay (checker/rank/decisions.py) 1000 times as lenient: every flip's
    rounding margin and every per-index offset's bound, so that any TP decision is taken for a
    near-tie and replaced by the dense one."""
    from tpcheck.checker.rank.decisions import DecisionBook

    margins, offsets = DecisionBook.rounding_margins, DecisionBook.offset_yardsticks
    monkeypatch.setattr(
        DecisionBook, "rounding_margins", lambda self, *a: [m * 1000 for m in margins(self, *a)]
    )
    monkeypatch.setattr(
        DecisionBook, "offset_yardsticks", lambda self, *a: [b * 1000 for b in offsets(self, *a)]
    )


def bin_errors_zero(monkeypatch):
    """Every magnitude bin's error read as 0: a tensor judged by magnitude always passes."""
    read = tolerance.bin_errors

    def zero(*args, **kwargs):
        return tuple(0.0 for _ in read(*args, **kwargs))

    monkeypatch.setattr(tolerance, "bin_errors", zero)
