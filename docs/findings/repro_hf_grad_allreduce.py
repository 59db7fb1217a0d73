"""transformers' `replicated_with_grad_allreduce` style all-reduces the *accumulated* gradient after
every backward, so with gradient accumulation the early micro-batches are counted world-size times.

    python docs/findings/repro_hf_grad_allreduce.py

Plain torch + transformers (5.24.0) on 2 CPU/gloo ranks: a 1-layer Qwen3 (hidden 64, 8 heads, 4 KV
heads), its own TP plan (`q_norm`/`k_norm` under `replicated_with_grad_allreduce`), 1, 2 and 3
micro-batches; then the same with `q_norm`/`k_norm` under a style that reduces each micro-batch's
gradient as it arrives (a tensor hook, before accumulation). Prints max |grad_TP - grad_dense| of
`q_norm.weight`. Exit 0: reproduced and the fix verified; 1: not reproduced (fixed upstream);
2: reproduced but the fix did not verify.
"""

import copy
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NAME = "model.layers.0.self_attn.q_norm.weight"
FIX = {
    "model.layers.*.self_attn.q_norm": "reduce_grad_on_arrival",
    "model.layers.*.self_attn.k_norm": "reduce_grad_on_arrival",
}


def register_fix() -> None:
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer

    class ReduceGradOnArrival(TensorParallelLayer):
        """A replicated parameter whose gradient is partial: all-reduce each backward's gradient
        (a tensor hook) before it is accumulated into `.grad`."""

        def install_forward(self, module, mesh):
            def reduce(grad):
                grad = grad.clone()
                dist.all_reduce(grad, group=mesh.get_group())
                return grad

            for p in module.parameters(recurse=False):
                p.register_hook(reduce)
            return module

    ALL_PARALLEL_STYLES.register("reduce_grad_on_arrival", ReduceGradOnArrival())


def run(rank: int, world: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import initialize_distributed_mesh

    register_fix()
    cfg = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        num_hidden_layers=1,
        vocab_size=128,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)  # the same dense weights on every rank
    dense = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in dense.parameters():  # random norm weights too (they are ones at init)
            p.add_(0.1 * torch.randn_like(p))
    _, mesh = initialize_distributed_mesh(DistributedConfig(tp_size=world))
    for variant, rules in (("as shipped", None), ("fixed", FIX)):
        dc = DistributedConfig(tp_size=world, tp_plan=rules)
        tp = Qwen3ForCausalLM.maybe_distribute_model(copy.deepcopy(dense), dc, mesh)
        g = torch.Generator().manual_seed(1)
        for micro_batches in (1, 2, 3):
            dense.zero_grad()
            tp.zero_grad()
            for _ in range(micro_batches):
                ids = torch.randint(0, 128, (2, 8), generator=g)
                labels = torch.randint(0, 128, (2, 8), generator=g)
                for model in (dense, tp):
                    logits = model(input_ids=ids).logits
                    loss = torch.nn.functional.cross_entropy(
                        logits.reshape(-1, 128), labels.reshape(-1)
                    )
                    (loss / micro_batches).backward()
            want = dict(dense.named_parameters())[NAME].grad
            got = dict(tp.named_parameters())[NAME].grad
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            if rank == 0:
                out[(variant, micro_batches)] = (
                    (got - want).abs().max().item(),
                    want.abs().max().item(),
                )
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, 2 gloo ranks")
    out = mp.Manager().dict()
    mp.start_processes(run, args=(2, free_port(), out), nprocs=2, start_method="fork")
    for (variant, mb), (err, scale) in sorted(out.items()):
        print(
            f"{variant:>10}: {mb} micro-batch(es): max |grad_TP - grad_dense| of {NAME} = "
            f"{err:.3g} (max |grad_dense| = {scale:.3g})"
        )
    tol = lambda key: 1e-5 * out[key][1]  # noqa: E731 - float32 rounding, relative to the gradient
    bug = out[("as shipped", 2)][0] > 0.1 * out[("as shipped", 2)][1]
    exact_one = out[("as shipped", 1)][0] <= tol(("as shipped", 1))
    fixed = all(out[("fixed", mb)][0] <= tol(("fixed", mb)) for mb in (1, 2, 3))
    if not bug:
        print("NOT REPRODUCED: accumulated gradients match the dense model (fixed upstream?)")
        return 1
    print(
        "REPRODUCED: with 2+ micro-batches the gradient of q_norm is wrong"
        f" (exact with 1 micro-batch: {exact_one})"
    )
    print(f"FIX {'VERIFIED' if fixed else 'FAILED'}: reduce_grad_on_arrival on q_norm/k_norm")
    return 0 if fixed and exact_one else 2


if __name__ == "__main__":
    sys.exit(main())
