"""Merging per-rank payloads into one case result with a verdict.

Verdicts: "equivalent" (every check on every rank passed), "not equivalent" (some check failed),
"hang" (a collective wait timed out: some ranks issued a collective the others did not),
"error" (a rank raised or died), "invalid" (the input was wrong: a usage error).

Expectation: a case with an injected fault is expected to be "not equivalent", any other case to be
"equivalent". `as_expected` says whether it was; the process exit code follows from it (see cli).
"""
from __future__ import annotations

from tpcheck.check.case import CaseSpec
from tpcheck.check.diagnose import diagnose
from tpcheck.check.failures import failure_fields
from tpcheck.check.ledger import check_ledger

SEED_KEYS = {  # seed RunResult key -> our check name
    "forward_max_abs_diff": "output",
    "loss_abs_diff": "loss",
    "input_grad_max_abs_diff": "grad:x",
    "norm_grad_max_abs_diff": "grad:norm.weight",
    "gate_up_grad_max_abs_diff": "grad:gate_up.weight",
    "down_grad_max_abs_diff": "grad:down.weight",
    "down_bias_grad_max_abs_diff": "grad:down.bias",
}


def merge(spec: CaseSpec, payloads: list[dict]) -> dict:
    statuses = {p["status"] for p in payloads}
    result = {"name": spec.name, "spec": spec_dict(spec), "world_size": spec.world_size, "dtype": spec.dtype,
              "expected": "equivalent" if spec.expect_equivalent else "not equivalent",
              "seconds": max((p.get("seconds", 0.0) for p in payloads), default=0.0)}
    if statuses != {"ok"}:  # a hang, a crash or bad input: see failures.py
        result.update(failure_fields(spec, payloads))
        return result
    checks = _fill_bounds([c for p in payloads for c in p["checks"]])
    failed = sorted((c for c in checks if not c["passed"]), key=lambda c: (c["seq"], c["stage"] == "replicas",
                                                                          c["rank"]))
    verdict = "not equivalent" if failed else "equivalent"
    entries = [e for p in payloads for e in p["ledger"]]
    result.update(verdict=verdict, as_expected=verdict == result["expected"], checks=checks,
                  ledger=check_ledger(entries, payloads[0].get("expected_collectives"), spec.world_size, spec.steps,
                                      spec.micro_batches))
    control = payloads[0].get("control")
    result["self_test"] = control
    if control is not None and not (control["flagged"] and control["sensitive"]):
        result.update(verdict="error", as_expected=False,
                      summary=f"checker self-test failed: a perturbed {control['tensor']} was "
                              f"{'flagged' if control['flagged'] else 'not flagged'}, relative bound "
                              f"{control['relative_bound']:.3g} (must be < 0.5); no verdict can be trusted")
        return result
    result["first_divergence"] = _first(failed) if failed else None
    result["diagnosis"] = (diagnose(result["first_divergence"], [p.get("evidence", {}) for p in payloads],
                                    spec.world_size) if failed else None)
    result["summary"] = _summary(result, failed)
    return result


def _fill_bounds(checks: list[dict]) -> list[dict]:
    """Calibrated checks on ranks > 0 take the bound rank 0 computed for the same tensor (same seq)."""
    rank0 = {c["seq"]: c for c in checks if c["rank"] == 0 and c["stage"] != "replicas"}
    for c in checks:
        if c["bound"] is None:
            ref = rank0.get(c["seq"])
            if ref is None or ref["name"] != c["name"] or ref["bound"] is None:
                raise RuntimeError(f"no bound from rank 0 for {c['name']} (seq {c['seq']})")
            c.update(bound=ref["bound"], reason=ref["reason"], kind=ref["kind"], passed=c["error"] <= ref["bound"])
    return checks


def _first(failed: list[dict]) -> dict:
    first = failed[0]
    ranks = sorted({c["rank"] for c in failed if c["name"] == first["name"] and c["step"] == first["step"]
                    and c["stage"] == first["stage"]})
    return {"stage": first["stage"], "step": first["step"], "name": first["name"], "ranks": ranks,
            "error": first["error"], "bound": first["bound"], "kind": first["kind"]}


def _summary(result: dict, failed: list[dict]) -> str:
    if not failed:
        return f"equivalent: {len(result['checks'])} checks passed on {result['world_size']} rank(s)"
    f, d = result["first_divergence"], result["diagnosis"]
    return (f"not equivalent: {len(failed)} of {len(result['checks'])} checks failed; first: {f['name']} "
            f"({f['stage']}, step {f['step']}) on rank(s) {f['ranks']}: error {f['error']:.3g} > bound "
            f"{f['bound']:.3g}; {d['signature']}: {d['cause']}")


def spec_dict(spec: CaseSpec) -> dict:
    from dataclasses import asdict

    d = asdict(spec)
    d["overrides"] = dict(spec.overrides)
    return d


def seed_run_result(mode: str, result: dict) -> dict:
    """The seed's RunResult for one mode: rank 0's numbers (the seed looks at rank 0 only), `passed`
    as the seed defines it (mode is equivalence and every diff < 1e-6)."""
    checks = [c for c in result.get("checks", []) if c["rank"] == 0 and c["step"] == 1]
    by_name = {(c["stage"], c["name"]): c for c in checks}
    out: dict = {"mode": mode, "world_size": result["world_size"]}
    for key, name in SEED_KEYS.items():
        stage = {"output": "forward", "loss": "loss"}.get(name, "backward" if name == "grad:x" else "grads")
        out[key] = by_name[(stage, name)]["diff_vs_dense"]
    out["post_step_weight_max_abs_diff"] = max(c["diff_vs_dense"] for c in checks if c["stage"] == "optimizer")
    diffs = [v for k, v in out.items() if k.endswith("_diff")]
    out["passed"] = mode == "equivalence" and max(diffs) < 1e-6
    return out
