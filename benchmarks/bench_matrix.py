"""(b) What one more case costs in a matrix run, against a launch of its own.

The matrix: `tpcheck run --block mlp attention layer lm embedding cross_entropy --preset tiny
--world-size 1 2 4 --dtype float32 bfloat16 -q` = 36 cases (3 AdamW steps of 2 micro-batches, every
check), as one CLI launch: T(36). Against it, the same command for one case
(`--block mlp --world-size 2 --dtype float32`): T(1). Launches alternate (36, 1, 36, 1, ...) so that
load hits both alike; medians. Marginal cost of a case = (T(36) - T(1)) / 35; target: at most 1/50
of T(1). Both include interpreter start-up, importing torch and forking the ranks (what a launch
costs), which the marginal cost excludes. The in-pool seconds of each case (the slowest rank's, from
the JSON report) say where a case's time goes per block and world size."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, child_env, median, parser, table, timed_run, verdict, write  # noqa: E402

MATRIX = [
    "--block",
    "mlp",
    "attention",
    "layer",
    "lm",
    "embedding",
    "cross_entropy",
    "--preset",
    "tiny",
    "--world-size",
    "1",
    "2",
    "4",
    "--dtype",
    "float32",
    "bfloat16",
]
ONE = ["--block", "mlp", "--preset", "tiny", "--world-size", "2", "--dtype", "float32"]
CASES = 36
TARGET = 50.0  # a launch costs at least this many marginal cases


def launch(env: dict, args: list[str], report: Path) -> tuple[float, dict]:
    wall, rc = timed_run(
        [PY, "-m", "tpcheck", "run", *args, "-q", "--json", str(report)], env=env, timeout=1200
    )
    if rc:
        sys.exit(f"tpcheck run {' '.join(args)} exited {rc}")
    return wall, json.loads(report.read_text())


def latency_s(group, numel: int, n: int) -> dict[str, float]:
    """One bare gloo all-reduce, and one broadcast, of `numel` float32 on this rank, each averaged
    over `n` (after 20 to warm up): the same tensor between the same ranks, so what the all-reduce
    costs beyond the broadcast is its algorithm's, not the transport's."""
    import time

    import torch
    import torch.distributed as dist

    x = torch.ones(numel)
    ops = {
        "all_reduce": lambda: dist.all_reduce(x, group=group.pg),
        "broadcast": lambda: dist.broadcast(x, 0, group=group.pg),
    }
    out = {}
    for name, op in ops.items():
        for _ in range(20):
            op()
        t0 = time.perf_counter()
        for _ in range(n):
            op()
        out[name] = (time.perf_counter() - t0) / n
    return out


def collective_floor(cases: list[dict]) -> tuple[int, float, dict, dict]:
    """The model's own collectives in the matrix (each case's ledger, rank 0) and what they cost
    alone at the bare all-reduce latency measured now on ranks forked as the pool forks them (an
    activation of the tiny preset: 8 x 2 x 32 float32), with a broadcast's latency beside it."""
    from tpcheck.checker.pool.spawn import run_on_ranks

    worlds = sorted({c["spec"]["world_size"] for c in cases} - {1})
    per_rank = {w: run_on_ranks(latency_s, w, 512, 300, timeout_s=300) for w in worlds}
    latency = {w: max(r["all_reduce"] for r in per_rank[w]) for w in worlds}
    broadcast = {w: max(r["broadcast"] for r in per_rank[w]) for w in worlds}
    count, seconds = 0, 0.0
    for c in cases:
        w = c["spec"]["world_size"]
        n = sum(
            op["count"]
            for phase in (c["ledger"] or {}).get("per_rank", {}).get("0", {}).values()
            for op in phase.values()
        )
        count += n
        seconds += n * latency.get(w, 0.0)
    return count, seconds, latency, broadcast


def main() -> None:
    args = parser(__doc__).parse_args()
    env = child_env(OMP_NUM_THREADS="1")
    repeats = 1 if args.quick else 3
    t36, t1, reports = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            wall, rep = launch(env, MATRIX, Path(tmp) / f"m{i}.json")
            t36.append(wall)
            reports.append(rep)
            t1.append(launch(env, ONE, Path(tmp) / f"o{i}.json")[0])
    cases = reports[0]["cases"]
    assert len(cases) == CASES, len(cases)
    ok = all(c["as_expected"] for r in reports for c in r["cases"])
    big, one = median(t36), median(t1)
    marginal = (big - one) / (CASES - 1)
    print(
        table(
            ["launch", "cases", "wall (s), median", "walls (s)"],
            [
                ["matrix", CASES, big, " ".join(f"{t:.1f}" for t in t36)],
                ["one case", 1, one, " ".join(f"{t:.1f}" for t in t1)],
            ],
        )
    )
    per_block: dict[str, list[float]] = {}
    for c in cases:
        per_block.setdefault(f"{c['spec']['block']} w{c['spec']['world_size']}", []).append(
            c["seconds"]
        )
    print(
        table(
            ["block, world", "in-pool seconds per case (f32, bf16)"],
            [[k, " ".join(f"{s:.3f}" for s in v)] for k, v in per_block.items()],
        )
    )
    print(
        f"marginal cost of a case: ({big:.1f} - {one:.1f}) / {CASES - 1} = {marginal:.3f} s; a "
        f"launch: {one:.2f} s; all cases as expected in every repeat: {ok}"
    )
    total = sum(sum(v) for v in per_block.values())
    lm = sum(sum(v) for k, v in per_block.items() if k.startswith("lm "))
    w4 = sum(sum(v) for k, v in per_block.items() if k.endswith(" w4"))
    print(
        f"what bounds it: each case's own passes and comparisons (in-pool seconds: {total:.1f} of "
        f"the matrix's {big - one:.1f} s beyond a launch; the lm block {lm / total:.0%} of them, "
        f"world 4 on {os.cpu_count()} CPUs {w4 / total:.0%})"
    )
    # no collective, one CPU each
    alone = [s for k, v in per_block.items() if k.endswith(" w1") for s in v]
    print(
        f"without any collective: the {len(alone)} world-1 cases (one rank, one CPU) take "
        f"{sum(alone):.1f} s in the pool, {sum(alone) / len(alone):.3f} s a case on average "
        f"(median {median(alone):.3f} s), against a marginal {one / TARGET:.3f} s: their "
        "own passes and comparisons alone"
    )
    count, floor_s, latency, broadcast = collective_floor(cases)
    print(
        f"of which the model's own collectives: {count} in the matrix, {floor_s:.1f} s alone at "
        "the bare gloo all-reduce latency measured now "
        f"({', '.join(f'{v * 1e3:.2f} ms at world {w}' for w, v in latency.items())}; a broadcast "
        f"of the same tensor: {', '.join(f'{v * 1e3:.2f} ms' for v in broadcast.values())}); the "
        f"target leaves {one / TARGET * (CASES - 1):.1f} s for {CASES - 1} cases"
    )
    target = verdict(
        "marginal case vs one launch",
        marginal * TARGET <= one,
        f"{one / marginal:.1f} cases per launch",
        f">= {TARGET:g} (marginal <= {one / TARGET:.3f} s)",
    )
    write(
        "matrix",
        {
            "t36_s": t36,
            "t1_s": t1,
            "marginal_s": marginal,
            "launch_s": one,
            "all_as_expected": ok,
            "case_seconds": {k: v for k, v in per_block.items()},
            "model_collectives": count,
            "collectives_alone_s": floor_s,
            "world1_case_s": alone,
            "allreduce_latency_s": latency,
            "broadcast_latency_s": broadcast,
            "target": target,
        },
    )


if __name__ == "__main__":
    main()
