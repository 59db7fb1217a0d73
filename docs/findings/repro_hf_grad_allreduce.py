"""Minimal repro: transformers' `replicated_with_grad_allreduce` style all-reduces the *accumulated*
gradient after every backward, so with gradient accumulation the early micro-batches are counted
world-size times. Plain torch + transformers 5.24.0 on CPU/gloo, no tpcheck:

    python docs/findings/repro_hf_grad_allreduce.py          # plan as shipped
    python docs/findings/repro_hf_grad_allreduce.py --fixed  # q_norm/k_norm under a style that
                                                             # reduces each micro-batch's grad
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank: int, world: int, fixed: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer
    from transformers.distributed.utils import initialize_distributed_mesh

    class ReduceGradOnArrival(TensorParallelLayer):  # the fix: a tensor hook, before accumulation
        def install_forward(self, module, mesh):

            def reduce(grad):
                grad = grad.clone()
                dist.all_reduce(grad, group=mesh.get_group())
                return grad

            for p in module.parameters(recurse=False):
                p.register_hook(reduce)
            return module

    ALL_PARALLEL_STYLES.register("reduce_grad_on_arrival", ReduceGradOnArrival())
    rules = (
        {
            "model.layers.*.self_attn.q_norm": "reduce_grad_on_arrival",
            "model.layers.*.self_attn.k_norm": "reduce_grad_on_arrival",
        }
        if fixed
        else None
    )
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
    torch.manual_seed(0)
    dense = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in dense.parameters():  # random norm weights too (they are ones at init)
            p.add_(0.1 * torch.randn_like(p))
    dc = DistributedConfig(tp_size=world, tp_plan=rules)
    _, mesh = initialize_distributed_mesh(DistributedConfig(tp_size=world))
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
        name = "model.layers.0.self_attn.q_norm.weight"
        want = dict(dense.named_parameters())[name].grad
        got = dict(tp.named_parameters())[name].grad
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        if rank == 0:
            err = (got - want).abs().max().item()
            print(
                f"{'fixed' if fixed else 'as shipped'}: {micro_batches} micro-batch(es): "
                f"max |grad_TP - grad_dense| of {name} = {err:.3g} (max |grad_dense| "
                f"= {want.abs().max():.3g})"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, args=(2, "--fixed" in sys.argv), nprocs=2)
