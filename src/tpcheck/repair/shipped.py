"""Transformers' own terms for a repair: which overrides are made of the styles transformers ships
(`shipped`), the override of those styles that gathers a failing region (`gathered_regions`), and
the parameters `from_pretrained` converts at load, whose rules tpcheck's in-memory build does not
check through that conversion (`converted_at_load`)."""

from __future__ import annotations

import re


def wildcard(name: str) -> str:
    """A module name with its layer numbers as `*`, as transformers' plan keys write them."""
    return re.sub(r"\.\d+\.", ".*.", name + ".")[:-1] if name else name


def shipped(override: dict[str, str]) -> bool:
    """Whether every style of an override ships with transformers (none is tpcheck's own)."""
    from tpcheck.adapters.transformers.styles import TPCHECK_STYLES

    return not set(override.values()) & set(TPCHECK_STYLES)


def gathered_regions(keys: list[str], plan: dict[str, str], kinds: dict[str, str]) -> list[dict]:
    """For each failing key's parent module whose rules shard its input projections `colwise` and
    its one output projection `rowwise` (an attention, an MLP): those set to
    `colwise_gather_output` and `rowwise_split_input`, and the failing vector-parameter modules in
    it (norms) to `replicate`. The region then computes on whole tensors on every rank, as
    transformers' own OLMo2 plan runs its all-head q/k norms; slower, made of shipped styles."""
    out = []
    for parent in dict.fromkeys(k.rpartition(".")[0] for k in keys):
        children = {k: s for k, s in plan.items() if k.rpartition(".")[0] == parent}
        cols = [k for k, s in children.items() if s == "colwise"]
        rows = [k for k, s in children.items() if s == "rowwise"]
        if not cols or len(rows) != 1:
            continue
        override = {**dict.fromkeys(cols, "colwise_gather_output"), rows[0]: "rowwise_split_input"}
        norms = [k for k in keys if k.rpartition(".")[0] == parent and kinds.get(k) == "vectors"]
        out.append({**override, **dict.fromkeys(norms, "replicate")})
    return list({tuple(sorted(o.items())): o for o in out}.values())  # each once, in order


def converted_at_load(model_type: str, params: set[str]) -> dict[str, list[str]]:
    """The parameters `from_pretrained` converts at load beyond a rename (transformers'
    conversion mapping: checkpoint tensors merged, concatenated, interleaved...), layer-wildcarded,
    with the operations' names. It shards the checkpoint's tensors before those operations, so a
    rule for such a parameter checked on tpcheck's in-memory build may shard it otherwise there."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without load-time conversions
        return {}
    out: dict[str, list[str]] = {}
    for t in get_checkpoint_conversion_mapping(model_type) or ():
        ops = [type(op).__name__ for op in getattr(t, "operations", None) or ()]
        if not ops:
            continue
        for pattern in getattr(t, "target_patterns", None) or ():
            for name in params:
                if re.search(pattern, name):
                    out.setdefault(wildcard(name), ops)
    return out
