"""Gemma3n under tensor parallelism: each rank computes the activation-sparsity cutoff of a sparse
layer's MLP from its own column shard of gate_proj's output, so the MLP is silently wrong.

    python docs/findings/repro_hf_gemma3n_sparsity.py

Plain torch + transformers on 2 CPU/gloo ranks. Builds a tiny Gemma3nForCausalLM (every layer
sparse at 0.95, as the released models' first 10 layers), saves it with `save_pretrained`, loads it
on every rank with `from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))` and
compares it with the same checkpoint loaded dense: the logits with no grad, layer 0's MLP output,
then every parameter gradient of one backward. `Gemma3nTextMLP._gaussian_topk`
(models/gemma3n/modeling_gemma3n.py:959-973) keeps gate_proj's outputs above mean + 1.645 * std,
with mean and std over the last dim (:970-971), which the plan's `colwise` gate_proj
(configuration_gemma3n.py:85) leaves sharded. Runs the plan as shipped, then two fixes:
  1. shipped styles: `model.layers.*.mlp.{gate,up,down}_proj: replicate`, passed as
     `DistributedConfig(tp_plan={...})`, whose rules override the shipped plan's;
  2. model code (monkeypatched here): mean and std from the row's sum and sum of squares, in
     float32, all-reduced over the TP mesh's process group.
The reference is always the dense model running the shipped code. Tolerances (relative to the
dense values' max): 1e-5 for the MLP output, 1e-4 for the logits, 1e-3 for each gradient; the
sparsity cutoff amplifies rounding, and the script prints that floor (the dense model with the
statistics computed as in fix 2, against the shipped dense model).
Exit 0: reproduced and both fixes verified; 1: not reproduced; 2: a fix failed.
"""

import os
import socket
import sys
import tempfile
import warnings

import torch
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
MLP = ("gate_proj", "up_proj", "down_proj")
VARIANTS = {  # name -> (tp_plan, patch the model code)
    "as shipped": ("auto", False),
    "shipped styles (the MLPs' gate/up/down_proj: replicate)": (
        {f"model.layers.*.mlp.{p}": "replicate" for p in MLP},
        False,
    ),
    "model code (the cutoff from the whole row's statistics)": ("auto", True),
}


def gaussian_topk_over_the_row(self, inputs: torch.Tensor) -> torch.Tensor:
    """`_gaussian_topk` with mean and std over the whole row when gate_proj is column-sharded."""
    from torch.distributed.nn.functional import all_reduce  # differentiable
    from torch.distributed.tensor import DTensor

    sparsity = torch.tensor(self.activation_sparsity, dtype=torch.float32, device=inputs.device)
    std_multiplier = torch.distributions.normal.Normal(0, 1).icdf(sparsity)
    x = inputs.float()
    stats = torch.stack([x.sum(-1), x.square().sum(-1)], dim=-1)
    n = inputs.shape[-1]
    if isinstance(self.gate_proj.weight, DTensor):  # colwise: this rank holds n of the row
        mesh = self.gate_proj.weight.device_mesh
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            stats = all_reduce(stats, group=mesh.get_group())
        n *= mesh.size()
    mean = stats[..., :1] / n
    std = (stats[..., 1:] / n - mean.square()).clamp_min(0).sqrt()
    return torch.nn.functional.relu(inputs - (mean + std * std_multiplier).to(inputs.dtype))


def measure(model, ids, labels, dense=None) -> dict:
    """No-grad logits and layer 0's MLP output, then loss.backward(); errors are relative to
    the dense model's scale: max |TP - dense| / max |dense|."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    seen = {}
    hook = model.model.layers[0].mlp.register_forward_hook(lambda m, a, o: seen.update(mlp=o))
    with torch.no_grad():
        res = {"logits": full(model(input_ids=ids).logits), "mlp": full(seen["mlp"])}
    hook.remove()
    model(input_ids=ids, labels=labels).loss.backward()
    res["grads"] = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    if dense is not None:
        for key in ("logits", "mlp"):
            err = (res[key] - dense[key]).abs().max() / dense[key].abs().max()
            res[f"{key} error"] = err.item()
        res["grad error"], res["worst"] = max(
            ((res["grads"][n] - g).abs().max().item() / g.abs().max().item(), n)
            for n, g in dense["grads"].items()
            if g.abs().max() > 0
        )
    return res


def run(rank: int, world: int, port: int, ckpt: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.models.gemma3n import modeling_gemma3n

    mlp = modeling_gemma3n.Gemma3nTextMLP
    shipped = mlp._gaussian_topk
    g = torch.Generator().manual_seed(1)
    ids, labels = (torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(2))
    load = dict(dtype=torch.float32, attn_implementation="eager")
    dense = measure(AutoModelForCausalLM.from_pretrained(ckpt, **load), ids, labels)
    # the rounding floor: the dense model with the statistics computed the other way
    mlp._gaussian_topk = gaussian_topk_over_the_row
    res = measure(AutoModelForCausalLM.from_pretrained(ckpt, **load), ids, labels, dense)
    out["rounding floor", rank] = {k: v for k, v in res.items() if "error" in k or k == "worst"}
    for name, (plan, patch) in VARIANTS.items():
        mlp._gaussian_topk = gaussian_topk_over_the_row if patch else shipped
        dc = DistributedConfig(tp_plan=plan)
        tp = AutoModelForCausalLM.from_pretrained(ckpt, distributed_config=dc, **load)
        res = measure(tp, ids, labels, dense)
        out[name, rank] = {k: v for k, v in res.items() if "error" in k or k == "worst"}
    mlp._gaussian_topk = shipped


def save_checkpoint(path: str) -> None:
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    torch.manual_seed(0)
    model = Gemma3nForCausalLM(Gemma3nTextConfig(**SIZES))
    with torch.no_grad():  # norm weights off their init
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)


def main() -> int:
    import accelerate
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"accelerate {accelerate.__version__}, 2 gloo ranks (CPU), float32"
    )
    with tempfile.TemporaryDirectory() as ckpt:
        # written in a child process: the ranks are forked from this one, which stays free of
        # torch's thread pools (a pool in a process that forks can deadlock the forked ranks)
        writer = mp.get_context("fork").Process(target=save_checkpoint, args=(ckpt,))
        writer.start()
        writer.join()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = mp.Manager().dict()
        mp.start_processes(run, args=(2, port, ckpt, out), nprocs=2, start_method="fork")
    print(
        "errors are max |TP - dense| / max |dense|; the rounding floor is the dense model with the"
    )
    print("model-code statistics against the shipped dense model (the cutoff amplifies rounding)")
    verified = {}
    for name in ("rounding floor", *VARIANTS):
        for rank in range(2):
            r = out[name, rank]
            print(
                f"{name}, rank {rank}: layer 0 MLP output error {r['mlp error']:.2e}; "
                f"logits error {r['logits error']:.2e}; worst gradient error "
                f"{r['grad error']:.2e} ({r['worst']})"
            )
            ok = r["mlp error"] < 1e-5 and r["logits error"] < 1e-4 and r["grad error"] < 1e-3
            verified[name] = verified.get(name, True) and ok
    if out["as shipped", 0]["mlp error"] < 1e-3:
        print("NOT REPRODUCED: the sparse layer's MLP matches the dense model")
        return 1
    print("REPRODUCED: each rank's sparsity cutoff comes from its own column shard of the row")
    failed = False
    for name in list(VARIANTS)[1:]:
        label, what = name.rstrip(")").split(" (", 1)
        if verified[name]:
            print(
                f"FIX VERIFIED ({label}): {what}; outputs and every gradient match the dense model"
            )
        else:
            failed = True
            print(f"FIX FAILED ({label}): {what}; see the errors above")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
