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

from tpcheck.check.case import CaseSpec
from tpcheck.check.heartbeat import culprits, describe
from tpcheck.check.ledger import ledger_diff
from tpcheck.check.usercode import short_path

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


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
_NOT_UNDER_TEST = ("/torch/", "/tpcheck/", "/multiprocessing/", "/threading.py", "/contextlib.py", "/functools.py")


def raised_in(tb: str) -> str | None:
    """The innermost frame of a traceback in the code under test (not torch's, not tpcheck's, not the
    standard library's plumbing): 'file.py:LINE in func: source', or None."""
    lines = tb.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.match(lines[i])
        if m and not any(part in m["path"] for part in _NOT_UNDER_TEST):
            source = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            path = m["path"].split("site-packages/", 1)[-1] if "site-packages/" in m["path"] else short_path(m["path"])
            where = f"{path}:{m['line']} in {m['func']}"
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


def hang_details(payloads: list) -> dict:
    """Per rank, where it was (the launcher's heartbeat evidence when there is some, else what the rank
    said itself); the culprits among them; where the ranks' ledgers of collectives first differ."""
    ranks = [_evidence(p) for p in payloads if p.status != "ok"]
    culprit, cause = culprits([e for e in ranks if e["state"] != "unknown"])
    stuck = [{"rank": e["rank"], **{k: e[k] for k in ("op", "site", "phase") if k in e}}
             for e in ranks if e["state"] == "collective"]
    waiting = [{"rank": e["rank"], "checkpoint": e.get("checkpoint"), "message": e.get("message", "")}
               for e in ranks if e["state"] == "checkpoint"]
    ledgers = {p.rank: lines for p in payloads if (lines := p.ledger_lines()) is not None}
    diff = ledger_diff(ledgers) if ledgers else None
    if diff and len(ledgers) < len(payloads):
        diff += f" (no ledger from rank(s) {sorted(set(range(len(payloads))) - set(ledgers))})"
    return {"ranks": ranks, "culprits": culprit, "cause": cause, "stuck_in_collective": stuck,
            "waiting_at_checkpoint": waiting, "ledger_diff": diff}


def _evidence(p) -> dict:
    """One rank's state in a hang: the launcher's evidence (`where`), completed by the rank's own
    report (the checkpoint's message, a tapped collective's label)."""
    e = dict(p.where) if p.where else {"rank": p.rank, "state": p.waiting_in or "unknown"}
    if p.message and p.status == "hang":
        e["message"] = p.message
    if p.waiting_in == "checkpoint":
        e["state"] = "checkpoint"
        e["checkpoint"] = p.checkpoint or e.get("checkpoint")
    if e["state"] == "collective" and "op" not in e and p.last_collective:
        e["op"], e["site"], e["phase"] = p.last_collective
    return e


def _line(e: dict) -> str:
    if "seconds" in e:
        return describe(e)
    if e["state"] == "collective":  # a rank's own report, without the launcher's evidence (torchrun)
        return (f"rank {e['rank']} stuck in {e['phase']} {e['op']} at {e['site']!r} until the timeout" if e.get("op")
                else f"rank {e['rank']} stuck in a collective until the timeout")
    if e["state"] == "checkpoint":
        return f"rank {e['rank']} waiting at the checker's checkpoint after {e.get('checkpoint') or 'a checkpoint'}"
    return e.get("message") or f"rank {e['rank']}: no evidence"


def hang_summary(h: dict) -> str:
    mismatch = [w["message"] for w in h["waiting_at_checkpoint"] if w["message"].startswith("collective mismatch")]
    if mismatch and not h["stuck_in_collective"] and not h["culprits"]:
        return f"hang risk: {mismatch[0]}; a collective was issued on some ranks only"
    by_rank = {e["rank"]: e for e in h["ranks"]}
    head = ""
    if h["culprits"]:
        head = f"rank(s) {h['culprits']} held the others up: "
    order = h["culprits"] + [r for r in sorted(by_rank) if r not in h["culprits"]]
    parts = "; ".join(_line(by_rank[r]) for r in order)
    diff = f"; {h['ledger_diff']}" if h["ledger_diff"] else ""
    return f"hang detected: {head}{parts}{diff}; {h['cause']}"
