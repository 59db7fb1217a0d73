"""The upstream defects documented in docs/findings, indexed by mechanism: a diagnosis whose
signature and evidence match one of them points at its write-up (the report's `finding`, the
terminal summary's `finding:` line).

An entry matches on the diagnosis' signature and a condition on its evidence (the plan style of
the parameter, the kind of plan the TP code applied), never on an architecture's or a parameter's
name: any model that hits the same mechanism through the same style gets the same pointer. A defect
in a model's own code (`op_on_shard`: an operation run on a shard of the dimension it reads) is
matched by the source file and the operation the diagnosis names: that code, whichever
architecture runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# transformers' named TP/EP styles (`ALL_PARALLEL_STYLES` in transformers/distributed, 5.x): a plan
# whose every style is one of these is a transformers plan
TRANSFORMERS_STYLES = frozenset(
    {
        "all_reduce",
        "colwise",
        "colwise_gather_output",
        "colwise_rep",
        "embedding_colwise",
        "embedding_rowwise",
        "ep_dispatch_experts",
        "grouped_gemm",
        "local_params",
        "mla_kv_a_proj",
        "moe_identity_expert",
        "moe_tp_experts",
        "packed_colwise",
        "packed_rowwise",
        "replicate",
        "replicated_with_grad_allreduce",
        "rowwise",
        "rowwise_rep",
        "rowwise_split_input",
        "sequence_parallel",
    }
)


def _transformers_plan(evidence: dict) -> bool:
    used = evidence.get("plan_styles") or []
    return bool(used) and set(used) <= TRANSFORMERS_STYLES


@dataclass(frozen=True)
class Finding:
    """One documented defect: the signature it shows as, the condition on the diagnosis'
    evidence, the write-up (a path from the repository root) and its title."""

    signature: str
    condition: Callable[[dict], bool]
    doc: str
    title: str


def _op_in(files: tuple[str, ...], ops: frozenset[str]) -> Callable[[dict], bool]:
    """The condition "an operation of `ops` in one of `files` (paths within the installed
    packages) ran on a shard" on an `op_on_shard` diagnosis' evidence."""

    def condition(evidence: dict) -> bool:
        return any(
            op.get("op") in ops and op.get("at", "").rpartition(":")[0].endswith(files)
            for op in evidence.get("ops") or []
        )

    return condition


FINDINGS: tuple[Finding, ...] = (
    Finding(
        "grad_accumulation_reduced",
        lambda ev: ev.get("style") == "replicated_with_grad_allreduce",
        "docs/findings/hf-replicated-grad-allreduce-accumulation.md",
        "transformers: replicated_with_grad_allreduce counts early micro-batches world-size times",
    ),
    Finding(
        "no_plan_rule",
        _transformers_plan,
        "docs/findings/hf-moe-missing-norm-rules.md",
        "transformers: a plan with no rule for a replicated weight whose gradient is partial",
    ),
    Finding(
        "op_on_shard",
        _op_in(("transformers/models/gemma3n/modeling_gemma3n.py",), frozenset({"mean", "std"})),
        "docs/findings/hf-gemma3n-activation-sparsity.md",
        "transformers: Gemma3n's activation-sparsity cutoff is a statistic of each rank's shard",
    ),
)


def finding_for(diagnosis: dict | None) -> dict | None:
    """{"doc", "title", "signature"} of the documented defect `diagnosis` matches, or None."""
    if not diagnosis:
        return None
    evidence = diagnosis.get("evidence") or {}
    for f in FINDINGS:
        if diagnosis.get("signature") == f.signature and f.condition(evidence):
            return {"doc": f.doc, "title": f.title, "signature": f.signature}
    return None
