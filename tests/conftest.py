import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from paths import SEED  # noqa: E402


@pytest.fixture(scope="session")
def seed_reference() -> Path:
    if not SEED.exists():
        pytest.skip(f"seed reference not found at {SEED} (set TPCHECK_SEED_DIR)")
    return SEED
