"""GLM-5 Next's TP plan cannot run: its rule `layers.*.self_attn.o_proj: rowwise` matches the output
projection of both kinds of attention layer, but only the MLA layers shard their heads (q_b_proj,
kv_b_proj colwise). The linear-attention layers' projections have no rule, so their attention
output keeps every head, and `o_proj`, sharded rowwise, gets the whole input where it expects this
rank's slice: the forward raises at modeling_glm5_next.py:767 (`output = self.o_proj(output)`).
A transformers plan cannot give one layer its own rule: a module is looked up by its name with the
layer numbers as `*` (distributed/parallel_utils.py:59-61).

    python docs/findings/repro_hf_glm5_next_o_proj.py

Plain torch + transformers (5.24.0) on 2 CPU/gloo ranks, a 2-layer Glm5NextTextModel (one
linear-attention layer, one indexed-attention MLA layer, as the default config interleaves them;
hidden 32) in float64, so that what is left is rounding at float64's resolution. The fix is a plan
change with one custom style (verified: the last hidden state and every gradient match): `o_proj`
rowwise whatever way its input arrives, this rank's slice (the MLA layers) or the whole (the
linear-attention layers: split here, as `rowwise_split_input` does). Exit 0: reproduced and the fix
verified; 1: not reproduced (fixed upstream); 2: reproduced but the fix did not verify.
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
    hidden_size=32,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    q_lora_rank=16,
    v_head_dim=8,
    qk_nope_head_dim=8,
    qk_head_dim=8,
    index_head_dim=8,
    index_n_heads=4,
    linear_head_dim=8,
    mlp_layer_types=["dense", "dense"],
    layer_types=["linear_attention", "indexed_attention"],
    indexer_types=["full", "full"],
    pad_token_id=VOCAB - 1,
    use_cache=False,
)
FIX = {"layers.*.self_attn.o_proj": "rowwise_any_input"}


def register_fix() -> None:
    from torch.distributed.tensor import DTensor, Replicate
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, RowwiseParallel

    class RowwiseAnyInput(RowwiseParallel):
        """rowwise; an input as wide as the module's in_features (every head) is split here."""

        def __init__(self):
            super().__init__()
            self.whole = RowwiseParallel(input_layouts=Replicate())

        def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
            x = args[0]
            if not isinstance(x, DTensor) and x.shape[-1] == module.in_features:
                return self.whole.transform_inputs_pre_forward(module, args, kwargs, mesh)
            return super().transform_inputs_pre_forward(module, args, kwargs, mesh)

    ALL_PARALLEL_STYLES.register("rowwise_any_input", RowwiseAnyInput())


def build(world, mesh, rules):
    from transformers import Glm5NextTextConfig, Glm5NextTextModel, initialization
    from transformers.distributed import DistributedConfig

    cfg = Glm5NextTextConfig(**SIZES)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)  # the same dense weights on every rank
    dense = Glm5NextTextModel(cfg).double()
    with initialization.no_tie_weights():  # as from_pretrained builds a model it will shard
        tp = Glm5NextTextModel(cfg).double()
    tp.load_state_dict(dense.state_dict(), strict=False)
    dc = DistributedConfig(tp_size=world, tp_plan=rules)
    tp = Glm5NextTextModel.maybe_distribute_model(tp, dc, mesh)
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
                if "modeling_glm5_next" in where.tb_frame.f_code.co_filename:
                    line = f"modeling_glm5_next.py:{where.tb_lineno}"
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
    ids = torch.randint(0, VOCAB - 1, (2, 8), generator=g)
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
    print("REPRODUCED: the TP forward raises: o_proj's rule matches the linear-attention layers")
    ok = (
        fix.get("grad-enabled max |h_TP - h_dense|", 1.0) < 1e-9
        and float(fix.get("worst relative grad error", "1").split()[0]) < 1e-9
    )
    print(f"FIX {'VERIFIED' if ok else 'FAILED'}: {FIX}")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
