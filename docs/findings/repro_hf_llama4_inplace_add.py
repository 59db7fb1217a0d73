"""Llama4 (text) under transformers' TP plan raises in a grad-enabled forward: the MoE block adds
the routed experts' output *in place* into the shared expert's output, which under TP is the view
returned by `DTensor.to_local()` (rowwise `shared_expert.down_proj`), made inside an autograd
Function.

    python docs/findings/repro_hf_llama4_inplace_add.py

Plain torch + transformers (5.24.0) on 2 CPU/gloo ranks, a 2-layer Llama4ForCausalLM (hidden 64,
8 heads, 4 KV heads, 4 experts). The no-grad forward (transformers' local inference path) matches
the dense model; the grad-enabled forward (training) raises. Then the same with the one-line model
fix, `out = out + ...` instead of `out.add_(...)` in `Llama4TextMoe.forward`: the grad-enabled
forward matches and every gradient matches. Exit 0: reproduced and the fix verified; 1: not
reproduced (fixed upstream); 2: reproduced but the fix did not verify.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB = 128
SIZES = dict(
    hidden_size=64,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    intermediate_size=128,
    intermediate_size_mlp=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    router_jitter_noise=0.0,
    attention_chunk_size=8,
    layer_types=["chunked_attention", "full_attention"],
    num_hidden_layers=2,
    vocab_size=VOCAB,
    use_cache=False,
)


def fixed_forward(self, hidden_states):
    """`Llama4TextMoe.forward` with `out = out + ...` for `out.add_(...)`
    (modeling_llama4.py:173)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_scores, router_logits = self.router(hidden_states)
    routed_in = hidden_states.repeat(router_scores.shape[1], 1)
    routed_in = routed_in * router_scores.transpose(0, 1).reshape(-1, 1)
    routed_out = self.experts(routed_in)
    out = self.shared_expert(hidden_states)
    out = out + routed_out.reshape(router_scores.shape[1], -1, routed_out.shape[-1]).sum(dim=0)
    return out, router_logits


def build(world, mesh):
    from transformers import Llama4ForCausalLM, Llama4TextConfig, initialization
    from transformers.distributed import DistributedConfig

    cfg = Llama4TextConfig(**SIZES)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)  # the same dense weights on every rank
    dense = Llama4ForCausalLM(cfg).float()
    with initialization.no_tie_weights():  # as from_pretrained builds a model it will shard
        tp = Llama4ForCausalLM(cfg).float()
    tp.load_state_dict(dense.state_dict(), strict=False)
    tp = Llama4ForCausalLM.maybe_distribute_model(tp, DistributedConfig(tp_size=world), mesh)
    tp.tie_weights()
    return dense, tp


def check(dense, tp, ids, labels) -> dict:
    """No-grad logits error, then the grad-enabled forward + backward (its error or exception)."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    res = {}
    with torch.no_grad():
        res["no-grad logits"] = (
            (dense(input_ids=ids).logits - tp(input_ids=ids).logits).abs().max().item()
        )
    try:
        a, b = dense(input_ids=ids).logits, tp(input_ids=ids).logits
    except RuntimeError as e:
        res["grad-enabled"] = f"raised {type(e).__name__}: {str(e).splitlines()[0][:90]}"
        return res
    res["grad-enabled logits"] = (a - b).abs().max().item()
    for logits in (a, b):
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).backward()
    tp_params = dict(tp.named_parameters())
    res["worst relative grad"] = max(
        ((full(tp_params[n].grad) - p.grad).abs().max() / (1e-6 + p.grad.abs().max())).item()
        for n, p in dense.named_parameters()
        if p.grad is not None
    )
    return res


def run(rank: int, world: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import initialize_distributed_mesh
    from transformers.models.llama4 import modeling_llama4

    _, mesh = initialize_distributed_mesh(DistributedConfig(tp_size=world))
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(2))
    res = {"as shipped": check(*build(world, mesh), ids, labels)}
    modeling_llama4.Llama4TextMoe.forward = fixed_forward
    res["fixed"] = check(*build(world, mesh), ids, labels)
    if rank == 0:
        out.update(
            {
                k: {n: (v if isinstance(v, str) else float(v)) for n, v in r.items()}
                for k, r in res.items()
            }
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
    for variant in ("as shipped", "fixed"):
        for key, value in out[variant].items():
            shown = value if isinstance(value, str) else f"{value:.3g}"
            print(f"{variant:>10}: {key}: {shown}")
    bug, fix = out["as shipped"], out["fixed"]
    if "grad-enabled" not in bug:
        print("NOT REPRODUCED: the grad-enabled forward runs (fixed upstream?)")
        return 1
    print("REPRODUCED: the grad-enabled (training) forward raises; the no-grad forward is right")
    ok = fix.get("grad-enabled logits", 1.0) < 1e-5 and fix.get("worst relative grad", 1.0) < 1e-4
    print(f"FIX {'VERIFIED' if ok else 'FAILED'}: out = out + ... in Llama4TextMoe.forward")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
