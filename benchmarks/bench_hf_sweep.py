"""(h) The HuggingFace sweep: `tpcheck hf --all --world-size W` timed end to end (target: world 2 in
60 s on this 2-core machine), with the number of architectures checked (target: >= 150), the
seconds before the first case's result (import, discovery, the preparation of every
architecture), the size of its HTML report (target: <= 1 MB), the
seconds the ranks spent in the cases (summed over cases: the load of other processes disturbs it
less than the wall time), the CPU seconds of the whole process tree, and the
threads of a rank at the end (transformers' mesh is built once per rank: the count must not grow
with the number of architectures). `--markdown PATH` writes the sweep table (docs/hf-sweep.md).

    python benchmarks/bench_hf_sweep.py                       # world 2
    python benchmarks/bench_hf_sweep.py --world-size 2 4 --markdown docs/hf-sweep.md
    python benchmarks/bench_hf_sweep.py --profile 5     # where a rank's time goes (every 5th)

`--profile N` runs every N-th architecture under cProfile in its ranks (the engine's entry point
wrapped before the rank pools fork) and prints each rank's seconds by part of a case: building the
three models, the train step's passes (the dense and float64 ones among them), the no-grad and eval
forwards, the optimizer stage, the comparisons, and the waits in collectives and exchanges.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    PY,
    ROOT,
    _tree,
    child_env,
    median,
    parser,
    table,
    verdict,
    write,
)

TARGET_S, TARGET_CHECKED, TARGET_HTML_MB = 60.0, 150, 1.0


def _threads(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return 0


def sweep(world: int, json_path: Path, env: dict) -> dict:
    """One `tpcheck hf --all` at `world`: wall s, exit code, report, (threads of the busiest rank
    after its first cases, at the end), CPU s of the command and its ranks, the seconds to the
    first case's result, and the HTML report's bytes."""
    cpu0 = _children_cpu()
    html = json_path.with_suffix(".html")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [PY, "-m", "tpcheck", "hf", "--all", "--world-size", str(world)]
        + ["--json", str(json_path), "--html", str(html)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    first: list[float] = []
    lines: list[str] = []

    def read() -> None:  # the progress lines (one per case): when the first result came
        for line in proc.stderr:
            lines.append(line)
            if not first and line.startswith("[1/"):
                first.append(time.perf_counter() - t0)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    samples = []  # (seconds, max threads over the rank processes)
    while proc.poll() is None:
        ranks = [p for p in _tree(proc.pid) if p != proc.pid]
        if ranks:
            samples.append((time.perf_counter() - t0, max(_threads(p) for p in ranks)))
        time.sleep(1.0)
    wall = time.perf_counter() - t0
    reader.join(timeout=10)
    if not json_path.exists():
        raise SystemExit(f"tpcheck hf exited {proc.returncode} without a report: {lines[-20:]}")
    early = next((n for s, n in samples if s > 0.2 * wall), 0)
    late = max((n for s, n in samples if s > 0.8 * wall), default=0)
    return {
        "wall": wall,
        "code": proc.returncode,
        "report": json.loads(json_path.read_text()),
        "threads": (early, late),
        "cpu": _children_cpu() - cpu0,
        "first_s": first[0] if first else float("nan"),
        "html_bytes": html.stat().st_size if html.exists() else 0,
    }


PROFILE_PARTS = (
    ("build the three models, load", "build_sides", "sides.py"),
    ("train step: passes, capture", "forward_backward", "passes.py"),
    ("  of which dense + float64 passes", "_reference_passes", "passes.py"),
    ("no-grad forward", "no_grad_forward", "passes.py"),
    ("eval forward", "eval_forward", "buffers.py"),
    ("optimizer stage", "stage", "optimizer_stage.py"),
    ("comparisons", ("compare", "compare_local"), "compare.py"),
    ("waits in collectives", "wait_tensor", "_functional_collectives.py"),
    ("waits in exchanges (store)", "exchange", "sync.py"),
)


def inner_profile(every: int, out: Path) -> None:
    """`tpcheck hf` of every `every`-th architecture, each rank's cases under cProfile (the
    engine's entry point wrapped here, before the pools fork: the ranks inherit it)."""
    import cProfile
    import os

    from tpcheck import hf
    from tpcheck.checker.pool import worker
    from tpcheck.cli import main as cli

    engine_entry = worker.run_case_on_rank
    profiles: dict = {}

    def profiled(case, group, *a, **k):
        prof = profiles.setdefault(os.getpid(), cProfile.Profile())
        prof.enable()
        try:
            return engine_entry(case, group, *a, **k)
        finally:
            prof.disable()
            prof.dump_stats(out / f"rank{group.rank}_{os.getpid()}.pstats")

    worker.run_case_on_rank = profiled
    names = hf.select([], True)[::every]
    cli(["hf", *names, "-q"])


def profile(every: int) -> None:
    import glob
    import pstats

    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [PY, __file__, "--inner-profile", str(every), "--profile-dir", tmp],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if not glob.glob(f"{tmp}/rank*.pstats"):
            raise SystemExit(f"the profiled sweep left no profile: {proc.stderr[-800:]}")
        rows = []
        for rank in (0, 1):
            st = pstats.Stats(*glob.glob(f"{tmp}/rank{rank}_*.pstats"))

            def cum(names, where, st=st) -> float:
                names = (names,) if isinstance(names, str) else names
                return sum(
                    v[3] for k, v in st.stats.items() if k[2] in names and k[0].endswith(where)
                )

            total = cum("run_case_on_rank", "engine.py")
            for label, names, where in PROFILE_PARTS:
                part = cum(names, where)
                rows.append([rank, label, f"{part:.2f}", f"{100 * part / total:.0f}%"])
            rows.append([rank, "the whole of its cases", f"{total:.2f}", "100%"])
    print(table(["rank", "part of a case (cumulative)", "s", "share"], rows))


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
    p.add_argument("--repeats", type=int, default=None, help="sweeps per world (default 3)")
    p.add_argument("--profile", type=int, default=None, metavar="N")
    p.add_argument("--inner-profile", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--profile-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(
            "bench_hf_sweep: skipped: transformers is not installed (pip install "
            "'tpcheck[transformers]')"
        )
        return 0
    if args.inner_profile:
        inner_profile(args.inner_profile, args.profile_dir)
        return 0
    if args.profile:
        profile(args.profile)
        return 0
    repeats = args.repeats or (1 if args.quick else 3)
    env = child_env()
    runs: dict[int, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world_size:
            runs[world] = [
                sweep(world, Path(tmp) / f"sweep{world}_{n}.json", env) for n in range(repeats)
            ]
    rows, targets = [], []
    for world, done in runs.items():
        rows.append(_row(world, done))
        last = done[-1]
        wall = median([r["wall"] for r in done])
        early, late = last["threads"]
        targets.append(
            verdict(
                f"rank threads at world {world}",
                late <= early + 8,
                f"{early} at 20% -> {late} at the end",
                "no growth with the architectures (one mesh per rank)",
            )
        )
        if world == 2:
            checked = int(rows[-1][6])
            mb = last["html_bytes"] / 1e6
            targets += [
                verdict(
                    "hf sweep at world 2 (median)",
                    wall <= TARGET_S,
                    f"{wall:.0f} s",
                    f"<= {TARGET_S:.0f} s",
                ),
                verdict("architectures checked", checked >= TARGET_CHECKED, str(checked), ">= 150"),
                verdict("sweep HTML", mb <= TARGET_HTML_MB, f"{mb:.2f} MB", "<= 1 MB"),
            ]
    print(
        table(
            ["world", "wall s (median)", "walls s", "to first result s", "case s", "CPU s"]
            + ["checked", "equivalent", "not equivalent", "error", "skipped", "exit", "HTML MB"],
            rows,
        )
    )
    if args.markdown:
        reports = {w: (d[-1]["wall"], d[-1]["code"], d[-1]["report"]) for w, d in runs.items()}
        args.markdown.write_text(markdown(reports))
        print(f"-> {args.markdown}")
    write("hf_sweep", {"rows": rows, "targets": targets})
    return 0


def _row(world: int, done: list[dict]) -> list:
    last = done[-1]
    counts = last["report"]["sweep"]["counts"]
    checked = sum(n for v, n in counts.items() if v != "skipped")
    return [
        world,
        f"{median([r['wall'] for r in done]):.0f}",
        " ".join(f"{r['wall']:.0f}" for r in done),
        f"{median([r['first_s'] for r in done]):.1f}",
        f"{median([sum(x['seconds'] for x in r['report']['sweep']['rows']) for r in done]):.0f}",
        f"{median([r['cpu'] for r in done]):.0f}",
        checked,
        counts.get("equivalent", 0),
        counts.get("not equivalent", 0),
        counts.get("error", 0),
        counts.get("skipped", 0),
        last["code"],
        f"{last['html_bytes'] / 1e6:.2f}",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
