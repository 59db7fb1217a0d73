"""Paths shared by the tests (a plain module: `conftest`
is ambiguous when several folders have one)."""

import importlib.util
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEED = Path(os.environ.get("TPCHECK_SEED_DIR", REPO.parent / "shared" / "seed")) / "reference.py"


def example(name: str):
    """examples/<name>.py imported as a module of its own (its cases, models and autograd
    functions), apart from the case-file loader's cache."""
    spec = importlib.util.spec_from_file_location(
        f"example_{name}_for_tests", REPO / "examples" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
