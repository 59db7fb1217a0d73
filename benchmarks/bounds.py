"""How tight the calibrated bounds are on correct code: random correct cases over every block,
dtype, world size 1-8, SP on/off, 1-3 micro-batches, 1-3 steps, SGD and AdamW
(`tpcheck.blocks.sampling`).

For every calibrated check it records error / bound and the factor the check needed,
(error - floor) / ref_error (bound = factor * ref_error + floor, checker/rank/tolerance.py), and the
bound relative to the magnitude of the elements it judges (the tensor's scale, or the ceiling of
the magnitude bin judged: what a planted error must exceed). Prints, per dtype and world size, the
largest of each and the 10 largest needed factors. Results: benchmarks/results/bounds.json
(bounds_outliers.json with --outliers: the hidden-state blocks, one input element of 1e2-3e3).

    .venv/bin/python benchmarks/bounds.py --n 2000 --seed 11
    .venv/bin/python benchmarks/bounds.py --n 500 --seed 11 --outliers
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, table, write  # noqa: E402


def sweep(n: int, seed: int, outliers: bool = False) -> dict:
    import tpcheck
    from tpcheck.blocks.sampling import random_specs

    specs = random_specs(seed, n, outliers=outliers)
    t0 = time.perf_counter()
    results = tpcheck.check(specs)
    seconds = time.perf_counter() - t0
    cells: dict = defaultdict(
        lambda: {
            "cases": 0,
            "max_error_over_bound": 0.0,
            "max_needed_factor": 0.0,
            "max_relative_bound": 0.0,
            "worst": "",
        }
    )
    bad, tail = [], []
    for spec, r in zip(specs, results):
        if r["verdict"] != "equivalent":
            bad.append({"case": r["name"], "spec": r["spec"], "summary": r["summary"]})
            continue
        cell = cells[(spec.settings.dtype, spec.world_size)]
        cell["cases"] += 1
        for c in r["checks"]:
            if c["kind"] != "calibrated" or not c["bound"]:
                continue
            ratio = c["error"] / c["bound"]
            where = f"{r['name']} {c['stage']} {c['name']} step {c['step']}"
            if ratio > cell["max_error_over_bound"]:
                cell["max_error_over_bound"], cell["worst"] = ratio, where
            if c["ref_error"]:
                need = (c["error"] - c["floor"]) / c["ref_error"]
                cell["max_needed_factor"] = max(cell["max_needed_factor"], need)
                tail.append((need, c["numel"], where))
            # the bound relative to the magnitude of the elements it judges (the whole tensor's
            # scale, or the ceiling of the bin judged by magnitude): what a planted error exceeds
            judged = c.get("magnitude") or c.get("scale")
            if judged:
                cell["max_relative_bound"] = max(cell["max_relative_bound"], c["bound"] / judged)
    tail.sort(reverse=True)
    return {
        "n": n,
        "seed": seed,
        "seconds": seconds,
        "not_equivalent": bad,
        "largest_needed": tail[:10],
        "by_dtype_world": {f"{d}/tp{w}": v for (d, w), v in sorted(cells.items())},
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--outliers",
        action="store_true",
        help="the hidden-state blocks with one input element of 1e2-3e3 (ModelConfig.outlier)",
    )
    args = p.parse_args()
    from tpcheck.checker.rank.tolerance import MAX_FACTOR

    out = sweep(60 if args.quick else args.n, args.seed, args.outliers)
    rows = [
        [
            k,
            v["cases"],
            v["max_needed_factor"],
            v["max_error_over_bound"],
            v["max_relative_bound"],
            v["worst"],
        ]
        for k, v in out["by_dtype_world"].items()
    ]
    print(
        table(
            [
                "dtype/world",
                "cases",
                "needed factor",
                "error/bound",
                "bound/scale",
                "largest error/bound at",
            ],
            rows,
        )
    )
    print(
        f"factor {MAX_FACTOR:g}; {out['n']} cases in {out['seconds']:.0f} s; "
        f"not equivalent or error: {len(out['not_equivalent'])}"
    )
    for need, numel, where in out["largest_needed"]:
        print(f"   needed {need:.2f} over {numel} elements: {where}")
    for b in out["not_equivalent"][:10]:
        print("  ", b["case"], b["summary"][:300])
    write("bounds_outliers" if args.outliers else "bounds", out)


if __name__ == "__main__":
    main()
