"""What every module of the adapter shares: the pinned transformers version and whether it imports
(`available`, `TRANSFORMERS_ERROR`), transformers' auto mappings, `Skip` (an architecture that
cannot be checked, with the reason), the shapes of a checked forward (`SEQ`, `BATCH`, `VOCAB`), the
size cap of a shape-reduced model, the two kinds of output checked (`LOGITS`, `HIDDEN`) and the
one-line form of an error message (`_first_line`).

Importing it imports transformers, before the ranks fork, and registers tpcheck's styles
(`styles.py`). When transformers does not import, `transformers` and its mappings are None: every
use checks `available()` first.
"""

from __future__ import annotations

PINNED = "5.24.0"
SEQ, BATCH, VOCAB = 8, 2, 128
MAX_PARAMS = 1_000_000  # a shape-reduced model beyond this kept sizes the rules do not know

try:  # imported at module load, before the ranks fork
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_MAPPING_NAMES,
    )

    from tpcheck.adapters.transformers import styles  # noqa: F401 - registers tpcheck's styles
except ImportError as e:  # pragma: no cover - depends on the optional extra
    TRANSFORMERS_ERROR: str | None = (
        f"transformers is not importable ({e}); pip install 'tpcheck[transformers]' "
        f"(transformers=={PINNED})"
    )
    transformers = CONFIG_MAPPING = CONFIG_MAPPING_NAMES = None
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = MODEL_MAPPING_NAMES = None
else:
    TRANSFORMERS_ERROR = None


def available() -> bool:
    return TRANSFORMERS_ERROR is None


def version() -> str | None:
    return transformers.__version__ if available() else None


class Skip(Exception):
    """An architecture that cannot be checked here, with the reason."""


LOGITS, HIDDEN = "logits", "hidden states"


def _first_line(e: BaseException) -> str:
    """The message's first line (with the next one when the first only introduces it: '...:')."""
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    first = (
        " ".join(text[:2]) if len(text) > 1 and text[0].endswith(":") else (text[0] if text else "")
    )
    return first[:300]
