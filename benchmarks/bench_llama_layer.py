"""(e) Memory and time of a check of one Llama-3-8B-shaped layer on this machine.

Preset "llama3-8b-layer": hidden 4096, FFN 14336, 32 heads, 8 KV heads, seq 256, batch 1; block
"layer" (attention + MLP) when `tpcheck.blocks.BLOCKS` has it, else "mlp" (said in the output).
Steps 1, SGD, world sizes 2 and 4, float32 and bfloat16. Each configuration runs alone in a
subprocess under a watchdog (benchmarks/_common.watched_run) that polls the process tree's /proc
every 0.1 s and kills it if the summed VmRSS passes --limit-gib (default 21), recording "exceeded"
instead of taking the machine down. Memory: per process the kernel's VmHWM (exact peak); total the
peak summed VmRSS (an upper bound: forked ranks share the parent's pages) and the peak summed Pss
(shared pages split).
Heavy: run it last, alone (`uptime` load is recorded); every process has OMP_NUM_THREADS=1."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, child_env, parser, table, verdict, watched_run, write  # noqa: E402

TARGET_GIB = 20.0


def inner(block: str, world: int, dtype: str) -> None:
    import tpcheck

    spec = tpcheck.CaseSpec(
        block=block,
        preset="llama3-8b-layer",
        world_size=world,
        run=tpcheck.RunSettings(dtype=dtype, steps=1, optimizer="sgd"),
    )
    t0 = time.perf_counter()
    (r,) = tpcheck.check([spec], timeout_s=900)
    print(
        json.dumps(
            {
                "seconds": r["seconds"],
                "check_wall_s": time.perf_counter() - t0,
                "verdict": r["verdict"],
                "as_expected": r["as_expected"],
                "summary": r.get("summary", "")[:300],
            }
        )
    )


def main() -> None:
    p = parser(__doc__)
    p.add_argument(
        "--inner",
        nargs=3,
        metavar=("BLOCK", "WORLD", "DTYPE"),
        help=__import__("argparse").SUPPRESS,
    )
    p.add_argument(
        "--limit-gib", type=float, default=21.0, help="watchdog: kill above this summed RSS"
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    args = p.parse_args()
    if args.inner:
        return inner(args.inner[0], int(args.inner[1]), args.inner[2])
    from tpcheck.blocks import BLOCKS

    block = "layer" if "layer" in BLOCKS else "mlp"
    if block != "layer":
        print(
            "block 'layer' is not in BLOCKS: measuring block 'mlp' with the llama3-8b-layer preset"
        )
    configs = (
        [(2, "float32")]
        if args.quick
        else [(2, "float32"), (2, "bfloat16"), (4, "float32"), (4, "bfloat16")]
    )
    rows, runs = [], []
    for world, dtype in configs:
        load = os.getloadavg()[0]
        print(f"running {block} tp{world} {dtype} (load {load:.1f}) ...", flush=True)
        res = watched_run(
            [PY, __file__, "--inner", block, str(world), dtype],
            limit_gib=args.limit_gib,
            timeout=args.timeout,
            env=child_env(OMP_NUM_THREADS="1"),
        )
        out = (
            json.loads(res["stdout"].strip().splitlines()[-1])
            if res["returncode"] == 0 and res["stdout"].strip()
            else {}
        )
        status = (
            "exceeded"
            if res["exceeded"]
            else "timed out"
            if res["timed_out"]
            else (out.get("verdict", f"failed rc={res['returncode']}"))
        )
        ranks = res["peak_rss_per_process_gib"][:world]
        runs.append(
            {
                "world": world,
                "dtype": dtype,
                "status": status,
                "load_at_start": load,
                **out,
                **{k: v for k, v in res.items() if k != "stdout"},
            }
        )
        rows.append(
            [
                f"tp{world} {dtype}",
                status,
                out.get("seconds", ""),
                res["wall_s"],
                max(ranks, default=0.0),
                res["peak_total_rss_gib"],
                res["peak_total_pss_gib"],
            ]
        )
        if status != "equivalent":
            print(res["stderr"][-800:])
    print(
        f"block {block}, preset llama3-8b-layer, steps 1, sgd, limit "
        f"{args.limit_gib:g} GiB summed RSS"
    )
    print(
        table(
            [
                "config",
                "verdict",
                "case seconds (slowest rank)",
                "wall (s)",
                "peak RSS per rank (GiB)",
                "peak total RSS (GiB)",
                "peak total PSS (GiB)",
            ],
            rows,
        )
    )
    w2 = runs[0]
    met = w2["status"] == "equivalent" and w2["peak_total_rss_gib"] < TARGET_GIB
    target = verdict(
        "llama layer tp2 float32 completes, total peak",
        met,
        f"{w2['status']}, {w2['peak_total_rss_gib']:.1f} GiB RSS / "
        f"{w2['peak_total_pss_gib']:.1f} GiB PSS",
        f"completes, < {TARGET_GIB:g} GiB",
    )
    write(
        "llama_layer", {"block": block, "limit_gib": args.limit_gib, "runs": runs, "target": target}
    )


if __name__ == "__main__":
    main()
