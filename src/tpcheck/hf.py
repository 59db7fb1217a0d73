"""`tpcheck hf`: HuggingFace transformers' own TP plans checked architecture by architecture.

`plan_sweep` turns architecture names into case specs (one per architecture and world size) and the
rows of those that cannot be checked ("skipped", with the reason: decided in this process, before
any rank runs, from the shape-reduced config and transformers' resolved plan); the cases then run in
two lanes (checker/pool/session.py `Lanes`: two rank pools per world size side by side, each rank on
one intra-op thread; ranks and transformers' mesh reused from case to case).
`sweep_section` is the report's `sweep` object: one row per architecture and world size (verdict,
first divergent module, signature, seconds, reason) and a summary line. `compact` drops a passed
case's passing checks from the JSON (a sweep of 100 architectures keeps ~2,000 checks each;
`--full` keeps them).
"""

from __future__ import annotations

import difflib

from tpcheck.adapters import transformers as hf
from tpcheck.checker.case import CaseSpec, Target
from tpcheck.errors import UsageError

# optimizer steps per architecture (each with its micro-batches): the sweep's default
SWEEP_STEPS = 2


def parse_rules(texts: list[str] | None) -> dict[str, str]:
    """`--rule PATTERN=STYLE` values as a dict; a malformed one is bad input."""
    rules = {}
    for text in texts or []:
        pattern, sep, style = text.partition("=")
        if not sep or not pattern.strip() or not style.strip():
            raise UsageError(
                f"--rule {text!r}: write PATTERN=STYLE, e.g. --rule "
                "'model.layers.*.self_attn.q_norm=replicated_with_grad_allreduce'"
            )
        rules[pattern.strip()] = style.strip()
    return rules


def select(names: list[str], everything: bool) -> list[str]:
    """The architectures asked for: `names`, or every one with a TP plan (`--all`)."""
    if not hf.available():
        raise UsageError(hf.TRANSFORMERS_ERROR)
    if everything and names:
        raise UsageError(
            f"give architecture names or --all, not both (got {' '.join(names)} and --all)"
        )
    if not everything and not names:
        raise UsageError(
            "name architectures (tpcheck hf llama mistral) or give --all; `tpcheck hf --list` "
            "lists those with a TP plan"
        )
    if everything:
        return hf.architectures()
    known = hf.architectures(names)
    types = hf.model_types()
    planless = [n for n in names if n in types and n not in known]
    if planless:
        raise UsageError(
            f"{', '.join(planless)}: its config declares no TP plan (base_model_tp_plan) in "
            f"transformers {hf.version()}, so transformers cannot shard it; `tpcheck "
            "hf --list` lists those that do"
        )
    unknown = [n for n in names if n not in known]
    if unknown:
        close = {
            n: difflib.get_close_matches(n.replace("-", "_").lower(), types, n=4, cutoff=0.6)
            for n in unknown
        }
        hints = "; ".join(
            f"{n!r}" + (f" (did you mean {', '.join(c)}?)" if c else "") for n, c in close.items()
        )
        raise UsageError(
            f"unknown architecture {hints}: not a transformers model_type with a TP plan in "
            f"transformers {hf.version()}; `tpcheck hf --list` lists them"
        )
    return list(dict.fromkeys(names))


def plan_sweep(
    names: list[str], world_sizes: list[int], dtypes: list[str], rules: dict[str, str], **settings
) -> tuple[list[CaseSpec], list[dict]]:
    """(case specs, rows of skipped architectures) for every architecture x world size x dtype."""
    specs, skipped = [], []
    for world in world_sizes:
        hf.prepare_all(names, world, rules or None)  # the CPUs shared; cached for what follows
        for name in names:
            try:
                hf.prepare(name, world, rules or None)
            except hf.Skip as e:
                skipped += [
                    {
                        "architecture": name,
                        "world_size": world,
                        "dtype": d,
                        "verdict": "skipped",
                        "reason": str(e),
                        "first_divergence": "",
                        "signature": "",
                        "seconds": 0.0,
                    }
                    for d in dtypes
                ]
                continue
            specs += [hf.hf_spec(name, world, d, rules or None, **settings) for d in dtypes]
    return specs, skipped


def sweep_section(
    results: list[dict], skipped: list[dict], world_sizes: list[int], rules: dict[str, str]
) -> dict:
    """The report's `sweep` object."""
    from tpcheck.report.console import signature_text, where_text

    rows = list(skipped)
    for r in results:
        arch = Target.parse(r["spec"]["block"]).name  # the report's spec, read back
        reason = "" if r["verdict"] in ("equivalent", "not equivalent") else r["summary"]
        rows.append(
            {
                "architecture": arch,
                "world_size": r["world_size"],
                "dtype": r["dtype"],
                "verdict": r["verdict"],
                "reason": reason,
                "first_divergence": where_text(r),
                "signature": signature_text(r),
                "seconds": round(float(r.get("seconds", 0.0)), 3),
                "case": r["name"],
            }
        )
    rows.sort(key=lambda row: (row["world_size"], row["architecture"], row["dtype"]))
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    checked = sum(n for v, n in counts.items() if v != "skipped")
    line = f"{checked} checked of {len(rows)} (architecture x world size x dtype): " + ", ".join(
        f"{n} {v}" for v, n in sorted(counts.items())
    )
    return {
        "transformers": hf.version(),
        "world_sizes": list(world_sizes),
        "rules": dict(rules),
        "rows": rows,
        "counts": counts,
        "summary": line,
    }


def compact(result: dict) -> dict:
    """`result` with its passing checks left out (counted in `checks_omitted`); failures, the
    ledger, the diagnosis and the self-test stay."""
    checks = result.get("checks")
    if not checks:
        return result
    kept = [c for c in checks if not c.get("passed", True)]
    if len(kept) == len(checks):
        return result
    return {**result, "checks": kept, "checks_omitted": {"passed": len(checks) - len(kept)}}
