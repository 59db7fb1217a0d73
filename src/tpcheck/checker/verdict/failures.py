"""Case results for runs that did not finish on every rank: a hang, a crash, or bad input.

One rank's failure usually drags the others down with it (a peer blocked in a collective with a dead
rank times out, or is killed by the launcher), so the verdict follows the *root* problem, by this
priority: bad input ("invalid") > a rank that died or raised ("error") > a hang > the knock-on
failures (peers that lost their connection or were stopped by the launcher).

A hang is told rank by rank from the launcher's evidence (heartbeat.py): who waited in which
collective (op, site, phase, and the file:line that issued it), who waited at the checker's
checkpoint, who was computing or silent -- the culprits, named first -- and where the ranks' ledgers
of issued collectives first differ (the rank-dependent branch that skipped a collective is usually
right there).
"""

from __future__ import annotations

import re

from tpcheck.checker.case import CaseSpec
from tpcheck.checker.payload import ledger_diff
from tpcheck.checker.sourcelines import frame_kind, readable_path
from tpcheck.checker.verdict.hangs import describe, hang_details, hang_summary
from tpcheck.checker.vocabulary import Verdict

# a rank's Status (or "peer", see _kind) -> (priority, verdict); lower priority wins
STATUS: dict[str, tuple[int, Verdict]] = {
    "usage": (0, "invalid"),
    "crash": (1, "error"),
    "error": (2, "error"),
    "hang": (3, "hang"),
    "peer": (4, "error"),
    "aborted": (5, "error"),
}
PEER_LOST = ("connection closed by peer", "connection reset", "broken pipe", "connection refused")
TRACEBACK_LINES = 12


def failure_fields(spec: CaseSpec, payloads: list) -> dict:
    """verdict, as_expected, problems, summary (and `hang` for a hang, `crash` for a rank that died
    before reporting) of a CaseResult from payloads (`RankPayload`s), some not "ok"."""
    failed = [p for p in payloads if p.status != "ok"]
    primary = min(failed, key=lambda p: (STATUS[_kind(p)][0], p.rank))
    verdict = STATUS[_kind(primary)][1]
    out = {
        "verdict": verdict,
        "problems": [p.problem_json() for p in failed],
        "as_expected": verdict == "hang" and spec.expected_verdict == "hang",
    }
    if verdict == "hang":
        out["hang"] = hang_details(payloads)
        out["summary"] = hang_summary(out["hang"])
    elif verdict == "invalid":
        out["summary"] = f"invalid: {primary.message}"
    else:
        out["summary"] = error_summary(primary)
        if primary.status == "crash":  # died before reporting: what every rank was doing
            out["crash"] = crash_details(payloads)
            out["summary"] += "; " + crash_summary(out["crash"])
    return out


def crash_details(payloads: list) -> dict:
    """A rank that died before reporting (a signal, an exit): what every rank that failed was doing,
    from its own report (where it raised) or its last heartbeat, and where the ranks' ledgers of
    collectives first differ, with their sizes: a collective library kills a rank whose collective
    meets one of another size on another rank (gloo: SIGABRT), so the extra or mismatched collective
    is usually right there."""
    ranks = [
        {"rank": p.rank, "status": p.status, "doing": _doing(p)}
        for p in payloads
        if p.status != "ok"
    ]
    ledgers = {
        p.rank: [f"{e.line()} of {e.nbytes} bytes" for e in p.ledger]
        for p in payloads
        if p.has_ledger
    }
    diff = ledger_diff(ledgers) if len(ledgers) > 1 else None
    if diff and len(ledgers) < len(payloads):
        diff += f" (no ledger from rank(s) {sorted(set(range(len(payloads))) - set(ledgers))})"
    aborted = any(p.status == "crash" and "SIGABRT" in p.message for p in payloads)
    return {"ranks": ranks, "ledger_diff": diff, "cause": ABORTED if aborted else None}


def _died_in(e: dict | None) -> str:
    """Where a rank that died was: from its dumped stacks (a collective library's abort), else from
    its last heartbeat."""
    if not e:
        return "(no heartbeat: where is unknown)"
    if e.get("dumped"):
        if e["state"] == "collective":
            return f"in torch.distributed.{e['call']} called at {e['at']}"
        return f"at {e['at']}"
    return f"(last seen: {describe(e)})" if "seconds" in e else f"({e.get('state', 'unknown')})"


ABORTED = (
    "the collective library aborted it (gloo: SIGABRT): its collective met one of another size or "
    "kind on another rank, e.g. a collective issued on some ranks only"
)


def crash_summary(crash: dict) -> str:
    parts = [r["doing"] for r in crash["ranks"]]
    if crash.get("cause"):
        parts.append(crash["cause"])
    if crash["ledger_diff"]:
        parts.append(crash["ledger_diff"])
    return "; ".join(parts)


def _doing(p) -> str:
    """What rank `p` was doing when the case ended, in words."""
    if p.status == "crash":
        return f"rank {p.rank} died {_died_in(p.where)}"
    where = raised_in(p.traceback) if p.traceback else None
    if where:
        label, last = p.last_collective, p.ledger[-1] if p.ledger else None
        size = f" of {last.nbytes} bytes" if last is not None and last.nbytes else ""
        inside = f" in {label[2]} {label[0]}{size} at {label[1]!r}" if label else ""
        return f"rank {p.rank} raised{inside} at {where}"
    if p.where:
        return describe(p.where)
    return f"rank {p.rank}: {p.message or p.status}"


def _kind(p) -> str:
    if p.status == "error" and any(s in p.message.lower() for s in PEER_LOST):
        return "peer"  # lost its connection because another rank died: a consequence, not a cause
    return p.status if p.status in STATUS else "error"


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


def raised_in(tb: str) -> str | None:
    """The innermost frame of a traceback in the code under test (not torch's, not tpcheck's, not
    the standard library's plumbing): 'file.py:LINE in func: source', or None."""
    lines = tb.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.match(lines[i])
        if m and frame_kind(m["path"]) == "user":
            source = (
                lines[i + 1].strip()
                if i + 1 < len(lines) and not _FRAME.match(lines[i + 1])
                else ""
            )
            where = f"{readable_path(m['path'])}:{m['line']} in {m['func']}"
            return f"{where}: {source}" if source else where
    return None


def error_summary(p) -> str:
    text = f"error: rank {p.rank}: {p.message}"
    where = raised_in(p.traceback) if p.traceback else None
    if where and where.split(":", 1)[0] not in p.message:
        text += f" (raised at {where})"
    if p.traceback:
        tail = p.traceback.rstrip().splitlines()[-TRACEBACK_LINES:]
        text += "\n" + "\n".join("       " + line for line in tail)
    return text


# ---------------------------------------------------------------------------- hangs
