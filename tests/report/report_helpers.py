"""Helpers for the report tests: run the `tpcheck` command and keep its reports."""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SEED_ARGS = ("run", "--mode", "all", "--world-size", "2")  # what `make demo` runs
# A multi-step matrix with both seed faults and the
# hang fault: covers curves, problems and the hang row.
MATRIX_ARGS = (
    "run",
    "--world-size",
    "2",
    "--steps",
    "2",
    "--timeout",
    "2",
    "--fault",
    "missing_forward_reduce",
    "missing_backward_reduce",
    "collective_on_some_ranks",
)


@dataclass
class Run:
    proc: subprocess.CompletedProcess
    json_path: Path
    html_path: Path

    @property
    def report(self) -> dict:
        return json.loads(self.json_path.read_text())


def tpcheck(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tpcheck", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def run_with_reports(directory: Path, args: tuple[str, ...]) -> Run:
    json_path, html_path = directory / "report.json", directory / "report.html"
    proc = tpcheck(*args, "--json", str(json_path), "--html", str(html_path))
    assert proc.returncode == 0, proc.stderr
    return Run(proc, json_path, html_path)


# ----------------------------------------------------------------- synthetic reports for the layout

STAGES = ("forward", "loss", "backward", "grads", "optimizer")


def synthetic_check(name: str, stage: str, seq: int, step: int, rank: int, error: float) -> dict:
    return {
        "bound": 1e-6,
        "diff_vs_dense": error,
        "error": error,
        "floor": None,
        "kind": "calibrated",
        "name": name,
        "numel": 8,
        "passed": error <= 1e-6,
        "placement": "replicate",
        "rank": rank,
        "raw_error": None,
        "reason": "synthetic",
        "ref_error": None,
        "seq": seq,
        "stage": stage,
        "step": step,
    }


def synthetic_case(name: str, columns: int = 12, steps: int = 3, failing: bool = False) -> dict:
    """A case with `columns` tensors spread over the stages, checked on 2 ranks for `steps` steps,
    each tensor's error moving from step to step; the same names recur per rank (the legend must
    still name each line once)."""
    checks = []
    for j in range(columns):
        stage = STAGES[j * len(STAGES) // columns]
        prefix = {"forward": "act", "backward": "actgrad", "grads": "grad"}.get(stage, stage)
        for step in range(1, steps + 1):
            for rank in range(2):
                error = (1e-3 if failing and j % 7 == 3 else 1e-8 * (1 + j % 5)) * (1 + step / 8)
                checks.append(
                    synthetic_check(f"{prefix}:layers.{j}.mlp", stage, j, step, rank, error)
                )
    return {
        "as_expected": True,
        "checks": checks,
        "diagnosis": None,
        "dtype": "float32",
        "expected": "not equivalent" if failing else "equivalent",
        "first_divergence": None,
        "ledger": None,
        "name": name,
        "seconds": 0.1,
        "spec": {"block": "synthetic", "world_size": 2},
        "summary": "synthetic",
        "verdict": "not equivalent" if failing else "equivalent",
        "world_size": 2,
    }


def synthetic_report(cases: list[dict], **extra) -> dict:
    return {
        "cases": cases,
        "environment": {"torch": "x"},
        "schema": "tpcheck.report/1",
        "summary": {
            "as_expected": len(cases),
            "cases": len(cases),
            "exit_code": 0,
            "verdicts": {"equivalent": len(cases)},
        },
        "tpcheck": "test",
        **extra,
    }


def user_code_ledger(asymmetric: bool = False) -> dict:
    """A ledger of user code: no expectation given; optionally rank 1 issues no forward
    collective and one backward all-reduce fewer; all_gather has no byte count."""
    ranks = {
        r: {
            "forward": {"all_reduce": {"bytes": 2048, "count": 4}},
            "backward": {
                "all_reduce": {"bytes": 2048, "count": 4},
                "all_gather": {"bytes": 0, "count": 2},
            },
        }
        for r in ("0", "1")
    }
    if asymmetric:
        del ranks["1"]["forward"]
        ranks["1"]["backward"]["all_reduce"]["count"] = 3
    return {"expected": [], "per_rank": ranks, "problems": []}


def hf_sweep_report() -> dict:
    """Like `tpcheck hf llama qwen3`: llama passed (its checks omitted), qwen3 failed with a known
    upstream defect the report names a findings page for."""
    llama = synthetic_case("hf:llama/tp2/float32", steps=1)
    llama["checks_omitted"] = {"passed": len(llama["checks"])}
    llama["checks"] = []
    llama["ledger"] = user_code_ledger()
    qwen = synthetic_case("hf:qwen3/tp2/float32", steps=1, failing=True)
    qwen["as_expected"] = False
    qwen["expected"] = "equivalent"
    qwen["checks"] = [c for c in qwen["checks"] if not c["passed"]]
    qwen["checks_omitted"] = {"passed": 40}
    qwen["diagnosis"] = {
        "cause": "replicated_with_grad_allreduce counts early micro-batches world-size times, "
        "see docs/findings/hf-replicated-grad-allreduce-accumulation.md",
        "signature": "mismatch",
    }
    row = {"dtype": "float32", "first_divergence": "", "reason": "", "world_size": 2}
    rows = [
        {**row, "architecture": "llama", "case": llama["name"], "seconds": 0.5,
         "signature": "", "verdict": "equivalent"},
        {**row, "architecture": "qwen3", "case": qwen["name"], "seconds": 0.5,
         "first_divergence": "grad:model.layers.0.self_attn.q_norm.weight (grads, step 1)",
         "signature": "mismatch at model.layers.0.self_attn.q_norm.weight",
         "verdict": "not equivalent"},
        {**row, "architecture": "gpt2", "case": "", "seconds": 0.0, "signature": "",
         "verdict": "skipped", "reason": "no TP plan"},
    ]  # fmt: skip
    sweep = {
        "counts": {"equivalent": 1, "not equivalent": 1, "skipped": 1},
        "rows": rows,
        "rules": {},
        "summary": "2 checked of 3: 1 equivalent, 1 not equivalent, 1 skipped",
        "transformers": "5.24.0",
        "world_sizes": [2],
    }
    return synthetic_report([llama, qwen], sweep=sweep)


def wide_report() -> dict:
    """One block with ~50 tensor columns, a user-code ledger with asymmetric ranks, and a long
    name: everything that used to overflow a 1280 px page."""
    case = synthetic_case("lm/tiny/tp2/float32/a_rather_long_fault_name_here", 50, failing=True)
    case["ledger"] = user_code_ledger(asymmetric=True)
    return synthetic_report([case, synthetic_case("mlp/tiny/tp2/float32", 8)])
