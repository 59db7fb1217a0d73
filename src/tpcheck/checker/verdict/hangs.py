"""A hang told rank by rank from the launcher's evidence (pool/heartbeat.py): who waited in which
collective (op, site, phase, and the file:line that issued it), who waited at the checker's
checkpoint, who was computing or silent -- the culprits, named first -- and where the ranks' ledgers
of issued collectives first differ (the rank-dependent branch that skipped a collective is
usually right there)."""

from __future__ import annotations

from tpcheck.checker.payload import ledger_diff


def culprits(evidence: list[dict]) -> tuple[list[int], str]:
    """Which ranks hold the others up, and why, from the ranks' evidence (those still running)."""
    waiting = [e for e in evidence if e["state"] in ("collective", "checkpoint")]
    away = [e for e in evidence if e["state"] not in ("collective", "checkpoint")]
    if away and waiting:
        kinds = {e["state"] for e in away}
        if kinds == {"unresponsive"}:
            return [
                e["rank"] for e in away
            ], "some rank stopped responding while the others waited for it"
        return [
            e["rank"] for e in away
        ], f"some rank never reached the collective the others wait in ({_stuck(away)})"
    if away:
        return [
            e["rank"] for e in away
        ], f"no rank entered a collective or moved for the whole deadline ({_stuck(away)})"
    groups: dict[tuple, list[int]] = {}
    for e in waiting:
        groups.setdefault(
            (e["state"], e.get("call"), e.get("op"), e.get("site"), e.get("checkpoint")), []
        ).append(e["rank"])
    if len(groups) > 1:
        smallest = min(groups.values(), key=len)
        if sum(len(g) == len(smallest) for g in groups.values()) == 1:
            return (
                smallest,
                "ranks wait in different places: a collective was issued on some ranks only",
            )
        return [], "ranks wait in different places: a collective was issued on some ranks only"
    return [], "every rank waits in the same place"


def _stuck(away: list[dict]) -> str:
    """Where the ranks that hold the others up are stuck, in words."""
    if all(e["state"] == "subprocess" for e in away):
        return "waiting on a subprocess"
    return "stuck in compute"


def describe(e: dict) -> str:
    """One rank's evidence in words."""
    r, s = e["rank"], e["seconds"]
    if e["state"] == "unresponsive":
        where = f", last seen at {e['at']}" if e.get("at") else ""
        return f"rank {r} sent no heartbeat for {s:g} s (process {e['process']}){where}"
    if e["state"] == "compute":
        return f"rank {r} was computing at {e['at']} (there for {s:g} s, in no collective)"
    if e["state"] == "subprocess" and e.get("lock"):
        return (
            f"rank {r} waited {s:g} s at {e['at']} on torch's build lock {e['lock']}: another "
            "process's compile holds it, or a compile that was killed left it behind (if no "
            "compile is running, delete the file)"
        )
    if e["state"] == "subprocess":
        return (
            f"rank {r} waited {s:g} s at {e['at']} on a child process (a compile that did not "
            "finish?)"
        )
    if e["state"] == "checkpoint":
        return f"rank {r} waited {s:g} s at the checker's checkpoint after {e['checkpoint']}"
    # counted by ledger.count_user_collectives
    if e.get("op") and e.get("site") == "torch.distributed":
        return (
            f"rank {r} waited {s:g} s in {e['phase']} torch.distributed.{e['op']} called at "
            f"{e['at']} (a collective of the code under test, not through tpcheck's TPGroup)"
        )
    if e.get("op"):
        return f"rank {r} waited {s:g} s in {e['phase']} {e['op']} at {e['site']!r} ({e['at']})"
    return (
        f"rank {r} waited {s:g} s in torch.distributed.{e['call']} called at {e['at']} "
        "(a collective of the code under test, not through tpcheck's TPGroup)"
    )


def hang_details(payloads: list) -> dict:
    """Per rank, where it was (the launcher's heartbeat evidence when there is some, else what the
    rank said itself); the culprits among them; where the ranks' ledgers of
    collectives first differ."""
    ranks = [_evidence(p) for p in payloads if p.status != "ok"]
    culprit, cause = culprits([e for e in ranks if e["state"] != "unknown"])
    stuck = [
        {"rank": e["rank"], **{k: e[k] for k in ("op", "site", "phase") if k in e}}
        for e in ranks
        if e["state"] == "collective"
    ]
    waiting = [
        {"rank": e["rank"], "checkpoint": e.get("checkpoint"), "message": e.get("message", "")}
        for e in ranks
        if e["state"] == "checkpoint"
    ]
    ledgers = {p.rank: lines for p in payloads if (lines := p.ledger_lines()) is not None}
    diff = ledger_diff(ledgers) if ledgers else None
    if diff and len(ledgers) < len(payloads):
        diff += f" (no ledger from rank(s) {sorted(set(range(len(payloads))) - set(ledgers))})"
    return {
        "ranks": ranks,
        "culprits": culprit,
        "cause": cause,
        "stuck_in_collective": stuck,
        "waiting_at_checkpoint": waiting,
        "ledger_diff": diff,
    }


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
    # a rank's own report, without the launcher's evidence (torchrun)
    if e["state"] == "collective":
        return (
            f"rank {e['rank']} stuck in {e['phase']} {e['op']} at {e['site']!r} until the timeout"
            if e.get("op")
            else f"rank {e['rank']} stuck in a collective until the timeout"
        )
    if e["state"] == "checkpoint":
        return (
            f"rank {e['rank']} waiting at the checker's checkpoint after "
            f"{e.get('checkpoint') or 'a checkpoint'}"
        )
    return e.get("message") or f"rank {e['rank']}: no evidence"


def hang_summary(h: dict) -> str:
    mismatch = [
        w["message"]
        for w in h["waiting_at_checkpoint"]
        if w["message"].startswith("collective mismatch")
    ]
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
