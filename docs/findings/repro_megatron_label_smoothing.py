"""Megatron-Core's vocab-parallel cross-entropy with label smoothing is wrong under TP: the
smoothing term uses the rank's vocab shard (`vocab_size = exp_logits.size(-1)`,
tensor_parallel/cross_entropy.py:164) and the mean of the log-probs over the shard only, never
all-reduced (:181); `ctx.vocab_size` carries the shard size into the backward (:184, :204-207).

    python docs/findings/repro_megatron_label_smoothing.py

Plain torch + megatron-core on CPU/gloo, through its public API: `parallel_state.
initialize_model_parallel(tensor_model_parallel_size=tp)` then `tensor_parallel.
vocab_parallel_cross_entropy(logits_shard, target, label_smoothing=0.1)` on each rank, TP = 1 and
2, S=3, B=2, V=8, against the dense loss with Megatron's definition of label smoothing
(`F.cross_entropy(label_smoothing=a*V/(V-1))`), forward and gradient. Then two fixes:
  model code: cross_entropy.py with `FIX` applied to its installed source (the full vocab size,
  the logits' sum all-reduced over the TP group; loaded as a module, i.e. monkeypatched here);
  workaround: no smoothing in megatron's call, the smoothing term computed by the caller.
Also with the logits scaled by 100 (softmax underflow: the shipped code takes log(0)).
Exit 0: reproduced and both fixes verified; 1: not reproduced; 2: a fix did not verify.
"""

import importlib.util
import inspect
import os
import socket
import sys
from importlib.metadata import version

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel

S, B, V, A = 3, 2, 8, 0.1
RTOL = 1e-5  # of the largest dense value (loss, gradient), float32
FIX = (  # (upstream text, fixed text) in megatron/core/tensor_parallel/cross_entropy.py
    (
        "        )\n        torch.distributed.all_reduce(\n            logits_max,",
        "        )\n"
        "        if label_smoothing > 0:  # before the in-place exp below; over the full vocab\n"
        "            sum_logits = vocab_parallel_logits.sum(dim=-1)\n"
        "            torch.distributed.all_reduce("
        "sum_logits, group=get_tensor_model_parallel_group())\n"
        "        torch.distributed.all_reduce(\n            logits_max,",
    ),
    (
        "        vocab_size = exp_logits.size(-1)\n",
        "        vocab_size = exp_logits.size(-1) * world_size  # the full vocabulary\n",
    ),
    (
        "            # Exp logits at this point are normalized probabilities.\n"
        "            # So we can just take the log to get log-probs.\n"
        "            log_probs = torch.log(exp_logits)\n"
        "            mean_log_probs = log_probs.mean(dim=-1)\n",
        "            # mean over the full vocabulary of log p:"
        " mean z - max z - log sum exp(z - max z)\n"
        "            mean_log_probs = sum_logits / vocab_size - logits_max"
        " - torch.log(sum_exp_logits)\n",
    ),
)


def fixed_module():
    """megatron's cross_entropy.py with FIX applied to its installed source."""
    from megatron.core.tensor_parallel import cross_entropy

    src = inspect.getsource(cross_entropy)
    for old, new in FIX:
        assert src.count(old) == 1, f"upstream text not found once: {old!r}"
        src = src.replace(old, new)
    spec = importlib.util.spec_from_loader("megatron.core.tensor_parallel.ce_fixed", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "megatron.core.tensor_parallel"
    exec(compile(src, "cross_entropy.py (fixed)", "exec"), mod.__dict__)  # noqa: S102
    return mod


def smoothed_cross_entropy(logits, target, label_smoothing):
    """The workaround, with megatron-core's public calls only: the unsmoothed vocab-parallel loss
    (correct under TP) mixed with the smoothing term -mean_v log p_v = logsumexp(z) - mean_v z,
    whose sums over the vocabulary are all-reduced by reduce_from_tensor_model_parallel_region
    (backward: identity). Megatron's definition: 1 - a on the label, a/(V-1) on the others."""
    reduce = tensor_parallel.reduce_from_tensor_model_parallel_region
    vocab = logits.size(-1) * parallel_state.get_tensor_model_parallel_world_size()
    smoothing = label_smoothing * vocab / (vocab - 1)
    z_max = logits.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(
        z_max, dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
    )
    lse = z_max.squeeze(-1) + torch.log(reduce((logits - z_max).exp().sum(dim=-1)))
    mean_z = reduce(logits.sum(dim=-1)) / vocab
    # vocab_parallel_cross_entropy overwrites float32 logits in place: it goes last
    nll = tensor_parallel.vocab_parallel_cross_entropy(logits, target)
    return (1.0 - smoothing) * nll + smoothing * (lse - mean_z)


def data(scale: float):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(S, B, V, generator=g, dtype=torch.float64).float() * scale
    return logits, torch.randint(0, V, (S, B), generator=g)


def run(rank: int, world: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    variants = (
        ("as shipped", tensor_parallel.vocab_parallel_cross_entropy),
        ("model code", fixed_module().vocab_parallel_cross_entropy),
        ("workaround", smoothed_cross_entropy),
    )
    for scale in (1.0, 100.0):
        logits, target = data(scale)
        for variant, fn in variants:
            local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
            loss = fn(local.clone(), target, A)  # the clone: the model's (non-leaf) logits
            loss.sum().backward()
            out[(scale, variant, world, rank)] = (loss.detach(), local.grad)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    print(f"torch {torch.__version__}, megatron-core {version('megatron-core')}, gloo on CPU")
    out = mp.Manager().dict()
    for world in (1, 2):
        mp.start_processes(run, args=(world, free_port(), out), nprocs=world, start_method="fork")
    ok = {}
    for scale in (1.0, 100.0):
        logits, target = data(scale)
        ref = logits.clone().requires_grad_(True)
        dense = F.cross_entropy(  # Megatron's definition: 1 - a on the label, a/(V-1) elsewhere
            ref.flatten(0, 1), target.flatten(), reduction="none", label_smoothing=A * V / (V - 1)
        ).view(S, B)
        dense.sum().backward()
        lscale, gscale = dense.detach().abs().max().item(), ref.grad.abs().max().item()
        print(
            f"logits x{scale:g}: dense loss[:, 0] = {dense.detach()[:, 0].numpy()}; errors below "
            f"relative to the largest dense loss ({lscale:.3g}) and gradient ({gscale:.3g})"
        )
        for variant in ("as shipped", "model code", "workaround"):
            for world in (1, 2):
                grad = torch.cat([out[(scale, variant, world, r)][1] for r in range(world)], -1)
                gerr = (grad - ref.grad).abs().max().item() / gscale
                for r in range(world):
                    loss = out[(scale, variant, world, r)][0]
                    lerr = (loss - dense.detach()).abs().max().item() / lscale
                    ok[(scale, variant, world, r)] = max(lerr, gerr) <= RTOL
                    print(
                        f"  {variant:>10} TP{world} rank {r}: loss[:, 0] = {loss[:, 0].numpy()}, "
                        f"max |loss - dense| = {lerr:.3g}, max |grad - dense| = {gerr:.3g}"
                    )
    if all(ok[(1.0, "as shipped", 2, r)] for r in range(2)):
        print("NOT REPRODUCED: TP2 matches the dense loss and gradient (fixed upstream?)")
        return 1
    print("REPRODUCED: at TP2 each rank's loss differs from the dense loss, and the gradient too")
    code = 0
    for label, what in (
        ("model code", "the full vocab size and the logits' sum all-reduced over the TP group"),
        ("workaround", "unsmoothed vocab_parallel_cross_entropy + the caller's smoothing term"),
    ):
        good = all(v for (_, variant, _, _), v in ok.items() if variant == label)
        print(f"FIX {'VERIFIED' if good else 'FAILED'} ({label}): {what}")
        code = code if good else 2
    return code


if __name__ == "__main__":
    sys.exit(main())
