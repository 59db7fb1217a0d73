"""The ledger check, in the parent: what each rank issued (count and bytes per phase, op and site),
compared with what the case's block implies. A missing, extra or rank-asymmetric collective is
reported even when the numbers happen to agree (a redundant all-reduce is a cost; a missing
one a latent bug)."""

from __future__ import annotations

from collections import Counter

from tpcheck.checker.vocabulary import WARMUP


def summarize(entries: list[dict], world: int) -> dict:
    """{rank: {phase: {op: {"count": n, "bytes": b}}}} over the whole case."""
    out: dict = {r: {} for r in range(world)}
    for e in entries:
        slot = (
            out[e["rank"]].setdefault(e["phase"], {}).setdefault(e["op"], {"count": 0, "bytes": 0})
        )
        slot["count"] += 1
        slot["bytes"] += e["nbytes"]
    return {str(r): v for r, v in out.items()}


def check_ledger(
    entries: list[dict], expected: tuple | None, world: int, steps: int, micro: int
) -> dict:
    """Problems (missing / extra / asymmetric collectives) against `expected` = (phase, op, site)
    per micro-batch for forward/backward and per step for the optimizer phase. The warm-up
    forwards' collectives (phase WARMUP) are not counted against it, only held to being the same on
    every rank."""
    observed = {r: Counter() for r in range(world)}
    for e in entries:
        observed[e["rank"]][(e["phase"], e["op"], e["site"])] += 1
    problems = []
    if any(observed[r] != observed[0] for r in range(world)):
        problems.append(
            {
                "kind": "asymmetric",
                "text": "ranks issued different collectives: "
                + "; ".join(f"rank {r}: {sum(c.values())}" for r, c in observed.items()),
            }
        )
    want = Counter()
    if expected is not None and world > 1:
        for phase, op, site in expected:
            want[(phase, op, site)] += steps * (micro if phase != "optimizer" else 1)
        for key in sorted(set(want) | set(observed[0])):
            if key[0] == WARMUP:  # the warm-up forwards: outside the steps, held to symmetry only
                continue
            have, need = observed[0][key], want[key]
            if have != need:
                phase, op, site = key
                kind = "missing" if have < need else "extra"
                problems.append(
                    {
                        "kind": kind,
                        "phase": phase,
                        "op": op,
                        "site": site,
                        "expected": need,
                        "observed": have,
                        "text": f"{kind} collective: {op} at {site!r} in {phase}: expected {need}, "
                        f"issued {have}",
                    }
                )
    return {
        "expected": [
            {"phase": p, "op": o, "site": s, "count": n} for (p, o, s), n in sorted(want.items())
        ],
        "per_rank": summarize(entries, world),
        "problems": problems,
    }
