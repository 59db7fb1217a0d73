"""The fault catalogue: real TP bug classes, injected on purpose."""

from tpcheck.faults.catalogue import CATALOGUE, Fault, apply_fault, check_applies, get_fault

__all__ = ["CATALOGUE", "Fault", "apply_fault", "check_applies", "get_fault"]
