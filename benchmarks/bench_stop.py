"""(g) How fast a stuck or interrupted run ends.

Hang: `tpcheck verify tests/robustness/case_files/runtime.py:CASE --timeout T` for a rank spinning
in forward (`spin`), a SIGSTOPped rank (`stop`) and a user's collective on one rank (`one_sided`),
against the correct case (`ok`) in the same run: the extra wall time over `ok` is how long after the
case started the hang was reported (target: T + 5 s at most).

Interrupt: `tpcheck verify runtime.py:ok x 60 --world-size 8`; once the first case is reported,
SIGINT to the process group (a terminal's Ctrl-C). Measured: signal -> every rank gone, signal ->
the command exits (target: 1 s at world 8)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, ROOT, child_env, median, parser, table, timed_run, verdict, write  # noqa: E402

RUNTIME = ROOT / "tests" / "robustness" / "case_files" / "runtime.py"
EXTRA_S, STOP_S = 5.0, 1.0


def hang_latency(case: str, timeout: float, env: dict) -> float:
    wall, _ = timed_run(
        [PY, "-m", "tpcheck", "verify", f"{RUNTIME}:{case}", "--timeout", f"{timeout:g}", "-q"],
        env=env,
    )
    return wall


def _alive(pids: list[int]) -> bool:
    return any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in pids)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def interrupt(world: int, env: dict) -> tuple[float, float]:
    """(signal -> ranks gone, signal -> exit) seconds."""
    proc = subprocess.Popen(
        [PY, "-m", "tpcheck", "verify", *[f"{RUNTIME}:ok"] * 60, "--world-size", str(world)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    for line in proc.stderr:
        if line.startswith("[1/"):
            break
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        ranks = [int(p) for p in f.read().split()]
    t0 = time.perf_counter()
    os.killpg(proc.pid, signal.SIGINT)
    gone = None
    while proc.poll() is None or gone is None:
        if gone is None and not _alive(ranks):
            gone = time.perf_counter() - t0
        time.sleep(0.005)
    exited = time.perf_counter() - t0
    proc.stderr.read()
    return gone, exited


def main() -> int:
    args = parser(__doc__).parse_args()
    repeats = 1 if args.quick else 3
    env = child_env()
    timeout = 2.0
    rows, results, targets = [], {}, []
    for case in ("spin", "stop", "one_sided"):
        extra = []
        for _ in range(repeats):
            ok = hang_latency("ok", timeout, env)
            extra.append(hang_latency(case, timeout, env) - ok)
        results[case] = {"extra_s": extra, "median": median(extra)}
        rows.append([f"hang: {case}", timeout, median(extra)])
        targets.append(
            verdict(
                f"hang_{case}",
                median(extra) <= timeout + EXTRA_S,
                f"reported {median(extra):.2f} s after the case began",
                f"<= timeout + {EXTRA_S:g} s",
            )
        )
    stops = [interrupt(8, env) for _ in range(repeats)]
    gone, exited = median([s[0] for s in stops]), median([s[1] for s in stops])
    rows.append(["Ctrl-C at world 8: ranks gone", "-", gone])
    rows.append(["Ctrl-C at world 8: command exits", "-", exited])
    targets.append(
        verdict(
            "ctrl_c_world8",
            exited <= STOP_S,
            f"exits {exited:.2f} s after SIGINT (ranks gone after {gone:.2f} s)",
            f"<= {STOP_S:g} s",
        )
    )
    print(table(["what", "timeout s", "seconds"], rows))
    write(
        "stop",
        {
            "timeout_s": timeout,
            "hang": results,
            "interrupt_world8": {"ranks_gone_s": gone, "exit_s": exited},
            "targets": targets,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
