"""Soak: the fault catalogue at world 4, three times, on an oversubscribed machine.

Load: `--busy N` processes spinning in Python (default 4 x the cores), plus whatever else runs.
Run:
`tpcheck run --block mlp attention layer lm embedding cross_entropy --preset tiny --world-size 4
--fault all --json R` three times (the correct twins are run alongside: `--fault
all` checks each block clean and with every fault that applies). Pass: no case is a hang unless its
fault's signature is one (0 false hangs), and every case gets the same verdict in the three
runs (0 flaky verdicts).

    .venv/bin/python benchmarks/soak.py            # about 10 minutes on 2 cores under load
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, child_env, parser, timed_run, verdict, write  # noqa: E402

BLOCKS = ("mlp", "attention", "layer", "lm", "embedding", "cross_entropy")


def _spin() -> None:
    while True:
        pass


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--busy", type=int, default=4 * (os.cpu_count() or 1))
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    busy = [mp.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for b in busy:
        b.start()
    runs, walls = [], []
    try:
        for i in range(args.runs):
            with tempfile.TemporaryDirectory() as d:
                report = Path(d) / "r.json"
                wall, rc = timed_run(
                    [
                        PY,
                        "-m",
                        "tpcheck",
                        "run",
                        "--block",
                        *BLOCKS,
                        "--preset",
                        "tiny",
                        "--world-size",
                        "4",
                        "--fault",
                        "all",
                        "-q",
                        "--json",
                        str(report),
                    ],
                    env=child_env(),
                    timeout=3600,
                )
                cases = json.loads(report.read_text())["cases"]
            walls.append(wall)
            runs.append({c["name"]: (c["verdict"], c["as_expected"]) for c in cases})
            print(
                f"run {i + 1}: {len(cases)} cases, exit {rc}, {wall:.0f} s under "
                f"{args.busy} busy processes",
                flush=True,
            )
    finally:
        for b in busy:
            b.kill()
    false_hangs = sorted({n for r in runs for n, (v, ok) in r.items() if v == "hang" and not ok})
    flaky = sorted(n for n in runs[0] if len({r.get(n) for r in runs}) > 1)
    missed = sorted({n for r in runs for n, (_, ok) in r.items() if not ok})
    targets = [
        verdict("false_hangs", not false_hangs, f"{len(false_hangs)} {false_hangs[:5]}", "0"),
        verdict("flaky_verdicts", not flaky, f"{len(flaky)} {flaky[:5]}", "0"),
        verdict("not_as_expected", not missed, f"{len(missed)} {missed[:5]}", "0"),
    ]
    write(
        "soak",
        {
            "busy": args.busy,
            "runs": args.runs,
            "cases": len(runs[0]),
            "walls_s": walls,
            "false_hangs": false_hangs,
            "flaky": flaky,
            "not_as_expected": missed,
            "targets": targets,
        },
    )
    return 0 if all(t["met"] for t in targets) else 1


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    print(f"soak: {time.perf_counter() - t0:.0f} s")
    raise SystemExit(code)
