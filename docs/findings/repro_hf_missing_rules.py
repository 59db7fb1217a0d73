"""Plans with no rule for a replicated parameter whose gradient is partial: the parameter acts on
this rank's heads (or FFN columns) only, so each rank's gradient is its share of the dense one and,
with no rule to sum them, the ranks' replicas get different, wrong gradients (one micro-batch, no
accumulation needed).

    python docs/findings/repro_hf_missing_rules.py

Plain torch + transformers (5.24.0) on 2 CPU/gloo ranks, one forward/backward each of:
- sarvam_moe (Glm4MoeForCausalLM, `use_qk_norm=True`): `self_attn.q_norm`/`k_norm`, no rule;
- qwen3_vl_moe's text model (Qwen3VLMoeTextModel): `self_attn.q_norm`/`k_norm`, no rule;
- apertus (ApertusForCausalLM): the xIELU activation's `mlp.act_fn.alpha_p`/`alpha_n`, no rule.
For each: the plan as shipped, then the plan with the missing rules added
(`replicated_with_grad_allreduce`, transformers' own style for this case). Prints the gradient error
of the parameter on each rank, the error of the ranks' *sum* (0: a partial sum), and the largest
error over every parameter's gradient. Exit 0: reproduced and the fix verified; 1: not reproduced
(fixed upstream); 2: reproduced but the fix did not verify.
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB = 128
CASES = {
    "sarvam_moe": dict(
        config="SarvamMoEConfig",
        model="Glm4MoeForCausalLM",
        sizes=dict(
            hidden_size=64,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=8,
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            num_hidden_layers=2,
        ),
        param="model.layers.0.self_attn.q_norm.weight",
        fix=("model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm"),
    ),
    "qwen3_vl_moe_text": dict(
        config="Qwen3VLMoeTextConfig",
        model="Qwen3VLMoeTextModel",
        sizes=dict(
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=8,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
        ),
        param="layers.0.self_attn.q_norm.weight",
        fix=("layers.*.self_attn.q_norm", "layers.*.self_attn.k_norm"),
    ),
    "apertus": dict(
        config="ApertusConfig",
        model="ApertusForCausalLM",
        sizes=dict(
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=128,
            num_hidden_layers=2,
        ),
        param="model.layers.0.mlp.act_fn.alpha_p",
        fix=("model.layers.*.mlp.act_fn",),
    ),
}


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def build(case: dict, world: int, rules, mesh):
    import transformers
    from transformers import initialization
    from transformers.distributed import DistributedConfig

    cfg = getattr(transformers, case["config"])(vocab_size=VOCAB, use_cache=False, **case["sizes"])
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    cls = getattr(transformers, case["model"])
    torch.manual_seed(0)  # the same dense weights on every rank
    dense = cls(cfg).float()
    with torch.no_grad():
        for p in dense.parameters():  # norm weights and activation scalars off their init
            p.add_(0.1 * torch.randn_like(p))
    with initialization.no_tie_weights():  # as from_pretrained builds a model it will shard
        tp = cls(cfg).float()
    tp.load_state_dict(dense.state_dict(), strict=False)
    dc = DistributedConfig(tp_size=world, tp_plan=rules)
    tp = cls.maybe_distribute_model(tp, dc, mesh)
    tp.tie_weights()
    return dense, tp


def loss_of(model, ids, labels, probe):
    out = model(input_ids=ids)
    if hasattr(out, "logits"):
        return torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1))
    return (out.last_hidden_state * probe).sum()  # a base model: its hidden states


def run(rank: int, world: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import initialize_distributed_mesh

    _, mesh = initialize_distributed_mesh(DistributedConfig(tp_size=world))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    labels = torch.randint(0, VOCAB, (2, 8), generator=g)
    for arch, case in CASES.items():
        for variant in ("as shipped", "fixed"):
            rules = dict.fromkeys(case["fix"], "replicated_with_grad_allreduce")
            dense, tp = build(case, world, rules if variant == "fixed" else None, mesh)
            probe = torch.randn(  # the same for both variants
                2, 8, case["sizes"]["hidden_size"], generator=torch.Generator().manual_seed(2)
            )
            for model in (dense, tp):
                loss_of(model, ids, labels, probe).backward()
            want = dict(dense.named_parameters())[case["param"]].grad
            got = full(dict(tp.named_parameters())[case["param"]].grad)
            summed = got.clone()
            dist.all_reduce(summed)
            worst = 0.0
            tp_params = dict(tp.named_parameters())
            for name, p in dense.named_parameters():
                if p.grad is not None:
                    err = (full(tp_params[name].grad) - p.grad).abs().max().item()
                    worst = max(worst, err / (1e-6 + p.grad.abs().max().item()))
            errs = torch.tensor([(got - want).abs().max().item(), worst])
            gathered = [torch.zeros(2, dtype=errs.dtype) for _ in range(world)]
            dist.all_gather(gathered, errs)
            if rank == 0:
                out[(arch, variant)] = dict(
                    per_rank=[float(e[0]) for e in gathered],
                    sum_err=(summed - want).abs().max().item(),
                    scale=want.abs().max().item(),
                    worst=max(float(e[1]) for e in gathered),
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
    reproduced, fixed = [], []
    for arch, case in CASES.items():
        for variant in ("as shipped", "fixed"):
            r = out[(arch, variant)]
            print(
                f"{arch} ({variant}): {case['param']}: max |grad_TP - grad_dense| per rank "
                f"{', '.join(f'{e:.3g}' for e in r['per_rank'])}; of the ranks' sum "
                f"{r['sum_err']:.3g} (max |grad_dense| {r['scale']:.3g}); worst relative grad "
                f"error over all parameters {r['worst']:.3g}"
            )
        bug, fix = out[(arch, "as shipped")], out[(arch, "fixed")]
        if min(bug["per_rank"]) > 0.1 * bug["scale"] and bug["sum_err"] <= 1e-5 * bug["scale"]:
            reproduced.append(arch)
        if fix["worst"] <= 1e-4:
            fixed.append(arch)
    if not reproduced:
        print("NOT REPRODUCED: every gradient matches the dense model (fixed upstream?)")
        return 1
    print(f"REPRODUCED (the ranks' gradients are partial sums): {', '.join(reproduced)}")
    ok = set(reproduced) <= set(fixed)
    print(
        f"FIX {'VERIFIED' if ok else 'FAILED'}: with the missing rules every gradient matches: "
        f"{', '.join(fixed) or 'none'}"
    )
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
