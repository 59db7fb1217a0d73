"""Helpers for the robustness tests (importable: pytest puts this folder on sys.path)."""

from __future__ import annotations

import os


def child_pids() -> list[int]:
    """Processes whose parent is this one (zombies
    included: a child not reaped is left behind too)."""
    me, out = str(os.getpid()), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[1] == me:
            out.append(int(d))
    return sorted(out)


def derive(fn):
    """Mark fn(case, cfg) as computing a case field from the correct case."""
    fn.derive = True
    return fn


def skip_on_ranks(op: str, site: str, phase: str, ranks) -> callable:
    """An Injection.intercept that skips one collective on some ranks (a rank-dependent branch)."""

    def interceptor(group):
        def intercept(op_, site_, phase_, x, perform):
            if (op_, site_, phase_) == (op, site, phase) and group.rank in ranks:
                return x
            return perform(x)

        return intercept

    return interceptor
