"""Megatron-Core's vocab-parallel cross-entropy with label smoothing is wrong under TP: the
smoothing term uses the rank's vocab *shard* (`vocab_size = exp_logits.size(-1)`) and averages
the log-probs over the shard only, never all-reduced (tensor_parallel/cross_entropy.py:164, :176,
:181, and `ctx.vocab_size` into the backward, :197-206).

    python docs/findings/repro_megatron_label_smoothing.py

Plain torch + megatron-core (0.16.1) on CPU/gloo, TP = 1 and 2, S=3, B=2, V=8, a=0.1, against the
dense loss with Megatron's definition of label smoothing, `F.cross_entropy(label_smoothing=
a*V/(V-1))`. Then the same with the upstream file patched by the fix (`FIX` below: the full vocab
size and the log-probs summed over the TP group), applied to the installed source text and loaded
as a module. Exit 0: reproduced and the fix verified; 1: not reproduced (fixed upstream);
2: reproduced but the fix did not verify.
"""

import importlib.util
import inspect
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

S, B, V, A = 3, 2, 8, 0.1
FIX = (  # (upstream line, fixed lines) in megatron/core/tensor_parallel/cross_entropy.py
    (
        "        vocab_size = exp_logits.size(-1)\n",
        "        vocab_size = exp_logits.size(-1) * world_size  # the full vocabulary\n",
    ),
    (
        "            mean_log_probs = log_probs.mean(dim=-1)\n",
        "            mean_log_probs = log_probs.sum(dim=-1)\n"
        "            torch.distributed.all_reduce(\n"
        "                mean_log_probs, group=get_tensor_model_parallel_group()\n"
        "            )\n"
        "            mean_log_probs = mean_log_probs / vocab_size\n",
    ),
)


def data():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(S, B, V, generator=g, dtype=torch.float64).float()
    return logits, torch.randint(0, V, (S, B), generator=g)


def fixed_module():
    """megatron's cross_entropy.py with FIX applied to its installed source."""
    from megatron.core.tensor_parallel import cross_entropy

    src = inspect.getsource(cross_entropy)
    for old, new in FIX:
        assert src.count(old) == 1, f"upstream line not found once: {old!r}"
        src = src.replace(old, new)
    spec = importlib.util.spec_from_loader("megatron.core.tensor_parallel.ce_fixed", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "megatron.core.tensor_parallel"
    exec(compile(src, "cross_entropy.py (fixed)", "exec"), mod.__dict__)  # noqa: S102
    return mod


def run(rank: int, world: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.cuda.current_device = lambda: torch.device("cpu")  # Megatron's parallel state on CPU
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    logits, target = data()
    for variant, fn in (
        ("as shipped", vocab_parallel_cross_entropy),
        ("fixed", fixed_module().vocab_parallel_cross_entropy),
    ):
        local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
        loss = fn(local.clone(), target, A)
        loss.sum().backward()
        out[(variant, world, rank)] = (loss.detach(), local.grad)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    from importlib.metadata import version

    print(f"torch {torch.__version__}, megatron-core {version('megatron-core')}, gloo on CPU")
    out = mp.Manager().dict()
    for world in (1, 2):
        mp.start_processes(run, args=(world, free_port(), out), nprocs=world, start_method="fork")
    logits, target = data()
    ref = logits.clone().requires_grad_(True)
    dense = F.cross_entropy(  # Megatron's definition: 1 - a on the label, a/(V-1) elsewhere
        ref.flatten(0, 1), target.flatten(), reduction="none", label_smoothing=A * V / (V - 1)
    ).view(S, B)
    dense.sum().backward()
    print(f"dense loss[:, 0] = {dense.detach()[:, 0].numpy()}")
    err = {}
    for variant in ("as shipped", "fixed"):
        for world in (1, 2):
            grad = torch.cat([out[(variant, world, r)][1] for r in range(world)], dim=-1)
            gerr = (grad - ref.grad).abs().max().item()
            for r in range(world):
                loss = out[(variant, world, r)][0]
                lerr = (loss - dense.detach()).abs().max().item()
                err[(variant, world, r)] = max(lerr, gerr)
                print(
                    f"{variant:>10} TP{world} rank {r}: loss[:, 0] = {loss[:, 0].numpy()}, "
                    f"max |loss - dense| = {lerr:.3g}, max |grad - dense grad| = {gerr:.3g}"
                )
    tol = 1e-5
    if max(err[("as shipped", 2, r)] for r in range(2)) <= tol:
        print("NOT REPRODUCED: TP2 matches the dense loss and gradient (fixed upstream?)")
        return 1
    print("REPRODUCED: at TP2 each rank's loss differs from the dense loss (and the gradient)")
    ok = all(e <= tol for (v, _, _), e in err.items() if v == "fixed")
    print(f"FIX {'VERIFIED' if ok else 'FAILED'}: the full vocab size, log-probs summed over TP")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
