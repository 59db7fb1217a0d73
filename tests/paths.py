"""Paths shared by the tests (a plain module: `conftest` is ambiguous when several folders have one)."""
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEED = Path(os.environ.get("TPCHECK_SEED_DIR", REPO.parent / "shared" / "seed")) / "reference.py"
