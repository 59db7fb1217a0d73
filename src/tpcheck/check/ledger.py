"""The collective ledger: what each rank issued (count and bytes per phase, op and site), compared
with what the case's block implies. A missing, extra or rank-asymmetric collective is reported even
when the numbers happen to agree (a redundant all-reduce is a cost; a missing one a latent bug)."""
from __future__ import annotations

from collections import Counter
from datetime import timedelta

from tpcheck.parallel.group import TPGroup


def summarize(entries: list[dict], world: int) -> dict:
    """{rank: {phase: {op: {"count": n, "bytes": b}}}} over the whole case."""
    out: dict = {r: {} for r in range(world)}
    for e in entries:
        slot = out[e["rank"]].setdefault(e["phase"], {}).setdefault(e["op"], {"count": 0, "bytes": 0})
        slot["count"] += 1
        slot["bytes"] += e["nbytes"]
    return {str(r): v for r, v in out.items()}


def check_ledger(entries: list[dict], expected: tuple | None, world: int, steps: int, micro: int) -> dict:
    """Problems (missing / extra / asymmetric collectives) against `expected` = (phase, op, site)
    per micro-batch for forward/backward and per step for the optimizer phase."""
    observed = {r: Counter() for r in range(world)}
    for e in entries:
        observed[e["rank"]][(e["phase"], e["op"], e["site"])] += 1
    problems = []
    if any(observed[r] != observed[0] for r in range(world)):
        problems.append({"kind": "asymmetric", "text": "ranks issued different collectives: " + "; ".join(
            f"rank {r}: {sum(c.values())}" for r, c in observed.items())})
    want = Counter()
    if expected is not None and world > 1:
        for phase, op, site in expected:
            want[(phase, op, site)] += steps * (micro if phase != "optimizer" else 1)
        for key in sorted(set(want) | set(observed[0])):
            have, need = observed[0][key], want[key]
            if have != need:
                phase, op, site = key
                kind = "missing" if have < need else "extra"
                problems.append({"kind": kind, "phase": phase, "op": op, "site": site, "expected": need,
                                 "observed": have,
                                 "text": f"{kind} collective: {op} at {site!r} in {phase}: expected {need}, "
                                         f"issued {have}"})
    return {"expected": [{"phase": p, "op": o, "site": s, "count": n} for (p, o, s), n in sorted(want.items())],
            "per_rank": summarize(entries, world), "problems": problems}


class CollectiveMismatch(RuntimeError):
    """Ranks issued different collectives, or some never reached a checkpoint (a hang).
    `checkpoint` names the checkpoint this rank waited at (the launcher reports it)."""

    def __init__(self, message: str, checkpoint: str | None = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


def sync_ledgers(g: TPGroup, where: str) -> None:
    """Before the checker's own collectives, every rank must have issued the same model collectives.
    Ledgers are exchanged through the rendezvous store, not a collective, so a rank out of step cannot
    make the checker's collectives pair with the model's (gloo aborts on such a size mismatch)."""
    if g.world_size == 1 or g.store is None or g.ledger is None:
        return
    g.syncs += 1
    key = f"tpcheck/sync{g.syncs}"
    mine = [f"{e.phase} {e.op} at {e.site!r}" for e in g.ledger]
    g.store.set(f"{key}/{g.rank}", "\n".join(mine))
    keys = [f"{key}/{r}" for r in range(g.world_size)]
    try:
        g.store.wait(keys, timedelta(seconds=g.timeout_s))
    except Exception:  # noqa: BLE001 - a store wait past its timeout: some rank is stuck
        missing = [r for r, k in enumerate(keys) if not g.store.check([k])]
        raise CollectiveMismatch(
            f"hang detected: rank(s) {missing} did not reach the checkpoint after {where} within "
            f"{g.timeout_s:g} s; this rank had issued {len(mine)} collective(s), the last "
            f"{mine[-1] if mine else 'none'}", checkpoint=where) from None
    ledgers = [g.store.get(k).decode().split("\n") if g.store.get(k) else [] for k in keys]
    if any(ld != ledgers[0] for ld in ledgers):
        raise CollectiveMismatch(f"collective mismatch after {where}: " + _ledger_diff(ledgers), checkpoint=where)


def _ledger_diff(ledgers: list[list[str]]) -> str:
    counts = ", ".join(f"rank {r}: {len(ld)}" for r, ld in enumerate(ledgers))
    for i in range(max(len(ld) for ld in ledgers)):
        at = [ld[i] if i < len(ld) else "nothing" for ld in ledgers]
        if len(set(at)) > 1:
            which = "; ".join(f"rank {r}: {a}" for r, a in enumerate(at))
            return f"collectives issued ({counts}) first differ at #{i + 1}: {which}"
    return f"collectives issued: {counts}"
