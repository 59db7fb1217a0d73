"""transformers' `replicated_with_grad_allreduce` style all-reduces the *accumulated* `.grad` after
every backward, so with gradient accumulation the early micro-batches are counted world-size times.

    python docs/findings/repro_hf_grad_allreduce.py

Plain torch + transformers on 2 CPU/gloo ranks. A 1-layer Qwen3 (hidden 64, 8 heads, 4 KV heads,
random weights, norm weights off their init) is saved with `save_pretrained`, then loaded on every
rank with `from_pretrained(..., distributed_config=DistributedConfig(tp_plan=...))`; the dense
reference is the same checkpoint loaded without it. 1, 2 and 3 micro-batches, gradients compared:
- as shipped: Qwen3's plan (`q_norm`/`k_norm` under `replicated_with_grad_allreduce`);
- shipped styles: the OLMo2 pattern, q/k/v `colwise_gather_output`, o_proj `rowwise_split_input`,
  q_norm/k_norm `replicate` (every rank sees all heads, so their gradients are complete);
- faster: the plan as shipped, with `ReplicatedWithGradAllReduce` patched in this process to reduce
  each backward's gradient as it arrives (`param.register_hook`), the proposed upstream change.
Exit 0: reproduced and both fixes verified; 1: not reproduced; 2: a fix did not verify.
"""

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NAME = "model.layers.0.self_attn.q_norm.weight"
VOCAB = 128
GATHERED_HEADS = {  # DistributedConfig(tp_plan=...) overrides these rules of the shipped plan
    "model.layers.*.self_attn.q_proj": "colwise_gather_output",
    "model.layers.*.self_attn.k_proj": "colwise_gather_output",
    "model.layers.*.self_attn.v_proj": "colwise_gather_output",
    "model.layers.*.self_attn.o_proj": "rowwise_split_input",
    "model.layers.*.self_attn.q_norm": "replicate",
    "model.layers.*.self_attn.k_norm": "replicate",
}
VARIANTS = ("as shipped", "shipped styles", "faster")


def reduce_on_arrival(self, module, mesh):
    """`ReplicatedWithGradAllReduce.install_forward` with the proposed change: a tensor hook that
    all-reduces this backward's gradient before autograd accumulates it into `.grad`."""
    original_forward = module.forward
    is_already_hooked = {}

    def _all_reduce_grad(grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=mesh.get_group())
        return grad

    def tp_forward(*args, **kwargs):
        if torch.is_grad_enabled():
            for name, param in module.named_parameters(recurse=False):
                if param.requires_grad and is_already_hooked.get(name) is not param:
                    param.register_hook(_all_reduce_grad)
                    is_already_hooked[name] = param
        return original_forward(*args, **kwargs)

    module.forward = tp_forward
    return module


def run(rank: int, world: int, port: int, path: str, out) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig, tensor_parallel

    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    for variant in VARIANTS:
        if variant == "faster":
            tensor_parallel.ReplicatedWithGradAllReduce.install_forward = reduce_on_arrival
        plan = GATHERED_HEADS if variant == "shipped styles" else "auto"
        tp = AutoModelForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(tp_plan=plan), dtype=torch.float32
        )
        g = torch.Generator().manual_seed(1)  # the same batches on every rank
        for micro_batches in (1, 2, 3):
            dense.zero_grad()
            tp.zero_grad()
            fwd = 0.0  # max |logits_TP - logits_dense| / max |logits_dense|
            for _ in range(micro_batches):
                ids, labels = (torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(2))
                logits = [model(input_ids=ids).logits for model in (dense, tp)]
                fwd = max(fwd, ((logits[1] - logits[0]).abs().max() / logits[0].abs().max()).item())
                for lg in logits:
                    loss = torch.nn.functional.cross_entropy(
                        lg.reshape(-1, VOCAB), labels.reshape(-1)
                    )
                    (loss / micro_batches).backward()
            tp_params = dict(tp.named_parameters())
            rel = {  # max |grad_TP - grad_dense| / max |grad_dense|, per parameter
                n: ((full(tp_params[n].grad) - p.grad).abs().max() / p.grad.abs().max()).item()
                for n, p in dense.named_parameters()
            }
            worst = max(rel, key=rel.get)
            want = dict(dense.named_parameters())[NAME].grad
            err = (full(tp_params[NAME].grad) - want).abs().max().item()
            scale = want.abs().max().item()
            out[(variant, micro_batches, rank)] = (fwd, err, scale, worst, rel[worst])
        del tp
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    import accelerate
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"accelerate {accelerate.__version__}, 2 gloo ranks, float32"
    )
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        num_hidden_layers=1,
    )
    # one intra-op thread: an OpenMP pool started here can hang the forked ranks' first matmul
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # norm weights off their init (ones)
            p.add_(0.1 * torch.randn_like(p))
    path = tempfile.mkdtemp()
    model.save_pretrained(path)
    out = mp.Manager().dict()
    mp.start_processes(run, args=(2, free_port(), path, out), nprocs=2, start_method="fork")
    ok = {}
    for (variant, mb, rank), (fwd, err, scale, worst, rel) in sorted(
        out.items(), key=lambda kv: (VARIANTS.index(kv[0][0]), kv[0][1:])
    ):
        print(
            f"{variant:>14}, {mb} micro-batch(es), rank {rank}: logits relative {fwd:.2g}; "
            f"max |grad_TP - grad_dense| of "
            f"q_norm.weight {err:.3g} (max |grad_dense| {scale:.3g}, relative {err / scale:.3g}); "
            f"worst relative over all grads {rel:.3g} ({worst})"
        )
        ok.setdefault(variant, {})[(mb, rank)] = (err / scale, max(rel, fwd))
    # float32 rounding: 1e-5 relative to each parameter's max |grad_dense|
    shipped = ok["as shipped"]
    bug = all(shipped[(2, r)][0] > 0.1 for r in (0, 1))
    exact_one = all(shipped[(1, r)][1] < 1e-5 for r in (0, 1))
    if not bug:
        print("NOT REPRODUCED: accumulated q_norm gradients match the dense model")
        return 1
    print(
        "REPRODUCED: with 2+ micro-batches the q_norm/k_norm gradients are wrong on every rank"
        f" (every gradient exact with 1 micro-batch: {exact_one})"
    )
    code = 0
    for variant, what in (
        (
            "shipped styles",
            "q/k/v colwise_gather_output, o_proj rowwise_split_input, q_norm/k_norm replicate",
        ),
        (
            "faster",
            "replicated_with_grad_allreduce reducing each gradient on arrival (register_hook)",
        ),
    ):
        worst = max(rel for _, rel in ok[variant].values())
        if worst < 1e-5:
            print(f"FIX VERIFIED ({variant}): {what}; worst relative grad error {worst:.2g}")
        else:
            print(f"FIX FAILED ({variant}): {what}; worst relative grad error {worst:.2g}")
            code = 2
    return code


if __name__ == "__main__":
    sys.exit(main())
