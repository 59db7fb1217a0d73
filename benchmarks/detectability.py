"""Detectability table: the smallest error in one rank's partial sums, and the smallest lr error on
one rank, that a default run flags, per dtype and world size (tpcheck.faults.detectability), against
the targets. Results: benchmarks/results/detectability.json; the table in docs/tolerances.md.

    .venv/bin/python benchmarks/detectability.py            # worlds 2 4 8, 2 seeds
    .venv/bin/python benchmarks/detectability.py --worlds 1 2 3 4 5 6 7 8
    .venv/bin/python benchmarks/detectability.py --outlier 1000   # one input element of 1e3
    .venv/bin/python benchmarks/detectability.py --float64-run off  # the working dtype alone
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, table, write  # noqa: E402


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--outlier",
        type=float,
        default=0.0,
        help="one input element of this size (float16: at most 100); results in "
        "detectability_outlier.json",
    )
    p.add_argument(
        "--float64-run",
        default="auto",
        choices=("auto", "on", "off"),
        help="off: the working dtype's bounds alone (auto adds the float64 run to 16-bit probes)",
    )
    args = p.parse_args()
    import tpcheck
    from tpcheck.faults.detectability import probes, target, thresholds

    run = probes(
        dtypes=args.dtypes,
        worlds=args.worlds,
        seeds=args.seeds[:1] if args.quick else args.seeds,
        outlier=args.outlier,
        float64_run=args.float64_run,
    )
    specs = [pr.spec() for pr in run]
    t0 = time.perf_counter()
    results = tpcheck.check(specs)
    seconds = time.perf_counter() - t0
    found = thresholds(run, results)
    rows, payload = [], []
    for (kind, dtype, world), th in sorted(found.items()):
        goal = target(kind, dtype, world)
        met = th is not None and th <= goal
        what = (
            "relative error of one rank's partial sum"
            if kind == "partial"
            else "lr x (1 + size) on one rank"
        )
        rows.append(
            [
                kind,
                dtype,
                world,
                "not detected" if th is None else f"{th:g}",
                f"{goal:g}",
                "met" if met else "MISSED",
            ]
        )
        payload.append(
            {
                "kind": kind,
                "what": what,
                "dtype": dtype,
                "world": world,
                "threshold": th,
                "target": goal,
                "met": met,
            }
        )
    print(table(["bug", "dtype", "world", "smallest flagged", "target", ""], rows))
    print(f"{len(specs)} runs in {seconds:.0f} s")
    name = "detectability" + ("_outlier" if args.outlier else "")
    name += "_working_dtype" if args.float64_run == "off" else ""
    meta = {"outlier": args.outlier, "float64_run": args.float64_run}
    write(name, {"seconds": seconds, **meta, "rows": payload})


if __name__ == "__main__":
    main()
