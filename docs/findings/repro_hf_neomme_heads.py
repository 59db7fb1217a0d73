"""NeoMME's TP plan cannot run: its attention shards the heads (q/k/v colwise, o_proj rowwise), but
two per-head tensors that meet the local heads have no rule, so each rank holds every head's copy:
`exclusive_self_attention.alpha` (one value per attention head: the forward raises at
modeling_neomme.py:195) and the model-level `value_embeddings` (`num_key_value_heads * head_dim`
features per token, added to the local heads' value states: it raises at modeling_neomme.py:342
once alpha is sharded).

    python docs/findings/repro_hf_neomme_heads.py

Plain torch + transformers (5.24.0) on 2 CPU/gloo ranks, a 2-layer NeoMMEModel (hidden 64, 8 heads,
4 KV heads, head_dim 16) in float64, so that what is left is rounding at float64's resolution.
The fix is a plan change with one custom style (verified: the last hidden state and every gradient
match): `alpha` sharded with the heads (`colwise` on the parameter) and used as a local tensor
(`local_params` on `exclusive_self_attention`), and `value_embeddings` split over its features
with the local part kept (`embedding_colwise_local`, registered here: transformers'
`embedding_colwise` gathers every head's features back). Exit 0: reproduced and the fix verified;
1: not reproduced (fixed upstream); 2: reproduced but the fix did not verify.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB = 128
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    embedding_dim=128,
    sliding_window=4,
    use_cache=False,
)
FIX = {
    "layers.*.self_attn.exclusive_self_attention.alpha": "colwise",
    "layers.*.self_attn.exclusive_self_attention": "local_params",
    "value_embeddings": "embedding_colwise_local",
}


def register_fix() -> None:
    from torch.distributed.tensor import DTensor
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, EmbeddingParallel

    class LocalColwiseEmbedding(EmbeddingParallel):
        """The embedding split over its features, each rank keeping its part (its heads)."""

        def __init__(self):
            super().__init__(shard_dim=1)

        def transform_output_post_forward(self, module, output, mesh):
            return output.to_local() if isinstance(output, DTensor) else output

    ALL_PARALLEL_STYLES.register("embedding_colwise_local", LocalColwiseEmbedding())


def build(world, mesh, rules):
    from transformers import NeoMMEConfig, NeoMMEModel, initialization
    from transformers.distributed import DistributedConfig

    cfg = NeoMMEConfig(**SIZES)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)  # the same dense weights on every rank
    dense = NeoMMEModel(cfg).double()
    for p in dense.parameters():  # alpha and value_embeddings start at zero: make them act
        if p.abs().max() == 0:
            torch.nn.init.normal_(p, std=0.5)
    with initialization.no_tie_weights():  # as from_pretrained builds a model it will shard
        tp = NeoMMEModel(cfg).double()
    tp.load_state_dict(dense.state_dict(), strict=False)
    dc = DistributedConfig(tp_size=world, tp_plan=rules)
    tp = NeoMMEModel.maybe_distribute_model(tp, dc, mesh)
    return dense, tp


def check(dense, tp, ids, target) -> dict:
    """No-grad output error (or exception), then the grad-enabled forward + backward."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    res = {}
    for grad in (False, True):
        tag = "grad-enabled" if grad else "no-grad"
        try:
            with torch.set_grad_enabled(grad):
                a = dense(input_ids=ids).last_hidden_state
                b = full(tp(input_ids=ids).last_hidden_state)
        except (RuntimeError, AssertionError) as e:
            where, line = e.__traceback__, "?"
            while where is not None:
                if "modeling_neomme" in where.tb_frame.f_code.co_filename:
                    line = f"modeling_neomme.py:{where.tb_lineno}"
                where = where.tb_next
            first = (str(e).splitlines() or [""])[0][:70]
            res[tag] = f"raised {type(e).__name__} at {line}: {first}"
            return res
        res[f"{tag} max |h_TP - h_dense|"] = (a - b).abs().max().item()
        res[f"{tag} max |h_dense|"] = a.abs().max().item()
    for h in (a, b):
        torch.nn.functional.mse_loss(h, target).backward()
    tp_params = dict(tp.named_parameters())
    res["worst relative grad error"], name = max(
        (((full(tp_params[n].grad) - p.grad).abs().max() / (1e-6 + p.grad.abs().max())).item(), n)
        for n, p in dense.named_parameters()
        if p.grad is not None and n in tp_params
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
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    target = torch.randn(2, 8, SIZES["hidden_size"], generator=g, dtype=torch.float64)
    for variant, rules in (("as shipped", None), ("fixed", FIX)):
        res = check(*build(world, mesh, rules), ids, target)
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
    print("REPRODUCED: the TP forward raises: a per-head tensor holds every head on each rank")
    ok = (
        fix.get("grad-enabled max |h_TP - h_dense|", 1.0) < 1e-9
        and float(fix.get("worst relative grad error", "1").split()[0]) < 1e-9
    )
    print(f"FIX {'VERIFIED' if ok else 'FAILED'}: {FIX}")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
