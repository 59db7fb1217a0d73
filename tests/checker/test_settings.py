"""One settings object: a CaseSpec carries one
`RunSettings`, and what runs is what the report names.

The case file below logs, from inside the ranks, the dtype of the TP module's output (a tensor the
checker compares) at every forward, and its own `RunSettings` says float32 and 2 steps. Run through
`tpcheck.check` with other settings, the ranks must run those (observed in the log and in the steps
of the checks), and the report must name them; run with none, the case file's own.
"""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from tpcheck import CaseSpec, RunSettings, check
from tpcheck.checker.case import RUN_FIELDS
from tpcheck.checker.casefile import OVERRIDABLE, file_spec
from tpcheck.errors import UsageError

CASE_FILE = """
import os

import torch
from torch import nn

from tpcheck import Case, Plan, Replicate, RunSettings

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ran.log")


class Dense(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.w = nn.Linear(4, 4, dtype=dtype)

    def forward(self, x):
        out = self.w(x)
        if getattr(self, "is_tp", False):
            with open(LOG, "a") as f:
                f.write(f"{out.dtype}\\n")
        return out


def build_tp(group, dtype):
    m = Dense(dtype)
    m.is_tp = True
    return m


def make_batch(g, dtype):
    return {"x": torch.randn(3, 4, generator=g).to(dtype)}, torch.randn(3, 4, generator=g).to(dtype)


x = Case(name="own", build_dense=Dense, build_tp=build_tp,
         plan=Plan(params={"w.weight": Replicate(), "w.bias": Replicate()}), make_batch=make_batch,
         run=RunSettings(dtype="float32", steps=2))
"""


@pytest.fixture
def case_file(tmp_path):
    path = tmp_path / "c.py"
    path.write_text(textwrap.dedent(CASE_FILE))
    return path


def _ran(path) -> list[str]:
    log = path.parent / "ran.log"
    lines = log.read_text().split() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


def test_the_settings_given_to_check_are_what_the_ranks_run_and_what_the_report_names(case_file):
    spec = CaseSpec(
        block=f"file:{case_file}:x",
        world_size=1,
        run=RunSettings(dtype="bfloat16", steps=1, float64_run="off"),
    )
    (r,) = check([spec])
    assert r["verdict"] == "equivalent", r["summary"]
    ran = _ran(case_file)
    assert ran and set(ran) == {"torch.bfloat16"}, ran  # every TP forward computed in bfloat16
    # by default a float64 run follows a bfloat16 one: the same forwards again, in float64
    (r,) = check([dataclasses.replace(spec, run=dataclasses.replace(spec.run, float64_run="auto"))])
    assert _ran(case_file) == ran + ["torch.float64"] * len(ran), r["summary"]
    assert r["float64_run"]["verdict"] == "equivalent" and r["dtype"] == "bfloat16"
    assert {c["step"] for c in r["checks"]} == {0, 1}  # the weights (step 0) and one step
    assert r["dtype"] == r["spec"]["dtype"] == "bfloat16" and r["spec"]["steps"] == 1


def test_without_settings_the_case_files_own_run_and_are_named(case_file):
    (r,) = check([CaseSpec(block=f"file:{case_file}:x", world_size=1)])
    ran = _ran(case_file)
    assert set(ran) == {"torch.float32"}, ran
    assert {c["step"] for c in r["checks"]} == {0, 1, 2}
    assert r["dtype"] == r["spec"]["dtype"] == "float32" and r["spec"]["steps"] == 2


def test_file_spec_carries_the_case_files_own_settings_with_those_given_replaced(case_file):
    spec = file_spec(str(case_file) + ":x", 2, steps=1)
    assert spec.run == RunSettings(dtype="float32", steps=1)  # its own dtype, the steps given
    assert spec.name.endswith("/tp2/float32")


def test_every_run_setting_is_overridable_and_nothing_else():
    assert OVERRIDABLE == RUN_FIELDS == tuple(f.name for f in dataclasses.fields(RunSettings))
    with pytest.raises(UsageError, match="not run settings"):
        CaseSpec(block="mlp").with_run(world_size=4)
    with pytest.raises(UsageError, match="must be a tpcheck.RunSettings"):
        CaseSpec(block="mlp", run={"dtype": "bfloat16"})


def test_a_spec_has_no_flat_copy_of_a_run_setting():
    spec_fields = {f.name for f in dataclasses.fields(CaseSpec)}
    assert not spec_fields & set(RUN_FIELDS), "a run setting declared twice"
    with pytest.raises(TypeError):
        # the old flat form is refused, not silently ignored
        CaseSpec(block="mlp", dtype="bfloat16")
