"""`prepare_all` (tpcheck.adapters.transformers): the sweep's architectures prepared by workers
forked from the parent, the CPUs shared, their outcomes taken into the parent's cache -- the same
outcomes `prepare` gives one at a time, a Skip's reason included; a worker that dies leaves its
share to `prepare`.

Needs the extra `tpcheck[transformers]` (transformers==5.24.0): skipped with the reason without it.
"""

from __future__ import annotations

import os

import pytest

transformers = pytest.importorskip(
    "transformers", reason="the extra tpcheck[transformers] is not installed"
)
from tpcheck.adapters import transformers as hf  # noqa: E402
from tpcheck.adapters.transformers import sweep  # noqa: E402
from tpcheck.checker.pool import spawn  # noqa: E402

pytestmark = pytest.mark.skipif(
    transformers.__version__ != hf.PINNED,
    reason=f"rules measured on transformers {hf.PINNED}, found {transformers.__version__}",
)
# 16 architectures: two shares of 8; voxtral_realtime_text is skipped (its layers read an input
# its forward does not name)
NAMES = [
    "llama", "qwen3", "gemma", "gemma2", "mistral", "olmo", "olmo2", "phi3",
    "qwen2", "starcoder2", "cohere", "granite", "glm", "helium", "smollm3", "voxtral_realtime_text",
]  # fmt: skip


def _outcome(name: str):
    try:
        p = hf.prepare(name, 2)
    except hf.Skip as e:
        return "skip", str(e)
    return (
        p.model_type,
        p.config.to_dict(),
        p.tp_plan,
        {k: repr(v) for k, v in p.activations.items()},
        repr(p.output),
        p.kind,
        p.output_shape,
        p.pinned,
        p.inputs,
    )


@pytest.fixture
def two_cpus(monkeypatch):
    """A fresh cache, and two CPUs for the forks (a pytest parent gets one: `spawn._cpus`; the
    workers prepare on one thread each, as every `prepare` does)."""
    monkeypatch.setattr(sweep, "_PREPARED", {})
    monkeypatch.setattr(spawn, "_cpus", lambda: (2, 1))


def test_the_workers_outcomes_are_preparations_one_at_a_time(two_cpus, monkeypatch):
    hf.prepare_all(NAMES, 2)
    keys = {(n, 2, ()) for n in NAMES}
    # every one in the cache: this process's share and the worker's, none left for later
    assert keys <= set(sweep._PREPARED)
    assert isinstance(sweep._PREPARED[("voxtral_realtime_text", 2, ())], hf.Skip)
    together = {n: _outcome(n) for n in NAMES}
    monkeypatch.setattr(sweep, "_PREPARED", {})
    alone = {n: _outcome(n) for n in NAMES}
    assert together == alone
    assert together["voxtral_realtime_text"][0] == "skip"
    assert "linear()" in together["voxtral_realtime_text"][1]


def test_a_worker_that_dies_leaves_its_share_to_prepare(two_cpus, monkeypatch):
    """Mutant of the worker: it dies before sending. Its share is not in the cache, and `prepare`
    still gives each of them (no hang, no missing outcome)."""
    monkeypatch.setattr(sweep, "_prepare_share", lambda share, conn, parent: os._exit(1))
    hf.prepare_all(NAMES, 2)
    missing = [n for n in NAMES if (n, 2, ()) not in sweep._PREPARED]
    assert missing == NAMES[1::2]  # the worker's share: every second one
    assert _outcome("qwen3")[0] == "qwen3"


def test_one_cpu_or_a_few_architectures_fork_nothing(monkeypatch):
    monkeypatch.setattr(sweep, "_PREPARED", {})
    monkeypatch.setattr(sweep, "_prepare_share", lambda *a: pytest.fail("forked a worker"))
    monkeypatch.setattr(spawn, "_cpus", lambda: (1, 1))
    hf.prepare_all(NAMES, 2)
    monkeypatch.setattr(spawn, "_cpus", lambda: (2, 1))
    hf.prepare_all(NAMES[:10], 2)
    assert not sweep._PREPARED
