"""Fixtures for the robustness suite: child-process accounting and test-only blocks.

Test-only blocks go into `tpcheck.models.cases.BLOCKS` in this (the parent) process before the
launcher forks its ranks, so the ranks see them too; the fixture restores BLOCKS afterwards.
"""
from __future__ import annotations

import dataclasses

import pytest

from tpcheck.models import cases

from robust_helpers import child_pids


@pytest.fixture
def children():
    return child_pids


@pytest.fixture
def register_block():
    """register_block(name, **case_changes) -> name: the seed MLP case with fields replaced
    (values may be functions of (case, cfg) to derive them from the correct case)."""
    saved = dict(cases.BLOCKS)

    def register(name: str, **changes) -> str:
        def block(spec, cfg):
            case = cases.mlp_case(spec, cfg)
            return dataclasses.replace(case, **{k: v(case, cfg) if getattr(v, "derive", False) else v
                                                for k, v in changes.items()})

        cases.BLOCKS[name] = block
        return name

    yield register
    cases.BLOCKS.clear()
    cases.BLOCKS.update(saved)
