"""GLM-5 Next's TP plan cannot run: its rule `layers.*.self_attn.o_proj: rowwise` matches the output
projection of both kinds of attention layer, but only the MLA layers shard their heads (q_b_proj,
kv_b_proj colwise). The linear-attention layers' projections have no rule, so their attention
output keeps every head, and `o_proj`, sharded rowwise, gets the whole input where it expects this
rank's slice: the forward raises at modeling_glm5_next.py:767 (`output = self.o_proj(output)`).

    python docs/findings/repro_hf_glm5_next_o_proj.py

Plain torch + transformers on 2 CPU/gloo ranks. A 2-layer Glm5NextTextModel (one linear-attention
layer, one indexed-attention MLA layer, as the default config interleaves them; hidden 32;
constant-initialised parameters perturbed) is saved with `save_pretrained` and loaded on every
rank with `from_pretrained(dir, distributed_config=DistributedConfig(tp_plan=...))`; the dense
reference is the same `from_pretrained(dir)`. Plans (a dict passed as `tp_plan` is merged over the
model's own):
  as shipped: "auto".
  shipped-styles fix: the MLA's q_b_proj/kv_b_proj `colwise_gather_output`, o_proj
    `rowwise_split_input` (the OLMo2 pattern: both kinds of layer hand o_proj every head).
  faster fix: o_proj under a style defined here that splits its input only when it arrives whole
    (the linear-attention layers) and is `rowwise` otherwise (the MLA layers stay head-sharded).
Each is checked in float32: the last hidden state (no-grad and grad-enabled) and every parameter's
gradient of an MSE loss vs the dense model, relative to the largest dense value. Exit 0: reproduced
and both fixes verified; 1: not reproduced (fixed upstream?); 2: a fix did not verify.
"""

import os
import socket
import sys
import tempfile

import torch
import torch.multiprocessing as mp

VOCAB, WORLD = 128, 2
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=128, num_hidden_layers=2)
SIZES.update(num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4)
SIZES.update(moe_intermediate_size=32, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16)
SIZES.update(v_head_dim=8, qk_nope_head_dim=8, qk_head_dim=8, index_head_dim=8, index_n_heads=4)
SIZES.update(linear_head_dim=8, mlp_layer_types=["dense", "dense"], indexer_types=["full"] * 2)
SIZES.update(layer_types=["linear_attention", "indexed_attention"], pad_token_id=VOCAB - 1)
SHIPPED_FIX = {
    "layers.*.self_attn.q_b_proj": "colwise_gather_output",
    "layers.*.self_attn.kv_b_proj": "colwise_gather_output",
    "layers.*.self_attn.o_proj": "rowwise_split_input",
}
FASTER_FIX = {"layers.*.self_attn.o_proj": "rowwise_any_input"}
VARIANTS = {"as shipped": "auto", "shipped styles": SHIPPED_FIX, "faster": FASTER_FIX}
FIXES = {
    "shipped styles": "q_b_proj/kv_b_proj colwise_gather_output, o_proj rowwise_split_input",
    "faster": "o_proj rowwise, splitting its input itself where it arrives whole",
}
OUT_TOL, GRAD_TOL = 1e-5, 1e-4  # relative to max |dense value|


def register_faster_style() -> None:
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


def where_raised(e: BaseException) -> str:
    """The exception, where it was raised: the model file, tensor_parallel.py, innermost."""
    tb, lines = e.__traceback__, []
    while tb is not None:
        lines.append(f"{os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}")
        tb = tb.tb_next
    at = [
        [x for x in lines if x.startswith(f)][-1:]
        for f in ("modeling_glm5_next", "tensor_parallel")
    ]
    at = dict.fromkeys(at[0] + at[1] + lines[-1:])  # in order, without repeats
    return f"raised {type(e).__name__} at {' -> '.join(at)}: {str(e).splitlines()[0][:80]}"


def check(dense, tp, ids, target) -> dict:
    """Output error of the no-grad and grad-enabled forwards (or the exception), then gradients."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    res = {}
    for grad in (False, True):
        tag = "grad-enabled" if grad else "no-grad"
        try:
            with torch.set_grad_enabled(grad):
                a = dense(input_ids=ids).last_hidden_state
                b = full(tp(input_ids=ids).last_hidden_state)
        except (RuntimeError, AssertionError) as e:
            res[tag] = where_raised(e)
            continue
        res[f"{tag} hidden rel err"] = ((a - b).abs().max() / a.abs().max()).item()
    if "grad-enabled hidden rel err" not in res:
        return res
    for h in (a, b):
        torch.nn.functional.mse_loss(h, target).backward()
    tp_params, worst = dict(tp.named_parameters()), (-1.0, "")
    for name, p in dense.named_parameters():
        g = tp_params[name].grad
        if p.grad is None or g is None:  # the indexer's (top-k selection): no gradient in either
            worst = max(worst, (0.0 if p.grad is g else float("inf"), name))
            continue
        g = full(g)  # a replicated parameter: each rank checks its own copy
        worst = max(worst, (((g - p.grad).abs().max() / p.grad.abs().max()).item(), name))
    res["worst grad rel err"] = worst
    return res


def run(rank: int, port: int, path: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    from transformers import AutoModel
    from transformers.distributed import DistributedConfig
    from transformers.utils import logging

    logging.disable_progress_bar()
    register_faster_style()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB - 1, (2, 8), generator=g)
    target = torch.randn(2, 8, SIZES["hidden_size"], generator=g)
    for variant, plan in VARIANTS.items():
        dense = AutoModel.from_pretrained(path, dtype=torch.float32)
        dc = DistributedConfig(tp_plan=plan)
        tp = AutoModel.from_pretrained(path, distributed_config=dc, dtype=torch.float32)
        out[(variant, rank)] = check(dense, tp, ids, target)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    import accelerate
    import transformers
    from transformers import Glm5NextTextConfig, Glm5NextTextModel

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"{versions}, accelerate {accelerate.__version__}, {WORLD} gloo ranks, float32")
    torch.manual_seed(0)
    model = Glm5NextTextModel(Glm5NextTextConfig(**SIZES, use_cache=False))
    with torch.no_grad():  # norms (ones) and other constant-initialised parameters
        for p in model.parameters():
            if p.min() == p.max():
                p.add_(0.5 * torch.randn_like(p))
    path = tempfile.mkdtemp()
    model.save_pretrained(path)
    out = mp.Manager().dict()
    mp.start_processes(run, args=(free_port(), path, out), nprocs=WORLD, start_method="fork")
    for variant, rank in ((v, r) for v in VARIANTS for r in range(WORLD)):
        for key, value in out[(variant, rank)].items():
            shown = f"{value[0]:.3g} ({value[1]})" if isinstance(value, tuple) else value
            shown = f"{value:.3g}" if isinstance(value, float) else shown
            print(f"{variant:>15}, rank {rank}: {key}: {shown}")
    bug = [out[("as shipped", r)] for r in range(WORLD)]
    if not any("raised" in str(v) for res in bug for v in res.values()):
        print("NOT REPRODUCED: the TP forward runs (fixed upstream?)")
        return 1
    print("REPRODUCED: the TP forward raises: o_proj's rule matches the linear-attention layers")
    code = 0
    for variant, what in FIXES.items():
        res = [out[(variant, r)] for r in range(WORLD)]
        ok = all(
            r.get("no-grad hidden rel err", 1.0) < OUT_TOL
            and r.get("grad-enabled hidden rel err", 1.0) < OUT_TOL
            and r.get("worst grad rel err", (1.0,))[0] < GRAD_TOL
            for r in res
        )
        if ok:
            print(f"FIX VERIFIED ({variant}): {what}")
        else:
            print(f"FIX FAILED ({variant}): {what}: {res}")
            code = 2
    return code


if __name__ == "__main__":
    sys.exit(main())
