"""(b) Many small cases: one invocation for the whole matrix vs one launch per case.

Matrix: blocks {mlp, attention, layer} x world sizes {1, 2} x dtypes {float32, bfloat16} x seeds {1..4}
= 48 cases on the "tiny" preset (3 AdamW steps, the CLI's defaults), run by ONE subprocess calling
`tpcheck.check(specs)` (one pool of forked ranks per world size serves every case). Per-case side: a
fresh `python -m tpcheck run --block B --preset tiny --world-size W --dtype D --seed S -q` subprocess
for a sample of the same cases, extrapolated per case. Both sides include interpreter start-up."""
from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, child_env, median, parser, table, timed_run, verdict, write  # noqa: E402

BLOCKS, WORLDS, DTYPES, SEEDS = ("mlp", "attention", "layer"), (1, 2), ("float32", "bfloat16"), (1, 2, 3, 4)
TARGET = 10.0


def matrix() -> list[dict]:
    return [{"block": b, "world_size": w, "dtype": d, "seed": s}
            for b, w, d, s in itertools.product(BLOCKS, WORLDS, DTYPES, SEEDS)]


def inner() -> None:
    """Runs in the child: the whole matrix in one `tpcheck.check` call; prints a JSON summary."""
    import tpcheck

    specs = [tpcheck.CaseSpec(preset="tiny", **m) for m in matrix()]
    t0 = time.perf_counter()
    results = tpcheck.check(specs)
    print(json.dumps({"check_s": time.perf_counter() - t0, "case_seconds": [r["seconds"] for r in results],
                      "verdicts": [r["verdict"] for r in results], "as_expected": [r["as_expected"] for r in results],
                      "unexpected": [{"case": r["name"], "verdict": r["verdict"], "summary": str(r.get("summary"))[:400],
                                      "problems": str(r.get("problems"))[:400]}
                                     for r in results if not r["as_expected"]]}))


def one_invocation(env: dict) -> dict:
    import subprocess

    t0 = time.perf_counter()
    proc = subprocess.run([PY, __file__, "--inner"], env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"matrix run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {"wall_s": wall, **json.loads(proc.stdout.strip().splitlines()[-1])}


def per_case(env: dict, case: dict) -> float:
    wall, rc = timed_run([PY, "-m", "tpcheck", "run", "--block", case["block"], "--preset", "tiny", "--world-size",
                          str(case["world_size"]), "--dtype", case["dtype"], "--seed", str(case["seed"]), "-q"], env=env)
    return wall


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--inner", action="store_true", help=argparse_suppress())
    args = p.parse_args()
    if args.inner:
        return inner()
    env, cases = child_env(OMP_NUM_THREADS="1"), matrix()
    sample = cases[:: len(cases) // (3 if args.quick else 5)][: 3 if args.quick else 5]
    repeats = 1 if args.quick else 2
    batch_runs, single = [], []
    for _ in range(repeats):  # alternate: the whole matrix, then the sampled single launches
        batch_runs.append(one_invocation(env))
        single += [per_case(env, c) for c in sample]
    n = len(cases)
    amortized = median([r["wall_s"] for r in batch_runs]) / n
    per_launch = median(single)
    ratio = per_launch / amortized
    ok = sum(all(r["as_expected"]) for r in batch_runs) == len(batch_runs)
    print(table(["side", "cases", "wall (s)", "s per case"], [
        ["one invocation (tpcheck.check)", n, median([r["wall_s"] for r in batch_runs]), amortized],
        ["one launch per case (sample)", len(sample), sum(single) / repeats, per_launch],
        ["in-pool case seconds (median)", n, "", median(batch_runs[0]["case_seconds"])],
    ]))
    print(f"all {n} matrix cases as expected in every repeat: {ok}")
    for r in batch_runs:
        for u in r.get("unexpected", [])[:3]:
            print(f"  unexpected: {u}")
    target = verdict("amortized per case, one invocation vs one launch each", ratio >= TARGET,
                     f"{ratio:.1f}x cheaper", f">= {TARGET:g}x")
    write("matrix", {"cases": n, "sample": sample, "repeats": repeats, "batch_runs": batch_runs,
                     "single_launch_s": single, "amortized_s_per_case": amortized, "per_launch_s": per_launch,
                     "ratio": ratio, "all_as_expected": ok, "target": target})


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
