"""(a) The seed's four modes: one `tpcheck run --mode all`
launch vs four torchrun launches of the seed.

tpcheck side: `python -m tpcheck run --mode all --world-size 2 -q` (inspect + the three run modes,
one process that forks its two ranks once). Seed side:
`python -m torch.distributed.run --nproc_per_node=2 reference.py --mode M` for M in inspect,
equivalence, missing_forward_reduce, missing_backward_reduce. The two sides alternate within each
repeat; we report medians and the median of per-repeat ratios.
Breakdown: `python -c "import torch"` (the floor of any launch) and the cases' own `seconds`
(compute) from the JSON report."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, ROOT, child_env, median, parser, table, timed_run, verdict, write  # noqa: E402

SEED_MODES = ("inspect", "equivalence", "missing_forward_reduce", "missing_backward_reduce")
TARGET = 0.35


def seed_script() -> Path:
    d = Path(os.environ.get("TPCHECK_SEED_DIR", ROOT.parent / "shared" / "seed"))
    path = d / "reference.py"
    if not path.exists():
        sys.exit(
            f"seed not found at {path}; set TPCHECK_SEED_DIR to the folder holding reference.py"
        )
    return path


def run_seed(script: Path, env: dict) -> float:
    total = 0.0
    for mode in SEED_MODES:
        wall, rc = timed_run(
            [PY, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script), "--mode", mode],
            env=env,
            cwd=script.parent,
        )
        total += wall
    return total


def run_tpcheck(env: dict) -> tuple[float, float, int]:
    """(wall, summed case seconds, exit code)."""
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "r.json"
        wall, rc = timed_run(
            [
                PY,
                "-m",
                "tpcheck",
                "run",
                "--mode",
                "all",
                "--world-size",
                "2",
                "-q",
                "--json",
                str(report),
            ],
            env=env,
        )
        cases = json.loads(report.read_text()).get("cases", []) if report.exists() else []
    return wall, sum(c.get("seconds", 0.0) for c in cases), rc


def main() -> None:
    args = parser(__doc__).parse_args()
    repeats = 2 if args.quick else 3
    env, script = child_env(OMP_NUM_THREADS="1"), seed_script()
    rows, samples = [], []
    for i in range(repeats):
        tp_wall, compute, rc = run_tpcheck(env)
        seed_wall = run_seed(script, env)
        imp, _ = timed_run([PY, "-c", "import torch"], env=env)
        samples.append(
            {
                "tpcheck_s": tp_wall,
                "tpcheck_cases_s": compute,
                "tpcheck_rc": rc,
                "seed_4_launches_s": seed_wall,
                "import_torch_s": imp,
                "ratio": tp_wall / seed_wall,
            }
        )
        rows.append([i + 1, tp_wall, compute, seed_wall, imp, tp_wall / seed_wall])
        print(
            f"repeat {i + 1}/{repeats}: tpcheck {tp_wall:.2f} s, seed x4 {seed_wall:.2f} s",
            flush=True,
        )
    med = {k: median([s[k] for s in samples]) for k in samples[0] if k != "tpcheck_rc"}
    rows.append(
        [
            "median",
            med["tpcheck_s"],
            med["tpcheck_cases_s"],
            med["seed_4_launches_s"],
            med["import_torch_s"],
            med["ratio"],
        ]
    )
    print(
        table(
            [
                "repeat",
                "tpcheck --mode all (s)",
                "its cases (s)",
                "seed: 4 torchrun (s)",
                "import torch (s)",
                "ratio",
            ],
            rows,
        )
    )
    met = med["ratio"] <= TARGET
    target = verdict("seed modes, one launch vs four", met, f"{med['ratio']:.3f}x", f"<= {TARGET}x")
    startup = med["tpcheck_s"] - med["tpcheck_cases_s"]
    print(
        f"breakdown (median): tpcheck wall {med['tpcheck_s']:.2f} s = start-up/exit {startup:.2f} "
        f"s + cases {med['tpcheck_cases_s']:.3f} s; one `import torch` alone "
        f"{med['import_torch_s']:.2f} s; seed per launch {med['seed_4_launches_s'] / 4:.2f} s"
    )
    write(
        "seed",
        {
            "repeats": repeats,
            "samples": samples,
            "median": med,
            "target": target,
            "breakdown": {
                "tpcheck_startup_and_exit_s": startup,
                "tpcheck_cases_s": med["tpcheck_cases_s"],
                "seed_per_launch_s": med["seed_4_launches_s"] / 4,
            },
            "note": (
                "every child runs with OMP_NUM_THREADS=1; the two sides alternate in each repeat"
            ),
        },
    )


if __name__ == "__main__":
    main()
