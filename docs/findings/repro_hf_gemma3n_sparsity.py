"""Gemma3n under TP: the activation-sparsity cutoff of a `colwise` gate_proj is computed from each
rank's column shard, not from the whole row, so every sparse layer's MLP is wrong.

    python docs/findings/repro_hf_gemma3n_sparsity.py

Plain torch + transformers (5.24.0) on 2 CPU/gloo ranks. `Gemma3nTextMLP._gaussian_topk`
(`models/gemma3n/modeling_gemma3n.py:959-973`) keeps the activations above
mean + std * icdf(sparsity), with mean and std over the last dim of gate_proj's output
(`:970-971`). The plan shards gate_proj `colwise` (`configuration_gemma3n.py:85`), whose output is
the rank's local columns, so each rank's cutoff comes from its half of the row.
Runs Gemma3nForCausalLM (a small config, every layer sparse as in the released model's first
layers) three ways: the plan as shipped; the plan with the sparse layers' MLP replicated (a rule
override, no code change); and the model code fixed (mean and std from the row's sum and sum of
squares all-reduced over the TP group). Prints the error of layer 0's MLP output and of the
logits against the dense model. Exit 0: reproduced and both fixes verified; 1: not reproduced
(fixed upstream); 2: reproduced but a fix did not verify.
"""

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB = 128
SIZES = dict(
    vocab_size=VOCAB,
    vocab_size_per_layer_input=VOCAB,
    hidden_size=64,
    hidden_size_per_layer_input=8,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    sliding_window=4,
    laurel_rank=64,
    num_kv_shared_layers=3,
    layer_types=["sliding_attention"] * 4 + ["full_attention"] + ["sliding_attention"] * 3,
    activation_sparsity_pattern=[0.95] * 8,
    use_cache=False,
)
REPLICATE_MLP = dict.fromkeys(
    ("model.layers.*.mlp.gate_proj", "model.layers.*.mlp.up_proj", "model.layers.*.mlp.down_proj"),
    "replicate",
)


def gaussian_topk_over_the_row(self, inputs: torch.Tensor) -> torch.Tensor:
    """`_gaussian_topk` with its statistics over the whole row when gate_proj is column-sharded."""
    from torch.distributed.nn.functional import all_reduce  # differentiable
    from torch.distributed.tensor import DTensor

    warnings.filterwarnings("ignore", "torch.distributed.nn.functional", FutureWarning)

    sparsity = torch.tensor(self.activation_sparsity, dtype=torch.float32, device=inputs.device)
    std_multiplier = torch.distributions.normal.Normal(0, 1).icdf(sparsity).type(inputs.dtype)
    stats = torch.cat([inputs.sum(-1, keepdim=True), (inputs * inputs).sum(-1, keepdim=True)], -1)
    n = inputs.shape[-1]
    weight = self.gate_proj.weight
    if isinstance(weight, DTensor):  # colwise: this rank holds n of the row's columns
        group = weight.device_mesh.get_group()
        stats = all_reduce(stats, group=group)
        n *= weight.device_mesh.size()
    mean = stats[..., :1] / n
    std = (stats[..., 1:] / n - mean * mean).clamp_min(0).sqrt()
    return torch.nn.functional.relu(inputs - (mean + std * std_multiplier))


def build(world: int, rules, mesh):
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig, initialization
    from transformers.distributed import DistributedConfig

    cfg = Gemma3nTextConfig(**SIZES)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)  # the same dense weights on every rank
    dense = Gemma3nForCausalLM(cfg).float().eval()
    with initialization.no_tie_weights():  # as from_pretrained builds a model it will shard
        tp = Gemma3nForCausalLM(cfg).float().eval()
    tp.load_state_dict(dense.state_dict(), strict=False)
    tp = Gemma3nForCausalLM.maybe_distribute_model(tp, DistributedConfig(world, rules), mesh)
    tp.tie_weights()
    return dense, tp


def forward(model, ids):
    seen = {}
    hook = model.model.layers[0].mlp.register_forward_hook(lambda m, a, o: seen.update(mlp=o))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    hook.remove()
    full = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in (seen["mlp"], logits)]
    return full


def run(rank: int, world: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import initialize_distributed_mesh
    from transformers.models.gemma3n import modeling_gemma3n

    _, mesh = initialize_distributed_mesh(DistributedConfig(tp_size=world))
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    shipped = modeling_gemma3n.Gemma3nTextMLP._gaussian_topk
    for variant in ("as shipped", "plan: sparse MLPs replicated", "code: cutoff over the row"):
        if variant.startswith("code"):
            modeling_gemma3n.Gemma3nTextMLP._gaussian_topk = gaussian_topk_over_the_row
        dense, tp = build(world, REPLICATE_MLP if variant.startswith("plan") else None, mesh)
        (want_mlp, want), (got_mlp, got) = forward(dense, ids), forward(tp, ids)
        errs = torch.tensor(
            [(got_mlp - want_mlp).abs().max().item(), (got - want).abs().max().item()]
        )
        gathered = [torch.zeros(2, dtype=errs.dtype) for _ in range(world)]
        dist.all_gather(gathered, errs)
        if rank == 0:
            out[variant] = dict(
                mlp=max(float(e[0]) for e in gathered),
                mlp_scale=want_mlp.abs().max().item(),
                logits=max(float(e[1]) for e in gathered),
                scale=want.abs().max().item(),
            )
        modeling_gemma3n.Gemma3nTextMLP._gaussian_topk = shipped
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
    for variant, r in out.items():
        print(
            f"{variant}: layer 0 MLP output max |TP - dense| {r['mlp']:.3g} (max |dense| "
            f"{r['mlp_scale']:.3g}); logits max |TP - dense| {r['logits']:.3g} "
            f"(max {r['scale']:.3g})"
        )
    bug = out["as shipped"]
    if bug["mlp"] <= 1e-3 * bug["mlp_scale"]:
        print("NOT REPRODUCED: the sparse MLP matches the dense model (fixed upstream?)")
        return 1
    print("REPRODUCED: each rank's sparsity cutoff comes from its own column shard")
    fixes = [v for v in out.keys() if v != "as shipped"]
    ok = [v for v in fixes if out[v]["mlp"] <= 1e-5 and out[v]["logits"] <= 1e-4]
    print(
        f"FIX {'VERIFIED' if ok == fixes else 'FAILED'}: logits match the dense model with: "
        f"{'; '.join(ok) or 'none'}"
    )
    return 0 if ok == fixes else 2


if __name__ == "__main__":
    sys.exit(main())
