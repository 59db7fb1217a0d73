import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SEED = Path(os.environ.get("TPCHECK_SEED_DIR", REPO.parent / "shared" / "seed")) / "reference.py"
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def seed_reference() -> Path:
    if not SEED.exists():
        pytest.skip(f"seed reference not found at {SEED} (set TPCHECK_SEED_DIR)")
    return SEED
