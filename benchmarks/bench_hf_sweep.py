"""(h) The HuggingFace sweep: `tpcheck hf --all --world-size W` timed end to end (target: world 2 in
90 s on this 2-core machine), with the number of architectures checked (target: >= 150), the
seconds the ranks spent in the cases (summed over cases: the load of other processes disturbs it
less than the wall time), the CPU seconds of the whole process tree, and the
threads of a rank at the end (transformers' mesh is built once per rank: the count must not grow
with the number of architectures). `--markdown PATH` writes the sweep table (docs/hf-sweep.md).

    python benchmarks/bench_hf_sweep.py                       # world 2
    python benchmarks/bench_hf_sweep.py --world-size 2 4 --markdown docs/hf-sweep.md
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, ROOT, _tree, child_env, parser, table, verdict, write  # noqa: E402

TARGET_S, TARGET_CHECKED = 90.0, 150


def _threads(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return 0


def sweep(
    world: int, json_path: Path, env: dict
) -> tuple[float, int, dict, tuple[int, int], float]:
    """(wall s, exit code, report, (threads of the busiest rank after its first cases, at the end),
    CPU s of the command and its ranks)."""
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "tpcheck",
            "hf",
            "--all",
            "--world-size",
            str(world),
            "-q",
            "--json",
            str(json_path),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    samples = []  # (seconds, max threads over the rank processes)
    while proc.poll() is None:
        ranks = [p for p in _tree(proc.pid) if p != proc.pid]
        if ranks:
            samples.append((time.perf_counter() - t0, max(_threads(p) for p in ranks)))
        time.sleep(1.0)
    stderr = proc.stderr.read()
    wall = time.perf_counter() - t0
    if not json_path.exists():
        raise SystemExit(f"tpcheck hf exited {proc.returncode} without a report: {stderr[-800:]}")
    early = next((n for s, n in samples if s > 0.2 * wall), 0)
    late = max((n for s, n in samples if s > 0.8 * wall), default=0)
    report = json.loads(json_path.read_text())
    return wall, proc.returncode, report, (early, late), _children_cpu() - cpu0


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's waited-for children and their descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def markdown(reports: dict[int, tuple[float, int, dict]]) -> str:
    first = next(iter(reports.values()))[2]
    lines = [
        f"# The HuggingFace sweep: transformers {first['sweep']['transformers']}",
        "",
        "Every architecture whose config declares a TP plan, checked with transformers' own plan "
        "(`tpcheck hf --all`), on CPU/gloo, float32, 2 AdamW steps of 2 micro-batches each, with "
        "the no-grad forward. What each column means and how a row is made: docs/hf.md. Findings "
        "(not-equivalent and error rows): docs/findings/.",
        "",
        "Regenerate: `python benchmarks/bench_hf_sweep.py --world-size "
        + " ".join(str(w) for w in reports)
        + " --markdown docs/hf-sweep.md`.",
        "",
    ]
    for world, (wall, code, report, *_) in reports.items():
        sweep_ = report["sweep"]
        lines += [
            f"## World size {world}",
            "",
            f"{sweep_['summary']}; {wall:.0f} s wall for the whole sweep (exit code {code}).",
            "",
        ]
        rows = [
            [
                r["architecture"],
                r["verdict"],
                r["first_divergence"] or "",
                r["signature"] or "",
                f"{r['seconds']:.1f}" if r["verdict"] != "skipped" else "",
                (r["reason"].splitlines()[0][:160] if r["reason"] else ""),
            ]
            for r in sweep_["rows"]
            if r["world_size"] == world
        ]
        lines += [
            table(
                ["architecture", "verdict", "first divergence", "signature", "s", "reason"], rows
            ),
            "",
        ]
    return "\n".join(lines)


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--world-size", type=int, nargs="+", default=[2])
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args()
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(
            "bench_hf_sweep: skipped: transformers is not installed (pip install "
            "'tpcheck[transformers]')"
        )
        return 0
    env = child_env()
    reports, targets = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world_size:
            reports[world] = sweep(world, Path(tmp) / f"sweep{world}.json", env)
    rows = []
    for world, (wall, code, report, (early, late), cpu) in reports.items():
        counts = report["sweep"]["counts"]
        in_ranks = sum(r["seconds"] for r in report["sweep"]["rows"])
        checked = sum(n for v, n in counts.items() if v != "skipped")
        rows.append(
            [
                world,
                f"{wall:.0f}",
                f"{in_ranks:.0f}",
                f"{cpu:.0f}",
                checked,
                counts.get("equivalent", 0),
                counts.get("not equivalent", 0),
                counts.get("error", 0),
                counts.get("skipped", 0),
                code,
                f"{early} -> {late}",
            ]
        )
        targets.append(
            verdict(
                f"rank threads at world {world}",
                late <= early + 8,
                f"{early} at 20% -> {late} at the end",
                "no growth with the architectures (one mesh per rank)",
            )
        )
        if world == 2:
            targets.append(
                verdict(
                    "hf sweep at world 2", wall <= TARGET_S, f"{wall:.0f} s", f"<= {TARGET_S:.0f} s"
                )
            )
            targets.append(
                verdict(
                    "architectures checked",
                    checked >= TARGET_CHECKED,
                    str(checked),
                    f">= {TARGET_CHECKED}",
                )
            )
    print(
        table(
            [
                "world",
                "wall s",
                "case s (summed)",
                "CPU s",
                "checked",
                "equivalent",
                "not equivalent",
                "error",
                "skipped",
                "exit",
                "rank threads",
            ],
            rows,
        )
    )
    if args.markdown:
        args.markdown.write_text(markdown(reports))
        print(f"-> {args.markdown}")
    write("hf_sweep", {"rows": rows, "targets": targets})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
