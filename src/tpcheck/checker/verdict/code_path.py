"""Code the float64 run never ran: the lines of the code under test that called a torch operation
in the working dtype's first forward and in none of the float64 run's (a branch on `x.dtype`, a
kernel chosen by dtype, a fast path taken in 16 bits only).

The float64 run checks a case structurally, at float64's resolution (float64_run.py); its pass
says nothing of code it never ran, and a bug on a 16-bit-only path is no tolerance question. Each
run's rank 0 notes, per side, the lines of the code under test that called a torch operation in
step 1's first forward (checker/rank/shard_ops.py `OpSizes.sites`, the same forward on both runs,
same inputs). The lines that ran in the working dtype only are that code: the case's notes name
the first of each side (in call order), and a failure of the working run alone is then not called
precision-specific. Lines are compared, not modules: a data-dependent choice (an expert that
received no token in one run) runs the same lines in another module.
"""

from __future__ import annotations

from tpcheck.checker.rank.shard_ops import MAX_SITES
from tpcheck.checker.sourcelines import short_path

NOTE = "the float64 run does not run all the code the "  # how the note starts
SIDES = {"dense": "dense model", "tp": "TP model"}


def only_working(working: dict | None, f64: dict | None) -> list[dict]:
    """Per side, the lines the working run's forward ran and the float64 run's did not: {side,
    file, line, op, module, count} for the first (in call order), `count` of them in all. A side
    not noted by either run, or noted to the cap (`MAX_SITES`: its record may be cut short), is
    not compared."""
    out = []
    for side in SIDES:
        mine, theirs = (working or {}).get(side), (f64 or {}).get(side)
        if not mine or not theirs or max(len(mine), len(theirs)) >= MAX_SITES:
            continue
        ran = {(path, line, op) for path, line, op, _ in theirs}
        away = [r for r in mine if (r[0], r[1], r[2]) not in ran]
        if away:
            path, line, op, module = away[0]
            out.append(
                {
                    "side": side,
                    "file": path,
                    "line": line,
                    "op": op,
                    "module": module,
                    "count": len(away),
                }
            )
    return out


def note(dtype: str, away: list[dict]) -> str:
    """The case's note on the lines only the working run ran (`only_working`, not empty)."""
    parts = []
    for a in away:
        where = f", in `{a['module']}`" if a["module"] else ""
        more = f", and {a['count'] - 1} more line(s)" if a["count"] > 1 else ""
        parts.append(
            f"the {SIDES[a['side']]}'s {short_path(a['file'])}:{a['line']} ({a['op']}{where}{more})"
        )
    return (
        f"{NOTE}{dtype} run runs: {'; '.join(parts)} ran in {dtype} and not in float64 (a "
        "branch on the dtype, or a kernel chosen by it): the float64 run's verdict says nothing "
        "of that code, which only the working run checks"
    )
