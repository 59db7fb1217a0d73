"""(d) What a full check costs over the bare dense step, and what capture costs (issue 5).

Check:
`tpcheck.check([CaseSpec(block="mlp", overrides=<size>, world_size=2, run=RunSettings(steps=1,
optimizer="sgd",
micro_batches=1))])` (the dense model and the TP shard on every rank, the float64 truth on rank 0;
compare everything, capture activations for the diagnosis). Its `seconds` field is the slower rank's
time for the whole case (build, load, step, compare).
Floor: one dense forward + backward + SGD step of `DenseMLP` at the same size, timed in one process
on one thread (OMP_NUM_THREADS=1). The check runs as the `tpcheck` command runs it, on one CPU per
rank (its process kept to one thread, its affinity `world` CPUs): each rank computes on one thread,
and rank 0's float64 passes on all `world` while the other ranks wait for it
(checker/pool/spawn.py).

Beside it, the same check with OMP_NUM_THREADS=1 (rank 0's float64 passes on one thread too): what
those threads buy. Capture overhead: the same check with `capture=False` vs `capture=True`, each in
its own subprocess (alternating), timed by the case `seconds` and measured for memory by polling
/proc of the process tree (benchmarks/_common.watched_run): per-process peak = the kernel's VmHWM
(exact), total = peak of the summed Pss (pages the forked ranks share with their parent split,
not double counted).

What bounds it, for any arrangement of the work: the reference passes alone (dense, float64 truth)
and the TP halves, with nothing else of a check (no build of three models, no load, capture,
comparison or exchange), timed on the same two CPUs in three arrangements (`inner_arrange`): as the
check runs them today (a dense pass on each rank, then rank 0's float64 on every CPU while the
others wait), and the two arrangements that run the dense pass once, beside the truth (rank 1 the
dense pass, rank 0 the float64 one, on every CPU or on its own one). The best of them plus what the
rest of today's check costs over today's arrangement is what a redesign that ran the dense pass once
and kept the rest would reach."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import PY, child_env, median, parser, table, verdict, watched_run, write  # noqa: E402

FULL, QUICK = (512, 4, 1024, 4096), (128, 2, 512, 2048)
TARGET = 2.5


def overrides(size) -> tuple:
    return tuple(zip(("seq", "batch", "hidden", "ffn"), size))


def inner_check(size, capture: bool, device: str = "cpu", world: int = 2) -> None:
    import os

    from tpcheck.checker.pool import spawn

    spawn.keep_parent_to_one_thread()  # as the `tpcheck` command does, before any torch op
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:world])  # one CPU per rank
    import tpcheck

    spec = tpcheck.CaseSpec(
        block="mlp",
        preset="seed",
        overrides=overrides(size),
        world_size=world,
        run=tpcheck.RunSettings(steps=1, optimizer="sgd", micro_batches=1, capture=capture),
        device=device,
    )
    t0 = time.perf_counter()
    (r,) = tpcheck.check([spec], timeout_s=300)
    print(
        json.dumps(
            {
                "seconds": r["seconds"],
                "wall_s": time.perf_counter() - t0,
                "verdict": r["verdict"],
                "checks": len(r["checks"]),
            }
        )
    )


def dense_step_times(size, steps: int, device: str = "cpu") -> list[float]:
    """Seconds of each of `steps` dense forward + backward + SGD steps of `DenseMLP` at `size` on
    this process's threads, after one to warm up: the floor every ratio here is taken against."""
    import torch

    from tpcheck.models.config import preset
    from tpcheck.models.dense import DenseMLP

    cfg = preset("seed").replace(**dict(overrides(size)))
    g = torch.Generator().manual_seed(0)
    model = DenseMLP(cfg)
    model.reset_parameters(g)
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, target = (
        torch.randn(cfg.seq, cfg.batch, cfg.hidden, generator=g).to(device) for _ in range(2)
    )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        torch.nn.functional.mse_loss(model(x.requires_grad_(True)), target).backward()
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
    return times[1:]


def inner_dense(size, steps: int, device: str = "cpu") -> None:
    times = dense_step_times(size, steps, device)
    print(json.dumps({"step_s": median(times), "steps": times}))


ARRANGEMENTS = {
    "today": "a dense pass on each rank, then rank 0's float64 on all CPUs while the others wait",
    "dense once, float64 on all CPUs": "rank 1's dense pass beside rank 0's float64 on all CPUs",
    "dense once, one thread each": "rank 1's dense pass beside rank 0's float64 on its own CPU",
}


def _passes_on_rank(group, size, arrangement: str) -> dict:
    """One rank's share of `arrangement` (ARRANGEMENTS) at `size`, then its TP half's forward and
    backward; the seconds from a barrier to a barrier after the TP half (building the
    models is not counted)."""
    import torch
    import torch.distributed as dist

    from tpcheck.checker.pool import spawn
    from tpcheck.models.config import preset
    from tpcheck.models.dense import DenseMLP
    from tpcheck.models.parallel import ParallelMLP

    cfg = preset("seed").replace(**dict(overrides(size)))
    g = torch.Generator().manual_seed(group.rank)
    dense, truth, tp = DenseMLP(cfg), DenseMLP(cfg, torch.float64), ParallelMLP(cfg, group)
    dense.reset_parameters(g)
    with torch.no_grad():
        for p, q in zip(truth.parameters(), dense.parameters()):
            p.copy_(q)
        for p in tp.parameters():
            p.normal_(0.0, 0.02, generator=g)
    batch = [torch.randn(cfg.seq, cfg.batch, cfg.hidden, generator=g) for _ in range(2)]
    mine, every = torch.get_num_threads(), spawn.THREADS_WHILE_OTHERS_WAIT

    def step(model, dtype, threads):
        torch.set_num_threads(threads)
        x, target = (t.to(dtype) for t in batch)
        torch.nn.functional.mse_loss(model(x.requires_grad_(True)), target).backward()
        torch.set_num_threads(mine)

    dist.barrier(group=group.pg)
    t0 = time.perf_counter()
    first = group.rank == 0
    if arrangement == "today":
        step(dense, torch.float32, mine)
        if first:
            step(truth, torch.float64, every)
    elif first:
        step(truth, torch.float64, every if "all CPUs" in arrangement else mine)
    elif group.rank == 1:
        step(dense, torch.float32, mine)
    references = time.perf_counter() - t0
    step(tp, torch.float32, mine)
    dist.barrier(group=group.pg)
    return {"references_s": references, "passes_s": time.perf_counter() - t0}


def inner_arrange(size, world: int) -> None:
    """The passes of a check in each arrangement (ARRANGEMENTS), alternating, 2 repeats, beside the
    one-thread dense step (`dense_step_times`) measured in the same process: their ratios to it."""
    import os

    from tpcheck.checker.pool import spawn

    spawn.keep_parent_to_one_thread()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:world])
    floors, runs = [], {a: [] for a in ARRANGEMENTS}
    for _ in range(2):
        floors += dense_step_times(size, 1)
        for a in ARRANGEMENTS:
            ranks = spawn.run_on_ranks(_passes_on_rank, world, size, a, timeout_s=600)
            runs[a].append(max(r["passes_s"] for r in ranks))
    floor = median(floors)
    print(
        json.dumps(
            {
                "dense_step_s": floor,
                "passes_s": runs,
                "ratio": {a: median(v) / floor for a, v in runs.items()},
            }
        )
    )


# Where one rank's time goes, each part timed exclusive of the others (a part called inside another
# is counted in its own, not twice): (part, what it is).
PARTS = (
    ("build", "build, copy and load the three models (sides.build_sides)"),
    ("dense pass", "the dense model's forward, loss and backward"),
    ("float64 truth", "the float64 model's forward, loss and backward"),
    ("TP pass", "the TP model's forward, loss and backward (and the rest of a micro-batch)"),
    ("capture", "copies of the captured module outputs and gradients"),
    ("bounds", "the calibrated bounds (tolerance.calibrated, dense_error, bin_errors)"),
    ("compare", "the comparisons, their evidence and the self-test's controls"),
    ("eval forward", "the last step's forward in eval mode, every side, compared"),
    ("optimizer stage", "the optimizer steps of every side and their checks"),
    ("rest", "everything else (grads and weights compared, exchanges, the payload)"),
)


class Breakdown:
    """Exclusive seconds per part: each wrapped call's time less the wrapped calls inside it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.stack: list[list] = []

    def wrap(self, owner, attr: str, part) -> None:
        fn = getattr(owner, attr)

        def timed(*a, **k):
            name = part(*a, **k) if callable(part) else part
            self.stack.append([name, 0.0])
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                elapsed = time.perf_counter() - t0
                name, inner = self.stack.pop()
                self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - inner
                if self.stack:
                    self.stack[-1][1] += elapsed

        setattr(owner, attr, timed)


def instrument() -> Breakdown:
    """Wrap the checker's parts (PARTS) where the engine calls them."""
    import torch

    from tpcheck.checker.rank import capture, compare, engine, optimizer_stage, passes, tolerance

    b = Breakdown()
    b.wrap(engine, "build_sides", "build")
    b.wrap(
        passes,
        "_reference_pass",
        lambda s, model, dtype, *a, **k: (
            "float64 truth" if dtype == torch.float64 else "dense pass"
        ),
    )
    b.wrap(passes, "forward_backward", "TP pass")
    for cls in (capture.Recorder, capture.Calibrating):
        b.wrap(cls, "__call__", "capture")
    b.wrap(tolerance, "calibrated", "bounds")
    b.wrap(tolerance, "bin_errors", "bounds")
    b.wrap(compare.Comparator, "calibrated", "bounds")
    for method in ("compare", "compare_local"):
        b.wrap(compare.Comparator, method, "compare")
    b.wrap(engine, "eval_forward", "eval forward")
    b.wrap(optimizer_stage, "stage", "optimizer stage")
    return b


def inner_profile(size) -> None:
    """One rank's case at world size 1 (no collectives; the TP model is then full size, so its
    share is ~2x the world-2 one), on one thread, broken down (PARTS), beside the dense step timed
    in the same process: where the check's time goes, in dense steps."""
    import torch

    import tpcheck
    from tpcheck.checker.rank.engine import run_case_on_rank
    from tpcheck.checker.rank.ledger import CollectiveTap
    from tpcheck.checker.sync import Rendezvous
    from tpcheck.parallel.group import TPGroup
    from tpcheck.resolve import RESOLVER

    torch.set_num_threads(1)
    spec = tpcheck.CaseSpec(
        block="mlp",
        preset="seed",
        overrides=overrides(size),
        world_size=1,
        run=tpcheck.RunSettings(steps=1, optimizer="sgd", micro_batches=1),
    )

    def once():
        group = TPGroup(rank=0, world_size=1, tap=CollectiveTap(0))
        return run_case_on_rank(RESOLVER.build(spec), group, Rendezvous(None, 0, 1, 60.0))

    once()  # warm-up
    floor = median(dense_step_times(size, 2))
    b = instrument()
    t0 = time.perf_counter()
    once()
    total = time.perf_counter() - t0
    parts = dict(b.seconds)
    parts["rest"] = total - sum(parts.values())
    print(json.dumps({"seconds": total, "dense_step_s": floor, "parts_s": parts}))


def child(*args: str, limit_gib: float = 21.0) -> dict:
    env = child_env(OMP_NUM_THREADS="1")
    # the check on one CPU per rank, as inner_check sets it; "onethread" the
    if args[1] in ("capture", "nocapture", "arrange"):
        # same with OMP_NUM_THREADS=1: rank 0's float64 passes on one thread too
        del env["OMP_NUM_THREADS"]
    res = watched_run([PY, __file__, *args], limit_gib=limit_gib, timeout=600, env=env)
    if res["returncode"] != 0 or res["exceeded"]:
        sys.exit(
            f"child {args} failed: rc {res['returncode']}, exceeded {res['exceeded']}\n"
            f"{res['stderr']}"
        )
    res.update(json.loads(res.pop("stdout").strip().splitlines()[-1]))
    return res


def main() -> None:
    p = parser(__doc__)
    p.add_argument(
        "--inner",
        choices=("capture", "nocapture", "onethread", "dense", "profile", "arrange"),
        help=__import__("argparse").SUPPRESS,
    )
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank, NCCL"
    )
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args()
    size = QUICK if args.quick else FULL
    if args.inner == "dense":
        return inner_dense(size, 3 if args.quick else 5, args.device)
    if args.inner == "profile":
        return inner_profile(size)
    if args.inner == "arrange":
        return inner_arrange(size, args.world_size)
    if args.inner:
        return inner_check(size, args.inner != "nocapture", args.device, args.world_size)
    q = ["--quick"] if args.quick else []
    q += ["--device", args.device, "--world-size", str(args.world_size)]
    repeats = 1 if args.quick else 3
    runs = {"capture": [], "nocapture": [], "onethread": [], "dense": []}
    for _ in range(repeats):
        for kind in ("capture", "nocapture", "onethread", "dense"):
            runs[kind].append(child("--inner", kind, *q))
    check_s, nocap_s = (
        median([r["seconds"] for r in runs["capture"]]),
        median([r["seconds"] for r in runs["nocapture"]]),
    )
    floor_s, one_s = (
        median([r["step_s"] for r in runs["dense"]]),
        median([r["seconds"] for r in runs["onethread"]]),
    )
    mem = {k: median([r["peak_total_pss_gib"] for r in runs[k]]) for k in runs}
    rank_peak = {k: median([r["peak_rss_per_process_gib"][0] for r in runs[k]]) for k in runs}
    ratio = check_s / floor_s
    print(
        f"size (seq, batch, hidden, ffn) = {size}, world {args.world_size} on {args.device}, steps "
        f"1, sgd, the dense step on 1 thread, the check on 1 CPU per rank, median of {repeats}"
    )
    print(
        table(
            [
                "run",
                "seconds (s)",
                "vs dense step",
                "peak RSS, largest process (GiB)",
                "peak total PSS (GiB)",
            ],
            [
                [
                    "dense fwd+bwd+SGD step (1 process)",
                    floor_s,
                    1.0,
                    rank_peak["dense"],
                    mem["dense"],
                ],
                ["check, capture=True", check_s, ratio, rank_peak["capture"], mem["capture"]],
                [
                    "check, capture=False",
                    nocap_s,
                    nocap_s / floor_s,
                    rank_peak["nocapture"],
                    mem["nocapture"],
                ],
                [
                    "check, float64 passes on 1 thread",
                    one_s,
                    one_s / floor_s,
                    rank_peak["onethread"],
                    mem["onethread"],
                ],
            ],
        )
    )
    verdicts = [r["verdict"] for k in ("capture", "nocapture", "onethread") for r in runs[k]]
    targets = [
        verdict(
            "full check vs bare dense step", ratio <= TARGET, f"{ratio:.2f}x", f"<= {TARGET:g}x"
        )
    ]
    cap_t, cap_m = check_s / nocap_s, rank_peak["capture"] / rank_peak["nocapture"]
    print(
        f"capture overhead: time {cap_t:.3f}x, peak rank RSS {cap_m:.3f}x, "
        f"total PSS {mem['capture'] / mem['nocapture']:.3f}x; verdicts {sorted(set(verdicts))}"
    )
    name = "check" if args.device == "cpu" else f"check_{args.device}"
    if args.device != "cpu":  # the profile is of the CPU path
        write(
            name,
            {
                "device": args.device,
                "world_size": args.world_size,
                "size": dict(overrides(size)),
                "runs": runs,
                "check_s": check_s,
                "dense_step_s": floor_s,
                "ratio": ratio,
                "targets": targets,
            },
        )
        return
    prof = child("--inner", "profile", *q)
    parts, step = prof["parts_s"], prof["dense_step_s"]
    print(
        f"where one rank's time goes (world 1, one thread, the case {prof['seconds']:.3f} s, the "
        f"dense step beside it {step:.3f} s; each part exclusive of the others):"
    )
    print(
        table(
            ["part", "what", "seconds", "in dense steps", "share"],
            [
                [p, what, parts.get(p, 0.0), parts.get(p, 0.0) / step,
                 f"{parts.get(p, 0.0) / prof['seconds']:.0%}"]
                for p, what in PARTS
            ],
        )
    )  # fmt: skip
    print(
        "the float64 run: none in this case (float32 runs none; a 16-bit case's is one more check "
        "in float64, after its working-dtype run: checker/verdict/float64_run.py)"
    )
    # in dense steps, from the breakdown: the float64 pass, and what the comparisons add
    truth = parts.get("float64 truth", 0.0) / step
    compares = (parts.get("compare", 0.0) + parts.get("bounds", 0.0)) / step
    cpus = args.world_size  # the check runs on one CPU per rank
    # a dense pass per rank, float64, TP halves, compares
    work = (args.world_size + truth + 1.0 + compares) / cpus
    # rank 0: dense, float64 on all CPUs, TP half
    path = 1.0 + truth / cpus + 1.0 / args.world_size + compares
    print(
        "what bounds it: the work itself, in dense steps: a dense pass on each rank "
        f"({args.world_size} x 1: each compares its own shard), the float64 pass ({truth:.1f}), "
        f"the TP halves (1 together) and the bounds and comparisons ({compares:.1f}): "
        f">= {work:.2f}x on {cpus} CPUs spread perfectly; rank 0's path (its dense pass, the "
        f"float64 pass on all {cpus} CPUs at perfect scaling, its TP half, the comparisons) "
        f">= {path:.2f}x"
    )
    arranged = child("--inner", "arrange", *q) if args.world_size == 2 else None
    if arranged:
        today = arranged["ratio"]["today"]
        rest = ratio - today  # what the check costs beyond its passes as arranged today
        print(
            "the passes alone (dense, float64, the TP halves; nothing else of a check), arranged "
            f"three ways on the same {cpus} CPUs, vs the dense step measured beside them "
            f"({arranged['dense_step_s']:.2f} s), median of 2:"
        )
        print(
            table(
                ["arrangement", "passes vs dense step", "with the rest of today's check"],
                [[f"{a}: {ARRANGEMENTS[a]}", r, r + rest] for a, r in arranged["ratio"].items()],
            )
        )
        best = min(arranged["ratio"], key=arranged["ratio"].get)
        left = TARGET - arranged["ratio"][best]
        print(
            "the rest of today's check (build, load, capture, comparisons, exchanges, optimizer): "
            f"{rest:.2f}x; the best arrangement ({best}) with it: "
            f"{arranged['ratio'][best] + rest:.2f}x against {TARGET:g}x; "
            + (
                f"meeting the target that way needs the rest at <= {left:.2f}x"
                if left > 0
                else "its passes alone are over the target"
            )
        )
    write(
        name,
        {
            "profile_world1": prof,
            "size": dict(overrides(size)),
            "repeats": repeats,
            "runs": runs,
            "check_s": check_s,
            "nocapture_s": nocap_s,
            "float64_one_thread_s": one_s,
            "dense_step_s": floor_s,
            "ratio": ratio,
            "capture_time_ratio": cap_t,
            "capture_rank_peak_ratio": cap_m,
            "peak_total_pss_gib": mem,
            "peak_rank_rss_gib": rank_peak,
            "arrangements": arranged,
            "targets": targets,
        },
    )


if __name__ == "__main__":
    main()
