"""Which architectures have a TP plan: the model_types whose config class declares
`base_model_tp_plan`, read once per installed transformers and kept in a file under the
installation's fingerprint (`discovery_cache_path`); and every model_type transformers knows.
"""

from __future__ import annotations

from tpcheck.adapters.transformers.common import (
    CONFIG_MAPPING,
    CONFIG_MAPPING_NAMES,
    TRANSFORMERS_ERROR,
    available,
    transformers,
)
from tpcheck.errors import UsageError


def architectures(names: list[str] | None = None) -> list[str]:
    """The model_types (all of transformers', or those of `names` it knows) whose config class
    declares a TP plan (`base_model_tp_plan`), sorted. Each config class is imported to be read (all
    of them: ~8 s), once per installed transformers: the list of all of them is kept in a file
    (`discovery_cache_path`) under the installation's fingerprint (`_fingerprint`) and read from it
    while the fingerprint matches."""
    if not available():
        raise UsageError(TRANSFORMERS_ERROR)
    everything = _cached_architectures()
    if names is None:
        return everything
    return sorted(n for n in dict.fromkeys(names) if n in everything)


def discovery_cache_path():
    """The file the architectures with a TP plan are kept in: $TPCHECK_CACHE_DIR, else
    $XDG_CACHE_HOME/tpcheck, else ~/.cache/tpcheck; one file per transformers version."""
    import os
    from pathlib import Path

    root = os.environ.get("TPCHECK_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "tpcheck"
    )
    return Path(root) / f"hf-architectures-{transformers.__version__}.json"


def _fingerprint() -> str:
    """What the list depends on: transformers' version and location, its model_type -> config
    class table, and the newest modification time of its configuration files (a reinstall or an
    edited config at the same version makes the list stale). Reads no config class."""
    import glob
    import hashlib
    import os

    root = os.path.dirname(transformers.__file__)
    files = glob.glob(os.path.join(root, "models", "*", "configuration_*.py"))
    newest = max((os.stat(f).st_mtime_ns for f in files), default=0)
    text = repr((transformers.__version__, root, sorted(CONFIG_MAPPING_NAMES.items()), newest))
    return hashlib.sha256(text.encode()).hexdigest()


def _cached_architectures() -> list[str]:
    import json
    import os
    import tempfile

    path, fingerprint = discovery_cache_path(), _fingerprint()
    try:
        kept = json.loads(path.read_text())
        if kept.get("fingerprint") == fingerprint and isinstance(kept.get("architectures"), list):
            return list(kept["architectures"])
    except (OSError, ValueError, AttributeError):
        pass  # none yet, unreadable or not ours: read the config classes
    found = _scan_architectures()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:  # written whole, then renamed: a reader sees all or none
            json.dump({"fingerprint": fingerprint, "architectures": found}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache directory: the list is read again next time
    return found


def _scan_architectures() -> list[str]:
    """Every model_type whose config class declares a TP plan, each config class imported."""
    out = []
    for model_type in CONFIG_MAPPING_NAMES:
        try:
            cls = CONFIG_MAPPING[model_type]
        except Exception:  # noqa: BLE001 - a config class that does not import is not a TP plan we can read
            continue
        if getattr(cls, "base_model_tp_plan", None):
            out.append(model_type)
    return sorted(out)


def model_types() -> list[str]:
    """Every model_type transformers knows, plan or not (nothing imported)."""
    return sorted(CONFIG_MAPPING_NAMES)
