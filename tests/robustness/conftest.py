"""Fixtures for the robustness suite: child-process accounting and test-only blocks.

Test-only blocks go into `tpcheck.blocks.BLOCKS` in this (the parent) process before the launcher
forks its ranks, so the ranks see them too; the fixture restores BLOCKS afterwards.
"""

from __future__ import annotations

import dataclasses

import pytest

from tpcheck.blocks import BLOCKS, Block
from tpcheck.checker.case import Injection

from robust_helpers import child_pids

INJECTION_FIELDS = {f.name for f in dataclasses.fields(Injection)}


@pytest.fixture
def children():
    return child_pids


class _Variant(Block):
    """The seed MLP block whose Case gets `changes` (Case or Injection fields; values may be
    functions of (case, cfg) marked with `derive`, computed from the correct case)."""

    def __init__(self, name: str, changes: dict) -> None:
        base = BLOCKS["mlp"]
        super().__init__(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(Block)} | {"name": name}
        )
        object.__setattr__(self, "changes", changes)

    def case(self, spec, cfg):
        case = super().case(spec, cfg)
        values = {
            k: v(case, cfg) if getattr(v, "derive", False) else v for k, v in self.changes.items()
        }
        inject = {k: v for k, v in values.items() if k in INJECTION_FIELDS}
        rest = {k: v for k, v in values.items() if k not in INJECTION_FIELDS}
        return dataclasses.replace(case, inject=dataclasses.replace(case.inject, **inject), **rest)


@pytest.fixture
def register_block():
    """register_block(name, **case_changes) -> name: the seed MLP case with fields replaced."""
    saved = dict(BLOCKS)

    def register(name: str, **changes) -> str:
        BLOCKS[name] = _Variant(name, changes)
        return name

    yield register
    BLOCKS.clear()
    BLOCKS.update(saved)
