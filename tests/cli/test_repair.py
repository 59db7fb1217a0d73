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
    assert out.returncode == 4, out.stderr  # not equivalent as written; every failure repaired
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
    tail = out.stderr[out.stderr.index("with the repairs printed above, each checked again") :]
    assert "mlp_missing_reduce_written/tp2/float32/repair1" in tail
    assert "2 of 2 case(s) as expected" in tail
    assert report["summary"]["exit_code"] == 4
    import jsonschema

    from tpcheck.report.schema import load_schema

    jsonschema.validate(report, load_schema())


def printed_fix(stderr: str) -> list[str]:
    """The first fix `verify --repair` printed for a case file: its code lines."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# in your case file"))
    end = lines.index("", start)
    return lines[start + 1 : end]


@pytest.mark.slow
def test_the_printed_fix_applied_in_a_case_file_is_equivalent(tmp_path):
    """The fix as printed, pasted after the buggy TP module is built, makes the case equivalent;
    the same file without it is not (the twin that shows the pasted lines are what fixes it)."""
    out = tpcheck("verify", f"{CASES}:missing_reduce", "--repair")
    assert out.returncode == 4, out.stderr
    code = printed_fix(out.stderr)
    assert any("register_forward_hook" in line for line in code), code

    def case_file(name, lines):
        body = "\n".join(f"    {line}" for line in lines)
        path = tmp_path / f"{name}.py"
        path.write_text(
            "import dataclasses\nimport importlib.util\n\n"
            f"spec = importlib.util.spec_from_file_location('buggy', {str(CASES)!r})\n"
            "buggy = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(buggy)\n\n\n"
            f"def build(group, dtype):\n    tp = buggy.tp(False)(group, dtype)\n{body}\n"
            "    return tp\n\n\n"
            f"case = dataclasses.replace(buggy.missing_reduce, name={name!r}, build_tp=build)\n"
        )
        return path

    fixed = tpcheck("verify", str(case_file("pasted", code)))
    assert fixed.returncode == 0, fixed.stderr
    unfixed = tpcheck("verify", str(case_file("unpasted", ["pass"])))
    assert unfixed.returncode == 1, unfixed.stderr


def test_the_exit_code_says_repaired_only_when_every_failure_is_repaired():
    """4 only where every case that did not go as expected has a repair verified in its working
    dtype; a case left unrepaired, one verified in float64 only, or no repair run keep 1 / 3."""
    cases = [
        {"name": "a", "as_expected": False},
        {"name": "b", "as_expected": False},
        {"name": "c", "as_expected": True},
    ]

    def report(*statuses):
        entries = [{"case": n, "status": s} for n, s in zip("ab", statuses)]
        return {"cases": cases, "repair": {"entries": entries}}

    assert repair.exit_code_after(report("repaired", "repaired"), 1) == 4
    assert repair.exit_code_after(report("repaired", "repaired"), 3) == 4
    assert repair.exit_code_after(report("repaired", "budget_spent"), 1) == 1
    assert repair.exit_code_after(report("repaired", "verified_in_float64"), 1) == 1
    assert repair.exit_code_after(report("repaired"), 3) == 3  # b has no entry
    assert repair.exit_code_after(report("repaired", "repaired"), 2) == 2  # bad input stands
    assert repair.exit_code_after({"cases": cases}, 1) == 1


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
