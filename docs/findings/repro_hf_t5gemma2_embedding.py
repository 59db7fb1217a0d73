"""T5Gemma2 under TP: transformers' default `embedding_rowwise` for an `nn.Embedding` subclass
(distributed/mixin.py:93-94) also shards the subclass's `eoi_embedding` vector and writes it in
place into the vocab-parallel lookup: the backward raises.

    python docs/findings/repro_hf_t5gemma2_embedding.py

Plain torch + transformers (5.24.0) on 2 CPU/gloo ranks, a 2-layer T5Gemma2TextEncoder (hidden 64,
8 heads), its end-of-image token set inside the small vocabulary and present in the batch.
`T5Gemma2TextScaledWordEmbedding` (`models/t5gemma2/modeling_t5gemma2.py:610-631`) is an
`nn.Embedding` whose forward scales the lookup and overwrites the rows of the end-of-image token
with its own parameter `eoi_embedding` (`:629`, an `index_put`). T5Gemma2's plan has no
`embed_tokens` rule, so transformers' default makes it `embedding_rowwise`, which shards every
parameter of the module on dim 0 (`distributed/tensor_parallel.py:326-333`) — the vocabulary of
`weight`, but the hidden features of `eoi_embedding`. Runs the plan as shipped (no-grad forward,
then a forward/backward) and with `embed_tokens=replicate`. Prints the hidden-state and gradient
errors against the dense model. Exit 0: reproduced and the fix verified; 1: not reproduced (fixed
upstream); 2: reproduced but the fix did not verify.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB, EOI = 128, 5
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention"],
    use_cache=False,
    dropout_rate=0.0,  # read by the model, not set by the text config's defaults
)
FIX = {"embed_tokens": "replicate"}


def build(world: int, rules, mesh):
    from transformers import T5Gemma2TextConfig
    from transformers.distributed import DistributedConfig
    from transformers.models.t5gemma2.modeling_t5gemma2 import T5Gemma2TextEncoder

    cfg = T5Gemma2TextConfig(**SIZES)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)  # the same dense weights on every rank
    dense = T5Gemma2TextEncoder(cfg, eoi_token_index=EOI).float()
    with torch.no_grad():
        for p in dense.parameters():  # eoi_embedding and norm weights off their zero init
            p.add_(0.1 * torch.randn_like(p))
    tp = T5Gemma2TextEncoder(cfg, eoi_token_index=EOI).float()
    tp.load_state_dict(dense.state_dict())
    dc = DistributedConfig(tp_size=world, tp_plan=rules)
    return dense, T5Gemma2TextEncoder.maybe_distribute_model(tp, dc, mesh)


def check(dense, tp, ids, probe) -> dict:
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    res = {}
    for grad in (False, True):
        tag = "grad-enabled" if grad else "no-grad"
        try:
            with torch.set_grad_enabled(grad):
                want = dense(input_ids=ids).last_hidden_state
                got = full(tp(input_ids=ids).last_hidden_state)
                if grad:
                    (want * probe).sum().backward()
                    (got * probe).sum().backward()
        except (RuntimeError, AssertionError) as e:
            res[tag] = f"raised {type(e).__name__}: {str(e).splitlines()[0][:100]}"
            return res
        res[f"{tag} max |hidden_TP - hidden_dense|"] = (got - want).abs().max().item()
    res["max |hidden_dense|"] = want.abs().max().item()
    tp_params = dict(tp.named_parameters())
    worst, name = max(
        (((full(tp_params[n].grad) - p.grad).abs().max() / (1e-6 + p.grad.abs().max())).item(), n)
        for n, p in dense.named_parameters()
        if p.grad is not None
    )
    res["worst relative grad error"] = f"{worst:.3g} ({name})"
    return res


def run(rank: int, world: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import initialize_distributed_mesh

    _, mesh = initialize_distributed_mesh(DistributedConfig(tp_size=world))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 8), generator=g)
    ids[:, 3] = EOI  # the end-of-image token in every row
    probe = torch.randn(2, 8, SIZES["hidden_size"], generator=g)
    for variant, rules in (("as shipped", None), ("fixed", FIX)):
        res = check(*build(world, rules, mesh), ids, probe)
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
            print(f"{variant:>10}: {key}: {shown}")
    bug, fix = out["as shipped"], out["fixed"]
    wrong = bug.get("no-grad max |hidden_TP - hidden_dense|", 0.0) > 1e-3
    if not ("grad-enabled" in bug or "no-grad" in bug or wrong):
        print("NOT REPRODUCED: the TP model runs and matches (fixed upstream?)")
        return 1
    print("REPRODUCED: the vocab-parallel embedding with its sharded eoi_embedding fails")
    ok = (
        fix.get("grad-enabled max |hidden_TP - hidden_dense|", 1.0)
        <= 1e-5 * fix["max |hidden_dense|"]
        and float(fix.get("worst relative grad error", "1").split()[0]) < 1e-4
    )
    print(f"FIX {'VERIFIED' if ok else 'FAILED'}: {FIX}")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
