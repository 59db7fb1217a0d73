"""Llama4 (text) under transformers' TP plan raises in a grad-enabled forward: the MoE block adds
the routed experts' output *in place* into the shared expert's output, which under TP is the view
returned by `DTensor.to_local()` (rowwise `shared_expert.down_proj`), made inside an autograd
Function.

    python docs/findings/repro_hf_llama4_inplace_add.py

Plain torch + transformers on 2 CPU/gloo ranks. A 2-layer Llama4 text model (hidden 64, 8 heads,
4 KV heads, 4 experts; random weights, norms off their init) is saved with `save_pretrained` and
loaded on every rank with `AutoModelForCausalLM.from_pretrained(..., distributed_config=
DistributedConfig(tp_plan=...))`; the dense reference is the same checkpoint loaded without it.
- as shipped: the no-grad forward (transformers' local inference path) matches, the grad-enabled
  forward (training) raises;
- shipped styles: the shipped plan with the shared expert's gate/up/down_proj under `replicate`
  (its output is then a plain tensor on every rank);
- model code: `Llama4TextMoe.forward` monkeypatched in this process with `out = out + ...` for
  `out.add_(...)` (modeling_llama4.py:173), the plan as shipped.
Exit 0: reproduced and both fixes verified; 1: not reproduced; 2: a fix did not verify.
"""

import os
import socket
import sys
import tempfile

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
)
SHARED_EXPERT_REPLICATED = {  # DistributedConfig(tp_plan=...) overrides these rules
    f"model.layers.*.feed_forward.shared_expert.{proj}": "replicate"
    for proj in ("gate_proj", "up_proj", "down_proj")
}
VARIANTS = ("as shipped", "shipped styles", "model code")
KEYS = (
    "no-grad logits relative error",
    "grad-enabled logits relative error",
    "worst relative grad error",
)


def fixed_forward(self, hidden_states):
    """`Llama4TextMoe.forward` with `out = out + ...` for `out.add_(...)`."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_scores, router_logits = self.router(hidden_states)
    routed_in = hidden_states.repeat(router_scores.shape[1], 1)
    routed_in = routed_in * router_scores.transpose(0, 1).reshape(-1, 1)
    routed_out = self.experts(routed_in)
    out = self.shared_expert(hidden_states)
    out = out + routed_out.reshape(router_scores.shape[1], -1, routed_out.shape[-1]).sum(dim=0)
    return out, router_logits


def check(dense, tp, ids, labels) -> dict:
    """No-grad logits error, then the grad-enabled forward + backward (its error or exception)."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
    res = {}
    with torch.no_grad():
        res[KEYS[0]] = rel(tp(input_ids=ids).logits, dense(input_ids=ids).logits)
    try:
        a, b = dense(input_ids=ids).logits, tp(input_ids=ids).logits
    except RuntimeError as e:
        res["grad-enabled forward"] = f"raised RuntimeError: {str(e).splitlines()[0][:100]}"
        return res
    res[KEYS[1]] = rel(b, a)
    for logits in (a, b):
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).backward()
    tp_params = dict(tp.named_parameters())
    res[KEYS[2]] = max(
        rel(full(tp_params[n].grad), p.grad)
        for n, p in dense.named_parameters()
        if p.grad is not None
    )
    return res


def run(rank: int, world: int, port: int, path: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.models.llama4 import modeling_llama4

    g = torch.Generator().manual_seed(1)  # the same batch on every rank
    ids, labels = (torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(2))
    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for variant in VARIANTS:
        if variant == "model code":
            modeling_llama4.Llama4TextMoe.forward = fixed_forward  # the dense model too
        plan = SHARED_EXPERT_REPLICATED if variant == "shipped styles" else "auto"
        tp = AutoModelForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(tp_plan=plan), dtype=torch.float32
        )
        dense.zero_grad()
        out[(variant, rank)] = check(dense, tp, ids, labels)
        del tp
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    import accelerate
    import transformers
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"accelerate {accelerate.__version__}, 2 gloo ranks, float32"
    )
    # one intra-op thread: an OpenMP pool started here can hang the forked ranks' first matmul
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Llama4ForCausalLM(Llama4TextConfig(**SIZES))
    with torch.no_grad():
        for p in model.parameters():  # norm weights off their init (ones)
            p.add_(0.1 * torch.randn_like(p))
    path = tempfile.mkdtemp()
    model.save_pretrained(path)
    out = mp.Manager().dict()
    mp.start_processes(run, args=(2, free_port(), path, out), nprocs=2, start_method="fork")
    for variant in VARIANTS:
        for rank in (0, 1):
            for key, value in out[(variant, rank)].items():
                shown = value if isinstance(value, str) else f"{value:.3g}"
                print(f"{variant:>14}, rank {rank}: {key}: {shown}")
    res = {v: [out[(v, rank)] for rank in (0, 1)] for v in VARIANTS}
    if not all("grad-enabled forward" in r for r in res["as shipped"]):
        print("NOT REPRODUCED: the grad-enabled forward runs")
        return 1
    exact = all(r[KEYS[0]] < 1e-5 for r in res["as shipped"])
    print(
        "REPRODUCED: the grad-enabled (training) forward raises on every rank"
        f" (no-grad logits match the dense model: {exact})"
    )
    code = 0
    for variant, label, what in (
        ("shipped styles", "shipped styles", "shared_expert gate/up/down_proj under replicate"),
        ("model code", "model code", "out = out + ... in Llama4TextMoe.forward"),
    ):
        worst = max(r.get(key, 1.0) for r in res[variant] for key in KEYS)  # 1.0: it raised
        if worst < 1e-5:  # float32 rounding, relative to max |dense value| of each tensor
            print(f"FIX VERIFIED ({label}): {what}; worst relative error {worst:.2g}")
        else:
            print(f"FIX FAILED ({label}): {what}; worst relative error {worst:.2g}")
            code = 2
    return code


if __name__ == "__main__":
    sys.exit(main())
