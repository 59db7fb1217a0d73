"""Case results for runs that did not finish on every rank: a hang, a crash, or bad input.

One rank's failure usually drags the others down with it (a peer blocked in a collective with a dead
rank times out, or is killed by the launcher), so the verdict follows the *root* problem, by this
priority: bad input ("invalid") > a rank that died or raised ("error") > a hang > the knock-on
failures (peers that lost their connection or were stopped by the launcher).

A hang is told rank by rank: who was stuck in which collective (op, site, phase), who was waiting
at the checker's checkpoint, and where the ranks' ledgers of issued collectives first differ --
the rank-dependent branch that skipped a collective is usually right there.
"""
from __future__ import annotations

from tpcheck.check.case import CaseSpec
from tpcheck.check.ledger import ledger_diff

# status -> (priority, verdict); lower priority wins
STATUS = {"usage": (0, "invalid"), "crash": (1, "error"), "error": (2, "error"), "hang": (3, "hang"),
          "peer": (4, "error"), "aborted": (5, "error")}
PEER_LOST = ("connection closed by peer", "connection reset", "broken pipe", "connection refused")
TRACEBACK_LINES = 12


def failure_fields(spec: CaseSpec, payloads: list) -> dict:
    """verdict, as_expected, problems, summary (and `hang` for hangs) of a CaseResult from payloads
    (`RankPayload`s), some not "ok"."""
    failed = [p for p in payloads if p.status != "ok"]
    primary = min(failed, key=lambda p: (STATUS[_kind(p)][0], p.rank))
    verdict = STATUS[_kind(primary)][1]
    out = {"verdict": verdict, "problems": [p.problem_json() for p in failed],
           "as_expected": verdict == "hang" and spec.expected_verdict == "hang"}
    if verdict == "hang":
        out["hang"] = hang_details(payloads)
        out["summary"] = hang_summary(out["hang"])
    elif verdict == "invalid":
        out["summary"] = f"invalid: {primary.message}"
    else:
        out["summary"] = error_summary(primary)
    return out


def _kind(p) -> str:
    if p.status == "error" and any(s in p.message.lower() for s in PEER_LOST):
        return "peer"  # lost its connection because another rank died: a consequence, not a cause
    return p.status if p.status in STATUS else "error"


def error_summary(p) -> str:
    text = f"error: rank {p.rank}: {p.message}"
    if p.traceback:
        tail = p.traceback.rstrip().splitlines()[-TRACEBACK_LINES:]
        text += "\n" + "\n".join("       " + line for line in tail)
    return text


# ---------------------------------------------------------------------------- hangs


def hang_details(payloads: list) -> dict:
    stuck, waiting, unknown = [], [], []
    for p in payloads:
        spot = _spot(p.last_collective)
        if p.status == "ok":
            continue
        if p.waiting_in == "checkpoint":
            waiting.append({"rank": p.rank, "checkpoint": p.checkpoint, "message": p.message})
        elif p.waiting_in == "collective":
            stuck.append({"rank": p.rank, **spot})
        else:
            unknown.append({"rank": p.rank, "last_seen": spot or None, "message": p.message})
    ledgers = {p.rank: lines for p in payloads if (lines := p.ledger_lines()) is not None}
    diff = ledger_diff(ledgers) if ledgers else None
    if diff and len(ledgers) < len(payloads):
        diff += f" (no ledger from rank(s) {sorted(set(range(len(payloads))) - set(ledgers))})"
    return {"stuck_in_collective": stuck, "waiting_at_checkpoint": waiting, "other": unknown, "ledger_diff": diff}


def _spot(last) -> dict:
    if not last:
        return {}
    op, site, phase = last
    return {"op": op, "site": site, "phase": phase}


def hang_summary(h: dict) -> str:
    parts = [f"rank {s['rank']} stuck in {s['phase']} {s['op']} at {s['site']!r} until the timeout"
             if s.get("op") else f"rank {s['rank']} stuck in a collective until the timeout"
             for s in h["stuck_in_collective"]]
    by_checkpoint: dict[str, list[int]] = {}
    for w in h["waiting_at_checkpoint"]:
        by_checkpoint.setdefault(w["checkpoint"] or "a checkpoint", []).append(w["rank"])
    parts += [f"rank(s) {ranks} waiting at the checker's checkpoint after {cp}" for cp, ranks in by_checkpoint.items()]
    parts += [o["message"] for o in h["other"]]
    mismatch = [w["message"] for w in h["waiting_at_checkpoint"] if w["message"].startswith("collective mismatch")]
    if mismatch and not h["stuck_in_collective"]:
        return f"hang risk: {mismatch[0]}; a collective was issued on some ranks only"
    diff = f"; {h['ledger_diff']}" if h["ledger_diff"] else ""
    if h["stuck_in_collective"] or "first differ" in (h["ledger_diff"] or ""):
        cause = "a collective was issued on some ranks only"
    else:
        cause = "some rank never reached a collective or checkpoint (stuck in compute or user code)"
    return f"hang detected: {'; '.join(parts)}{diff}; {cause}"
