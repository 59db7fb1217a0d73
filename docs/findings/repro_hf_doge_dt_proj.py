"""Doge's TP plan cannot run: `self_attn.dt_proj` (the projection that computes each KV head's
dynamic attention mask from the value states) is `rowwise`, whose output is all-reduced to every
head's mask, while each rank's attention holds only its own heads (q/k/v colwise): the mask does
not broadcast (modeling_doge.py:181, `attn_weights + attention_mask`). The per-head `A`
(modeling_doge.py:262, a bare parameter over every KV head) and the per-head `q_norm`/`k_norm`
(no rule; their gradients are partial sums) need rules too.

    python docs/findings/repro_hf_doge_dt_proj.py

Plain torch + transformers (5.24.0) on 2 CPU/gloo ranks, a 2-layer DogeForCausalLM (hidden 32,
4 heads, 4 KV heads). The plan as shipped raises in both forward paths. The fix is a plan change
(verified: logits and every gradient match): `dt_proj` rowwise with its output *reduce-scattered*
over the heads (`RowwiseParallel(input_layouts=Shard(-1), output_layouts=Shard(-1))`, registered
here as `rowwise_scatter_output`), `A` sharded with the heads (`colwise` on the parameter) and used
as a local tensor (`local_params` on `self_attn`), and `q_norm`/`k_norm` under
`replicated_with_grad_allreduce`. Exit 0: reproduced and the fix verified; 1: not reproduced
(fixed upstream); 2: reproduced but the fix did not verify.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB = 128
SIZES = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=128,
    num_hidden_layers=2,
    vocab_size=VOCAB,
    use_cache=False,
)
FIX = {
    "model.layers.*.self_attn.dt_proj": "rowwise_scatter_output",
    "model.layers.*.self_attn.A": "colwise",
    "model.layers.*.self_attn": "local_params",
    "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
}


def register_fix() -> None:
    from torch.distributed.tensor import Shard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, RowwiseParallel

    # the partial output reduce-scattered over the heads: each rank gets its heads' mask
    # (backward: all-gather), instead of all-reduced to every head's
    scatter = RowwiseParallel(input_layouts=Shard(-1), output_layouts=Shard(-1))
    ALL_PARALLEL_STYLES.register("rowwise_scatter_output", scatter)


def build(world, mesh, rules):
    from transformers import DogeConfig, DogeForCausalLM, initialization
    from transformers.distributed import DistributedConfig

    cfg = DogeConfig(**SIZES)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)  # the same dense weights on every rank
    dense = DogeForCausalLM(cfg).float()
    with initialization.no_tie_weights():  # as from_pretrained builds a model it will shard
        tp = DogeForCausalLM(cfg).float()
    tp.load_state_dict(dense.state_dict(), strict=False)
    dc = DistributedConfig(tp_size=world, tp_plan=rules)
    tp = DogeForCausalLM.maybe_distribute_model(tp, dc, mesh)
    tp.tie_weights()
    return dense, tp


def check(dense, tp, ids, labels) -> dict:
    """No-grad logits error (or exception), then the grad-enabled forward + backward."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    res = {}
    for grad in (False, True):
        tag = "grad-enabled" if grad else "no-grad"
        try:
            with torch.set_grad_enabled(grad):
                a, b = dense(input_ids=ids).logits, tp(input_ids=ids).logits
        except (RuntimeError, AssertionError) as e:
            where, line = e.__traceback__, "?"
            while where is not None:
                if "modeling_doge" in where.tb_frame.f_code.co_filename:
                    line = f"modeling_doge.py:{where.tb_lineno}"
                where = where.tb_next
            first = (str(e).splitlines() or [""])[0][:70]
            res[tag] = f"raised {type(e).__name__} at {line}: {first}"
            return res
        res[f"{tag} max |logits_TP - logits_dense|"] = (a - b).abs().max().item()
        res[f"{tag} max |logits_dense|"] = a.abs().max().item()
    for logits in (a, b):
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).backward()
    tp_params = dict(tp.named_parameters())
    res["worst relative grad error"], name = max(
        (((full(tp_params[n].grad) - p.grad).abs().max() / (1e-6 + p.grad.abs().max())).item(), n)
        for n, p in dense.named_parameters()
        if p.grad is not None
    )
    res["worst relative grad error"] = f"{res['worst relative grad error']:.3g} ({name})"
    return res


def run(rank: int, world: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import initialize_distributed_mesh

    register_fix()
    _, mesh = initialize_distributed_mesh(DistributedConfig(tp_size=world))
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(2))
    for variant, rules in (("as shipped", None), ("fixed", FIX)):
        res = check(*build(world, mesh, rules), ids, labels)
        if rank == 0:
            out[variant] = res
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
    for variant in ("as shipped", "fixed"):
        for key, value in out[variant].items():
            shown = value if isinstance(value, str) else f"{value:.3g}"
            print(f"{variant:>15}: {key}: {shown}")
    bug, fix = out["as shipped"], out["fixed"]
    if "no-grad" not in bug and "grad-enabled" not in bug:
        print("NOT REPRODUCED: the TP forward runs (fixed upstream?)")
        return 1
    print("REPRODUCED: the TP forward raises: dt_proj's all-reduced mask has every head")
    ok = (
        fix.get("grad-enabled max |logits_TP - logits_dense|", 1.0) < 1e-6
        and float(fix.get("worst relative grad error", "1").split()[0]) < 1e-4
    )
    print(f"FIX {'VERIFIED' if ok else 'FAILED'}: {FIX}")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
