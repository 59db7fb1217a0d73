"""(k) Ranks sharing the CPUs: what the `tpcheck` command's threads per rank buy.

libgomp is not fork-safe, so a rank forked from a process that may have run OpenMP on several
threads computes on one thread. The `tpcheck` command keeps its own process to one thread and gives
each rank its share of the CPUs (checker/pool/spawn.py: `rank_threads`), and rank 0's float64
passes, while the other ranks wait for it, the group's (`threads_while_others_wait`). Measured: one
check (the MLP at (256, 4, 512, 2048), SGD, one step, one micro-batch) through `tpcheck.check` from
a process that kept to one thread (as the command does) against the same from a process that did not
(ranks on one thread), alternating, at every world size up to the CPU count, median of the case's
`seconds` (its slowest rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, child_env, median, parser, table, write  # noqa: E402

SIZE = (("seq", 256), ("batch", 4), ("hidden", 512), ("ffn", 2048))


def inner(world: int, kept: bool) -> None:
    from tpcheck.checker.pool import spawn

    if kept:
        spawn.keep_parent_to_one_thread()
    from tpcheck import CaseSpec, RunSettings, check

    spec = CaseSpec(
        block="mlp",
        preset="seed",
        overrides=SIZE,
        world_size=world,
        run=RunSettings(steps=1, optimizer="sgd", micro_batches=1),
    )
    (r,) = check([spec], timeout_s=300)
    print(
        json.dumps(
            {
                "seconds": r["seconds"],
                "verdict": r["verdict"],
                "threads": spawn.rank_threads(world),
                "float64_threads": spawn.threads_while_others_wait(world),
            }
        )
    )


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--inner", nargs=2, help=__import__("argparse").SUPPRESS)
    args = p.parse_args()
    if args.inner:
        return inner(int(args.inner[0]), args.inner[1] == "kept")
    cpus = len(os.sched_getaffinity(0))
    worlds = [w for w in (1, 2, 4, 8) if w <= cpus]
    repeats = 1 if args.quick else 3
    env = child_env()
    env.pop("OMP_NUM_THREADS", None)  # the command's own default: no cap
    runs: dict[str, list[dict]] = {}
    for _ in range(repeats):
        for world in worlds:
            for kind in ("kept", "not kept"):
                out = subprocess.run(
                    [PY, __file__, "--inner", str(world), kind],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=900,
                )
                if out.returncode:
                    sys.exit(f"{kind} world {world} failed:\n{out.stderr[-2000:]}")
                runs.setdefault(f"{world} {kind}", []).append(
                    json.loads(out.stdout.strip().splitlines()[-1])
                )
    rows = []
    for world in worlds:
        kept, single = runs[f"{world} kept"], runs[f"{world} not kept"]
        t_kept, t_single = (
            median([r["seconds"] for r in kept]),
            median([r["seconds"] for r in single]),
        )
        rows.append(
            [
                world,
                kept[0]["threads"],
                kept[0]["float64_threads"],
                t_kept,
                t_single,
                t_single / t_kept,
                sorted({r["verdict"] for r in kept + single}),
            ]
        )
    print(f"{cpus} CPUs; mlp {dict(SIZE)}, sgd, 1 step; median of {repeats}")
    print(
        table(
            [
                "world",
                "threads per rank",
                "rank 0's float64 passes",
                "check (s), CPUs shared",
                "check (s), 1 thread per rank",
                "speed-up",
                "verdicts",
            ],
            rows,
        )
    )
    write(
        "threads",
        {"cpus": cpus, "size": dict(SIZE), "repeats": repeats, "runs": runs, "rows": rows},
    )


if __name__ == "__main__":
    main()
