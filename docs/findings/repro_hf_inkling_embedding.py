"""Inkling (text) cannot run under transformers' TP plan, and three rules are wrong:

1. `model.embed_tokens` gets `embedding_rowwise` (vocab-parallel) from transformers' default for a
   base model whose `embed_tokens` is an `nn.Embedding` (distributed/mixin.py:93-94), not from
   Inkling's plan. Inkling's embedding is an `nn.Embedding` subclass that applies an RMS norm inside
   its forward, so the norm runs on the rank's masked partial lookup before the sum: DTensor raises
   (and the value would be wrong: the norm of a partial sum is not a partial of the norm).
2. `mlp.shared_experts` is `all_reduce`, whose forward gets the sharded bare `nn.Parameter`s as
   DTensors while its input is a plain tensor: `torch.bmm` raises on the mix.
3. `mlp.experts.gate_up_proj` is `colwise`, which shards the packed [gate; up] rows as one block:
   rank 0 holds the gate rows only, rank 1 the up rows, and `chunk(2)` splits each rank's half
   again.

    python docs/findings/repro_hf_inkling_embedding.py

Plain torch + transformers (5.24.0) on 2 CPU/gloo ranks, a 2-layer InklingForCausalLM. Runs the
plan as shipped (raises), the plan with only the embedding rule fixed (raises at the shared
experts), then with the three overrides: `model.embed_tokens=replicate`, `mlp.shared_experts=`
a style that runs the module on its local shards and sums the output (defined here: `all_reduce`
with local parameters and the input's gradient summed), `mlp.experts.gate_up_proj=packed_colwise`.
Prints the logits and gradient errors. The same default reaches the other base models whose
`embed_tokens` is such a subclass and whose plan names no embedding rule: Muse Glimmer's text model
(`MuseGlimmerTextNormedEmbedding`, also inside `muse_glimmer`) and Muse Spark's
(`MuseSparkTextNormedEmbedding`): for each, the hidden states as shipped (raises at the norm) and
with `embed_tokens=replicate`. Exit 0: reproduced and the fix verified; 1: not reproduced
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
    hidden_size=64,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    sliding_window_size=4,
    swa_head_dim=8,
    layer_types=["hybrid_sliding", "hybrid"],
    num_hidden_layers=2,
    vocab_size=VOCAB,
    use_cache=False,
)
EMBED = {"model.embed_tokens": "replicate"}
FIX = {
    **EMBED,
    "model.layers.*.mlp.shared_experts": "local_all_reduce",
    "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
}


def register_fix() -> None:
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, AllReduceParallel

    class SumGradOfInput(torch.autograd.Function):
        """Identity forward; backward sums the ranks' partial input gradients."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    class LocalAllReduce(AllReduceParallel):
        """`all_reduce` for a module whose own sharded parameters its forward uses directly."""

        def should_use_local_tensors(self, module):
            return True

        def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
            def replicated(x):  # every rank's input gradient is its shard's part: sum them
                if isinstance(x, torch.Tensor) and torch.is_grad_enabled() and x.requires_grad:
                    return SumGradOfInput.apply(x, mesh.get_group())
                return x

            return tuple(map(replicated, args)), {k: replicated(v) for k, v in kwargs.items()}

    ALL_PARALLEL_STYLES.register("local_all_reduce", LocalAllReduce())


def build(world, mesh, rules):
    from transformers import InklingForCausalLM, InklingTextConfig, initialization
    from transformers.distributed import DistributedConfig

    cfg = InklingTextConfig(**SIZES)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)  # the same dense weights on every rank
    dense = InklingForCausalLM(cfg).float()
    with initialization.no_tie_weights():  # as from_pretrained builds a model it will shard
        tp = InklingForCausalLM(cfg).float()
    tp.load_state_dict(dense.state_dict(), strict=False)
    dc = DistributedConfig(tp_size=world, tp_plan=rules)
    tp = InklingForCausalLM.maybe_distribute_model(tp, dc, mesh)
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
                if "modeling_inkling" in where.tb_frame.f_code.co_filename:
                    line = f"modeling_inkling.py:{where.tb_lineno}"
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


# the same default on other normed embeddings: model class -> its config (2 layers, tiny)
REACH = {
    "MuseGlimmerTextModel": ("MuseGlimmerTextConfig", dict(hidden_activation="silu")),
    "MuseSparkTextModel": (
        "MuseSparkTextConfig",
        dict(
            moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, moe_hidden_size=64
        ),
    ),
}
REACH_SIZES = dict(
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
)


def reach(model_cls: str, world, mesh, ids) -> dict:
    """A base model's hidden states as shipped and with `embed_tokens=replicate`."""
    import transformers
    from transformers import initialization
    from transformers.distributed import DistributedConfig

    config_cls, extra = REACH[model_cls]
    cfg = getattr(transformers, config_cls)(**REACH_SIZES, **extra)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    cls = getattr(transformers, model_cls)
    res = {}
    for variant, rules in (
        ("as shipped", None),
        ("embed_tokens=replicate", {"embed_tokens": "replicate"}),
    ):
        torch.manual_seed(0)
        dense = cls(cfg).float()
        with initialization.no_tie_weights():
            tp = cls(cfg).float()
        tp.load_state_dict(dense.state_dict(), strict=False)
        tp = cls.maybe_distribute_model(tp, DistributedConfig(tp_size=world, tp_plan=rules), mesh)
        with torch.no_grad():
            want = dense(input_ids=ids).last_hidden_state
            try:
                got = tp(input_ids=ids).last_hidden_state
            except (RuntimeError, AssertionError) as e:
                where, line = e.__traceback__, "?"
                while where is not None:
                    name = where.tb_frame.f_code.co_filename
                    if "/models/" in name:
                        line = f"{name.rsplit('/', 1)[1]}:{where.tb_lineno}"
                    where = where.tb_next
                res[variant] = f"raised {type(e).__name__} at {line}"
                continue
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        res[variant] = (got - want).abs().max().item() / want.abs().max().item()
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
    for variant, rules in (("as shipped", None), ("embedding fixed", EMBED), ("fixed", FIX)):
        res = check(*build(world, mesh, rules), ids, labels)
        if rank == 0:
            out[variant] = res
    for model_cls in REACH:
        res = reach(model_cls, world, mesh, ids)
        if rank == 0:
            out[model_cls] = res
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
    for variant in ("as shipped", "embedding fixed", "fixed"):
        for key, value in out[variant].items():
            shown = value if isinstance(value, str) else f"{value:.3g}"
            print(f"{variant:>15}: {key}: {shown}")
    for model_cls in REACH:
        for variant, value in out[model_cls].items():
            shown = (
                value if isinstance(value, str) else f"max relative hidden-state error {value:.3g}"
            )
            print(f"{model_cls} ({variant}): {shown}")
    bug, fix = out["as shipped"], out["fixed"]
    if "no-grad" not in bug and "grad-enabled" not in bug:
        print("NOT REPRODUCED: the TP forward runs (fixed upstream?)")
        return 1
    print("REPRODUCED: the TP forward raises at the vocab-parallel normed embedding")
    reached = [m for m in REACH if isinstance(out[m]["as shipped"], str)]
    print(f"REPRODUCED also (raises at the normed embedding): {', '.join(reached) or 'none'}")
    ok = (
        fix.get("grad-enabled max |logits_TP - logits_dense|", 1.0) < 1e-6
        and float(fix.get("worst relative grad error", "1").split()[0]) < 1e-4
        and all(out[m]["embed_tokens=replicate"] < 1e-5 for m in reached)
    )
    print(
        f"FIX {'VERIFIED' if ok else 'FAILED'}: {FIX}; {', '.join(reached)}: embed_tokens=replicate"
    )
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
