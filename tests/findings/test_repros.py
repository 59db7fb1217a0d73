"""The upstream defects in docs/findings: each standalone repro still reproduces its defect and
verifies every fix it offers (exit 0, `REPRODUCED` and one `FIX VERIFIED (<which>)` line per fix),
none of them imports tpcheck, and each transformers repro builds its parallel model the way
transformers documents it (`from_pretrained(..., distributed_config=DistributedConfig(...))`),
not through internal helpers."""

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

FINDINGS = Path(__file__).resolve().parents[2] / "docs" / "findings"

# repro script -> the upstream package it needs besides torch
REPROS = {
    "repro_hf_grad_allreduce.py": "transformers",
    "repro_hf_missing_rules.py": "transformers",
    "repro_hf_llama4_inplace_add.py": "transformers",
    "repro_hf_inkling_embedding.py": "transformers",
    "repro_hf_doge_dt_proj.py": "transformers",
    "repro_hf_gemma3n_sparsity.py": "transformers",
    "repro_hf_esmc_qk_norm.py": "transformers",
    "repro_hf_t5gemma2_embedding.py": "transformers",
    "repro_hf_neomme_heads.py": "transformers",
    "repro_hf_glm5_next_o_proj.py": "transformers",
    "repro_dtensor_sp_dropout.py": "torch",
    "repro_torch_fused_adamw_strided.py": "torch",
    "repro_megatron_label_smoothing.py": "megatron.core",
}


# the defects whose fix with transformers' own styles comes first (gather q/k/v, split at o_proj)
SHIPPED_FIRST = {
    "repro_hf_esmc_qk_norm.py",
    "repro_hf_neomme_heads.py",
    "repro_hf_doge_dt_proj.py",
    "repro_hf_glm5_next_o_proj.py",
}
# transformers' internal routes to a parallel model, which a documented-route repro does not take
INTERNAL = ("maybe_distribute_model", "initialize_distributed_mesh", "apply_tensor_parallelism")


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def test_every_repro_script_is_listed():
    on_disk = {p.name for p in FINDINGS.glob("repro_*.py")}
    assert on_disk == set(REPROS), f"unlisted or missing: {on_disk ^ set(REPROS)}"


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            names.update(a.value for a in node.args if isinstance(a, ast.Constant))
    return names


@pytest.mark.parametrize("script", sorted(REPROS))
def test_repro_does_not_import_tpcheck(script):
    imported = _imported_modules(FINDINGS / script)
    assert imported, "the scan found no import at all"
    assert not {m for m in imported if m.split(".")[0] == "tpcheck"}
    assert "tpcheck" not in (FINDINGS / script).read_text().replace("tpcheck hf", "")


def test_the_import_scan_sees_a_tpcheck_import(tmp_path):
    for line in ("import tpcheck", "from tpcheck.adapters import transformers as hf"):
        planted = tmp_path / "repro_x.py"
        planted.write_text(f"import torch\n\n\ndef run():\n    {line}\n")
        assert any(m.split(".")[0] == "tpcheck" for m in _imported_modules(planted))


def _calls(path: Path) -> list[ast.Call]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]


def _name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def documented_route(path: Path) -> list[str]:
    """What a repro lacks of transformers' documented route (empty: it takes it): a checkpoint
    saved, `from_pretrained(..., distributed_config=...)`, a `DistributedConfig`, and none of the
    internal helpers."""
    calls = _calls(path)
    names = {_name(c) for c in calls}
    loads = [c for c in calls if _name(c) == "from_pretrained"]
    missing = [n for n in ("save_pretrained", "DistributedConfig") if n not in names]
    if not any(k.arg == "distributed_config" for c in loads for k in c.keywords):
        missing.append("from_pretrained(..., distributed_config=...)")
    return missing + [f"uses {n}" for n in INTERNAL if n in names]


@pytest.mark.parametrize("script", sorted(s for s, m in REPROS.items() if m == "transformers"))
def test_transformers_repros_take_the_documented_route(script):
    assert documented_route(FINDINGS / script) == []


def test_the_route_scan_sees_an_internal_route(tmp_path):
    planted = tmp_path / "repro_x.py"
    planted.write_text(
        "m = Model(cfg)\nm = Model.maybe_distribute_model(m, DistributedConfig(), mesh)\n"
    )
    assert documented_route(planted) == [
        "save_pretrained",
        "from_pretrained(..., distributed_config=...)",
        "uses maybe_distribute_model",
    ]


def fix_lines(stdout: str) -> list[str]:
    """The fix verdict lines a repro printed, in order."""
    return [line for line in stdout.splitlines() if line.startswith(("FIX VERIFIED", "FIX FAILED"))]


def test_the_fix_lines_are_read_as_written():
    out = "x\nREPRODUCED: y\nFIX VERIFIED (shipped styles): a\nFIX FAILED (faster): b\n"
    assert fix_lines(out) == ["FIX VERIFIED (shipped styles): a", "FIX FAILED (faster): b"]


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(REPROS))
def test_repro_still_reproduces_and_its_fix_verifies(script):
    if not _has(REPROS[script]):
        pytest.skip(f"{REPROS[script]} is not installed")
    if REPROS[script] == "transformers" and not _has("accelerate"):
        pytest.skip("accelerate is not installed (tpcheck[transformers] installs it)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no tpcheck on the path
    proc = subprocess.run(
        [sys.executable, str(FINDINGS / script)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=FINDINGS,
    )
    shown = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{shown}"
    assert "\nREPRODUCED: " in proc.stdout, shown
    fixes = fix_lines(proc.stdout)
    assert fixes and all(f.startswith("FIX VERIFIED (") for f in fixes), shown
    if script in SHIPPED_FIRST:  # the fix a maintainer can merge today, then the faster one
        assert len(fixes) >= 2 and fixes[0].startswith("FIX VERIFIED (shipped styles): "), shown
