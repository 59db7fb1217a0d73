"""ESMC under TP: `q_norm`/`k_norm` are LayerNorms over all heads' features (hidden_size), applied
to the `colwise` q_proj/k_proj output, which holds only this rank's heads: the forward raises.

    python docs/findings/repro_hf_esmc_qk_norm.py

Plain torch + transformers (5.24.0) on 2 CPU/gloo ranks, a 2-layer EsmcModel (hidden 32, 4 heads).
`EsmcAttention` normalizes the whole projection before splitting it into heads
(`models/esmc/modeling_esmc.py:206-207`, used at `:220-221`), while the plan shards q_proj/k_proj
by column (`configuration_esmc.py:56-57`). Runs the plan as shipped (raises at the norm,
`modeling_esmc.py:53`), then the fix: the norm's mean and variance from the row's sum and sum of
squares all-reduced over the TP group and this rank's slice of its weight (a model-code change,
patched in here), with `q_norm`/`k_norm` `replicated_with_grad_allreduce` (each rank's weight
gradient covers its slice only). Prints the hidden-state and gradient errors against the dense
model (one forward/backward). Exit 0: reproduced and the fix verified; 1: not reproduced (fixed
upstream); 2: reproduced but the fix did not verify.
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
    hidden_size=32,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=8,
    use_cache=False,
)
FIX = dict.fromkeys(
    ("layers.*.self_attn.q_norm", "layers.*.self_attn.k_norm"), "replicated_with_grad_allreduce"
)


def layer_norm_over_the_row(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """EsmcLayerNorm whose input may be this rank's column shard of the normalized features."""
    from torch.distributed.nn.functional import all_reduce  # differentiable

    n, local = self.normalized_shape[0], hidden_states.shape[-1]
    if local == n:
        return SHIPPED(self, hidden_states)
    warnings.filterwarnings("ignore", "torch.distributed.nn.functional", FutureWarning)
    x = hidden_states.float()
    stats = all_reduce(torch.cat([x.sum(-1, keepdim=True), (x * x).sum(-1, keepdim=True)], -1))
    mean = stats[..., :1] / n
    var = stats[..., 1:] / n - mean * mean
    cols = slice(dist.get_rank() * local, (dist.get_rank() + 1) * local)  # this rank's features
    out = (x - mean) * torch.rsqrt(var + self.eps) * self.weight[cols]
    if self.bias is not None:
        out = out + self.bias[cols]
    return out.to(hidden_states.dtype)


SHIPPED = None


def build(world: int, rules, mesh):
    from transformers import EsmcConfig, EsmcModel
    from transformers.distributed import DistributedConfig

    cfg = EsmcConfig(**SIZES)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)  # the same dense weights on every rank
    dense = EsmcModel(cfg).float()
    with torch.no_grad():
        for p in dense.parameters():  # norm weights off their init
            p.add_(0.1 * torch.randn_like(p))
    tp = EsmcModel(cfg).float()
    tp.load_state_dict(dense.state_dict())
    tp = EsmcModel.maybe_distribute_model(tp, DistributedConfig(tp_size=world, tp_plan=rules), mesh)
    return dense, tp


def check(dense, tp, ids, probe) -> dict:
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    want = dense(input_ids=ids).last_hidden_state
    try:
        got = full(tp(input_ids=ids).last_hidden_state)
    except (RuntimeError, AssertionError) as e:
        where, line = e.__traceback__, "?"
        while where is not None:
            if "modeling_esmc" in where.tb_frame.f_code.co_filename:
                line = f"modeling_esmc.py:{where.tb_lineno}"
            where = where.tb_next
        return {"raised": f"{type(e).__name__} at {line}: {str(e).splitlines()[0][:90]}"}
    (want * probe).sum().backward()
    (got * probe).sum().backward()
    tp_params = dict(tp.named_parameters())
    worst, name = max(
        (((full(tp_params[n].grad) - p.grad).abs().max() / (1e-6 + p.grad.abs().max())).item(), n)
        for n, p in dense.named_parameters()
        if p.grad is not None
    )
    return {
        "hidden": (got - want).abs().max().item(),
        "scale": want.abs().max().item(),
        "grad": worst,
        "grad_at": name,
    }


def run(rank: int, world: int, port: int, out) -> None:
    global SHIPPED
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import initialize_distributed_mesh
    from transformers.models.esmc import modeling_esmc

    _, mesh = initialize_distributed_mesh(DistributedConfig(tp_size=world))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 8), generator=g)
    probe = torch.randn(2, 8, SIZES["hidden_size"], generator=g)
    SHIPPED = modeling_esmc.EsmcLayerNorm.forward
    for variant in ("as shipped", "fixed"):
        if variant == "fixed":
            modeling_esmc.EsmcLayerNorm.forward = layer_norm_over_the_row
        res = check(*build(world, FIX if variant == "fixed" else None, mesh), ids, probe)
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        if rank == 0:
            out[variant] = gathered
    modeling_esmc.EsmcLayerNorm.forward = SHIPPED
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
        for rank, r in enumerate(out[variant]):
            shown = r.get("raised") or (
                f"max |hidden_TP - hidden_dense| {r['hidden']:.3g} (max {r['scale']:.3g}); "
                f"worst relative grad error {r['grad']:.3g} ({r['grad_at']})"
            )
            print(f"{variant} (rank {rank}): {shown}")
    if not all("raised" in r for r in out["as shipped"]):
        print("NOT REPRODUCED: the TP forward runs (fixed upstream?)")
        return 1
    print(
        "REPRODUCED: the TP forward raises at q_norm (a LayerNorm over all heads, given its shard)"
    )
    ok = all(
        "raised" not in r and r["hidden"] <= 1e-5 * r["scale"] and r["grad"] <= 1e-4
        for r in out["fixed"]
    )
    print(f"FIX {'VERIFIED' if ok else 'FAILED'}: the norm over the whole row, and {FIX}")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
