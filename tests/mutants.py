"""Checker mutants shared by the self-test tests (a plain module, as paths.py): each breaks one
piece of the comparison path through `monkeypatch`; a run under it must end in "error"."""

import dataclasses

from tpcheck.checker.rank import tolerance
from tpcheck.checker.rank.compare import Comparator


def records_zero(monkeypatch):
    """compare records an error of 0, whatever it measured."""
    record = Comparator._record

    def zero(self, stage, step, name, error, bound, placement, control=False):
        return record(self, stage, step, name, 0.0, bound, placement, control)

    monkeypatch.setattr(Comparator, "_record", zero)


def tolerance_times_1000(monkeypatch):
    """Every calibrated bound 1000 times as wide (each magnitude bin's too)."""
    calibrated = tolerance.calibrated

    def loose(*args, **kwargs):
        bound = calibrated(*args, **kwargs)
        bins = bound.bins and tuple((b * 1000, *rest) for b, *rest in bound.bins)
        return dataclasses.replace(bound, value=bound.value * 1000, bins=bins)

    monkeypatch.setattr(tolerance, "calibrated", loose)
