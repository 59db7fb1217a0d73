"""`tpcheck verify --repair` and `tpcheck.repair.collective`: a missing all-reduce inserted where
the diagnosis points, verified by re-running the full check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tpcheck import repair
from tpcheck.checker.case import CaseSpec
from tpcheck.faults import CATALOGUE
from tpcheck.repair import collective

CASES = Path(__file__).parent / "cases" / "missing_reduce.py"


def tpcheck(*args):
    return subprocess.run(
        [sys.executable, "-m", "tpcheck", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_verify_repair_inserts_the_all_reduce_after_mlp_down(tmp_path):
    """The row-parallel down projection forgets its all-reduce. With the plan naming the down
    output whole, the diagnosis is partial_sum at act:mlp.down; without, the output's replicas
    differ and the checker found mlp.down's output a partial sum nothing reduced. Both are repaired
    by the all-reduce after mlp.down, verified by the re-run; the correct twin has nothing to
    repair."""
    out = tpcheck("verify", str(CASES), "--repair", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 1, out.stderr  # the run itself was not equivalent
    assert "Traceback" not in out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    entries = {e["case"]: e for e in report["repair"]["entries"]}
    assert set(entries) == {
        "mlp_missing_reduce/tp2/float32",
        "mlp_missing_reduce_written/tp2/float32",
    }
    written = entries["mlp_missing_reduce_written/tp2/float32"]
    assert (written["signature"], written["where"]) == ("partial_sum", "act:mlp.down")
    for e in entries.values():
        assert e["status"] == "repaired" and e["verified"]["verdict"] == "equivalent"
        assert e["insertion"] == {"where": "after", "site": "mlp.down"}
    assert (
        "mlp_missing_reduce_written/tp2/float32: not equivalent (partial_sum at act:mlp.down): "
        "inserting an all-reduce after mlp.down makes it equivalent" in out.stderr
    )
    assert "2 of 2 failed case(s) repaired and verified" in out.stderr
    import jsonschema

    from tpcheck.report.schema import load_schema

    jsonschema.validate(report, load_schema())


def test_verify_repair_on_an_equivalent_case_says_nothing_to_repair(tmp_path):
    out = tpcheck("verify", f"{CASES}:correct", "--repair")
    assert out.returncode == 0, out.stderr
    assert "nothing to repair: every case checked is equivalent" in out.stderr


PARTIAL_SUM_FAULTS = sorted(
    n for n, f in CATALOGUE.items() if f.expected_signature == "partial_sum"
)


def fault_spec(name: str) -> CaseSpec:
    fault = CATALOGUE[name]
    seq = (("seq", 4),) if fault.sequence_parallel else ()  # divisible by the world size
    return CaseSpec(block=fault.blocks[0], world_size=2, fault=name, overrides=seq)


def test_every_missing_reduce_fault_of_the_catalogue_is_repaired():
    """The catalogue's faults diagnosed partial_sum (a skipped or dropped all-reduce in the forward,
    the backward or of a norm's gradient): each buggy form is repaired to equivalent by the inserted
    all-reduce, verified by the full check."""
    from tpcheck.checker.pool.session import run_specs
    from tpcheck.resolve import launcher

    assert set(PARTIAL_SUM_FAULTS) >= {"missing_forward_reduce", "missing_backward_reduce"}
    specs = [fault_spec(n) for n in PARTIAL_SUM_FAULTS]
    with launcher(120) as pool:
        results = [r.to_json() for r in run_specs(specs, pool)]
    assert all(r["verdict"] == "not equivalent" for r in results), [r["summary"] for r in results]
    specs = [CaseSpec(**{**s.__dict__, "label": r["name"]}) for s, r in zip(specs, results)]
    found = repair.run_repairs(results, specs, "collective", 120, quiet=True)
    entries = {e["case"]: e for e in found["entries"]}
    assert len(entries) == len(PARTIAL_SUM_FAULTS)
    for name, e in entries.items():
        assert e["status"] == "repaired", (name, e["tried"])
        assert e["verified"]["verdict"] == "equivalent"
    forward = next(e for n, e in entries.items() if "missing_forward_reduce" in n)
    # the row-parallel bias was added on each rank: reduced before it, not after
    assert forward["insertion"] == {"where": "before_bias", "site": "down"}
    assert forward["tried"][0]["verdict"] == "not equivalent"  # after the bias: counted tp times
    backward = next(e for n, e in entries.items() if "missing_backward_reduce" in n)
    assert backward["insertion"]["where"] == "grad_of_output"


def test_a_verification_that_ignores_the_verdict_is_caught(monkeypatch):
    """Repair mutant: a candidate accepted whatever its re-run says. The missing forward reduce
    with the bias added on each rank has a first candidate (the all-reduce after the bias) that is
    not equivalent: the mutant accepts it, and the independent re-run of what it accepted is
    not equivalent, which this test sees."""
    from tpcheck.checker.pool.session import run_specs
    from tpcheck.resolve import launcher

    spec = fault_spec("missing_forward_reduce")
    with launcher(120) as pool:
        result = run_specs([spec], pool)[0].to_json()
    spec = CaseSpec(**{**spec.__dict__, "label": result["name"]})
    honest = repair.run_repairs([result], [spec], "collective", 120, quiet=True)["entries"][0]
    assert honest["insertion"]["where"] == "before_bias"

    original = collective.repair_case

    def accepts_anything(prepared, run_one):
        return original(prepared, lambda s: {**run_one(s), "verdict": "equivalent"})

    monkeypatch.setattr(collective, "repair_case", accepts_anything)
    broken = repair.run_repairs([result], [spec], "collective", 120, quiet=True)["entries"][0]
    assert broken["insertion"]["where"] == "after"  # accepted unverified
    assert broken["tried"][0]["summary"].startswith("not equivalent")  # what the re-run said


def test_insertions_follow_the_diagnosis():
    def result(sig, tensor, **evidence):
        return {"diagnosis": {"signature": sig, "tensor": tensor, "evidence": evidence}}

    assert collective.insertions(result("partial_sum", "act:mlp.down")) == [
        collective.Insertion("after", "mlp.down")
    ]
    assert [
        i.where
        for i in collective.insertions(
            result(
                "partial_sum",
                "act:down",
                plus="(world - 1) x down.bias (a bias added on each rank)",
            )
        )
    ] == ["after", "before_bias"]
    assert collective.insertions(result("partial_sum", "actgrad:norm")) == [
        collective.Insertion("grad_of_output", "norm")
    ]
    assert collective.insertions(result("partial_sum", "grad:norm.weight")) == [
        collective.Insertion("grad", "norm.weight")
    ]
    assert collective.insertions(result("scaled_by_world", "act:down")) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--repair-budget", "3"], "give it with --repair"),
        (["--repair", "--all"], "--repair with --all"),
        (["--repair", "--repair-budget", "0"], "1 or more"),
    ],
)
def test_hf_repair_bad_flags(args, message):
    out = tpcheck("hf", *(["llama"] if "--all" not in args else []), *args)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr
