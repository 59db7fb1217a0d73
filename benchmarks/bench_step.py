"""(c) Step time (forward + backward, no checker) of tpcheck's TP blocks vs DTensor vs dense.

At three shapes (seq, batch, hidden, ffn): the seed's (3, 2, 8, 12; 2 heads), the tiny preset's
(8, 2, 32, 64; 4 heads, 2 KV heads) and a large one (512, 4, 1024, 4096; 16 heads, 8 KV heads),
world size 2 (two forked gloo ranks). For each block (MLP, attention, transformer layer):
- tpcheck TP: `ParallelMLP` / `ParallelAttention` / `ParallelLayer` (plain autograd collectives);
- DTensor TP: the same math as a dense module with separate nn.Linear projections (gate/up/down;
  wq/wk/wv/wo), parallelized with `parallelize_module` + ColwiseParallel/RowwiseParallel
  (torchtitan's Llama plan);
- dense, world size 1: tpcheck's dense block in one process.
Every process runs with torch.set_num_threads(1): 2 ranks on a 2-core machine, one core each; the
dense baseline also gets one core, so "dense / TP" is the speed-up per core count.
A step is timed per rank after a barrier; per step we take the slower rank, then the median."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from tpcheck.models import dense as tdense  # noqa: E402
from tpcheck.models.config import ModelConfig  # noqa: E402

from _common import median, parser, table, verdict, write  # noqa: E402

TARGET = 1.0  # tpcheck TP / DTensor TP at the large shape
SMALL_TARGET = 0.6  # at the seed's and the tiny preset's shapes


class SepMLP(nn.Module):
    """x + down(silu(gate(norm x)) * up(norm x)),
    separate nn.Linear projections (DTensor-friendly)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = tdense.RMSNorm(cfg.hidden, cfg.eps)
        self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=True)

    def forward(self, x):
        n = self.norm(x)
        return x + self.down(F.silu(self.gate(n)) * self.up(n))  # [s, b, h]


class SepAttention(nn.Module):
    """x + wo(attention(wq, wk, wv of norm x)); heads inferred from the local width (view(..., -1,
    d)), so the same code runs dense and colwise-sharded."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg, d = cfg, cfg.head_dim
        self.norm = tdense.RMSNorm(cfg.hidden, cfg.eps)
        self.wq = nn.Linear(cfg.hidden, cfg.heads * d, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.num_kv_heads * d, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.num_kv_heads * d, bias=False)
        self.wo = nn.Linear(cfg.heads * d, cfg.hidden, bias=False)

    def forward(self, x):
        s, b, _ = x.shape
        d, n = self.cfg.head_dim, self.norm(x)
        q, k, v = (w(n).view(s, b, -1, d) for w in (self.wq, self.wk, self.wv))
        return x + self.wo(tdense.causal_attention(q, k, v, self.cfg.rope_theta))  # [s, b, h]


class SepLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention, self.mlp = SepAttention(cfg), SepMLP(cfg)

    def forward(self, x):
        return self.mlp(self.attention(x))


def dtensor_plan(block: str) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    mlp = {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
    attn = {
        "wq": ColwiseParallel(),
        "wk": ColwiseParallel(),
        "wv": ColwiseParallel(),
        "wo": RowwiseParallel(),
    }
    if block == "mlp":
        return mlp
    if block == "attention":
        return attn
    return {
        **{f"attention.{k}": v for k, v in attn.items()},
        **{f"mlp.{k}": v for k, v in mlp.items()},
    }


def init_(model: nn.Module) -> nn.Module:
    """Small random weights (torch.empty may hold NaN/denormals, which distort timings)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 + (1.0 if p.dim() == 1 else 0.0))
    return model


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


def one_step(model: nn.Module, x: torch.Tensor, barrier) -> float:
    model.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_(True)
    _sync(x)
    barrier()
    t0 = time.perf_counter()
    model(xi).float().pow(2).mean().backward()
    _sync(x)
    return time.perf_counter() - t0


def time_steps(
    models: list[nn.Module], x: torch.Tensor, warmup: int, steps: int, barrier
) -> list[list[float]]:
    """Per model, its step times; the models take turns
    step by step, so load bursts hit all alike."""
    times: list[list[float]] = [[] for _ in models]
    for i in range(warmup + steps):
        for m, t in zip(models, times):
            dt = one_step(m, x, barrier)
            if i >= warmup:
                t.append(dt)
    return times


def tpcheck_tp(block: str, cfg: ModelConfig, group):
    from tpcheck.models.parallel import ParallelAttention, ParallelLayer, ParallelMLP

    cls = {"mlp": ParallelMLP, "attention": ParallelAttention, "layer": ParallelLayer}[block]
    return init_(cls(cfg, group))


def dtensor_tp(block: str, cfg: ModelConfig, mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    model = init_({"mlp": SepMLP, "attention": SepAttention, "layer": SepLayer}[block](cfg))
    return parallelize_module(model, mesh, dtensor_plan(block))


def _rank(group, blocks, cfgs, warmup, steps):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(group.device.type, (group.world_size,))
    out = {}
    for block in blocks:
        cfg = cfgs[block]
        x = torch.randn(
            cfg.seq, cfg.batch, cfg.hidden, generator=torch.Generator().manual_seed(1)
        ).to(group.device)
        models = [
            tpcheck_tp(block, cfg, group).to(group.device),
            dtensor_tp(block, cfg, mesh).to(group.device),
        ]
        out[(block, "tpcheck TP")], out[(block, "DTensor TP")] = time_steps(
            models, x, warmup, steps, dist.barrier
        )
        del models
    return out


def run_tp(world, blocks, cfgs, warmup, steps, device="cpu") -> list[dict]:
    from tpcheck.checker.pool.spawn import run_on_ranks

    return run_on_ranks(_rank, world, blocks, cfgs, warmup, steps, timeout_s=1800, device=device)


def dense_w1(block: str, cfg: ModelConfig, warmup: int, steps: int, device="cpu") -> list[float]:
    """The dense block in this process (on "cuda": in a forked child, so this process never starts
    CUDA before the ranks are forked)."""
    if device != "cpu":
        from tpcheck.checker.pool.spawn import run_on_ranks

        return run_on_ranks(
            lambda group: dense_w1(block, cfg, warmup, steps, group.device),
            1,
            timeout_s=1800,
            device=device,
        )[0]
    cls = {"mlp": tdense.DenseMLP, "attention": tdense.DenseAttention, "layer": tdense.DenseLayer}[
        block
    ]
    x = torch.randn(cfg.seq, cfg.batch, cfg.hidden, generator=torch.Generator().manual_seed(1)).to(
        device
    )
    return time_steps([init_(cls(cfg)).to(device)], x, warmup, steps, lambda: None)[0]


def sizes(quick: bool) -> list[tuple[str, dict, int, float]]:
    """(name, config fields, timed steps, target tpcheck/DTensor): the seed's and the tiny preset's
    shapes, where most checks run and per-op overhead decides, and one large shape,
    where the matmuls do."""
    large = (
        dict(seq=128, batch=2, hidden=512, ffn=2048)
        if quick
        else dict(seq=512, batch=4, hidden=1024, ffn=4096)
    )
    return [
        (
            "seed",
            dict(seq=3, batch=2, hidden=8, ffn=12, heads=2, kv_heads=2),
            30 if quick else 100,
            SMALL_TARGET,
        ),
        (
            "tiny",
            dict(seq=8, batch=2, hidden=32, ffn=64, heads=4, kv_heads=2),
            30 if quick else 100,
            SMALL_TARGET,
        ),
        ("large", dict(large, heads=16, kv_heads=8), 3 if quick else 10, TARGET),
    ]


def main() -> None:
    p = parser(__doc__)
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank, NCCL"
    )
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args()
    from tpcheck.blocks import BLOCKS

    warmup, world, device = 2, args.world_size, args.device
    blocks = [b for b in ("mlp", "attention", "layer") if b in BLOCKS]
    rows, res, targets, shapes = [], {}, [], {}
    for size, fields, steps, target in sizes(args.quick):
        cfgs = {b: ModelConfig(**fields) for b in blocks}
        shapes[size] = fields
        outs = run_tp(world, blocks, cfgs, warmup, steps, device)
        torch.set_num_threads(1)
        for block in blocks:
            med = {}
            for side in ("tpcheck TP", "DTensor TP"):
                per_step = [max(o[(block, side)][i] for o in outs) for i in range(steps)]
                med[side] = median(per_step)
                res[f"{size}/{block}/{side}"] = per_step
            res[f"{size}/{block}/dense w1"] = dense_w1(block, cfgs[block], warmup, steps, device)
            med["dense w1"] = median(res[f"{size}/{block}/dense w1"])
            ratio = med["tpcheck TP"] / med["DTensor TP"]
            rows.append(
                [
                    size,
                    block,
                    med["tpcheck TP"] * 1e3,
                    med["DTensor TP"] * 1e3,
                    med["dense w1"] * 1e3,
                    ratio,
                    med["dense w1"] / med["tpcheck TP"],
                ]
            )
            targets.append(
                verdict(
                    f"{size} {block}: tpcheck TP vs DTensor TP step",
                    ratio <= target,
                    f"{ratio:.3f}x",
                    f"<= {target:g}x",
                )
            )
    print(
        f"world {world} on {device}, 1 thread per process, median of the timed steps "
        f"after {warmup} warm-up; shapes " + "; ".join(f"{k}: {v}" for k, v in shapes.items())
    )
    print(
        table(
            [
                "size",
                "block",
                "tpcheck TP (ms)",
                "DTensor TP (ms)",
                "dense w1 (ms)",
                "tpcheck/DTensor",
                "dense w1 / tpcheck TP",
            ],
            rows,
        )
    )
    write(
        "step" if device == "cpu" else f"step_{device}",
        {
            "shapes": shapes,
            "world_size": world,
            "device": device,
            "threads_per_process": 1,
            "warmup": warmup,
            "step_seconds": res,
            "rows": rows,
            "targets": targets,
        },
    )


if __name__ == "__main__":
    main()
