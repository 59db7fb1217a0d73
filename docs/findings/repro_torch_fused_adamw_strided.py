"""torch's fused CPU AdamW steps a non-contiguous parameter wrongly, silently.

    python docs/findings/repro_torch_fused_adamw_strided.py

A row-parallel linear's weight shard (the input-feature columns of rank 1 of 2) loaded the way a
sliced checkpoint is loaded, `load_state_dict({"weight": full[:, k:2k]}, assign=True)`, is a view
of the full weight with stride (32, 1). `torch.optim.AdamW(fused=True)` on the CPU steps it by
other amounts than the for-loop AdamW (`fused=False, foreach=False`) does, and writes outside it.
Fixes, each checked against the for-loop AdamW on the same strided layout:
  workaround: make the shard contiguous before it becomes a parameter;
  upstream code: `_fused_adam` (torch/optim/adam.py) steps contiguous copies of strided CPU
  tensors and writes them back (`PATCH` below, applied to the installed source of the function).
Exit 0: reproduced and both fixes verified; 1: not reproduced; 2: a fix did not verify.
"""

import inspect
import sys

import torch
import torch.optim.adam as adam_module
from torch import nn

OUT, IN, K, STEPS, LR = 16, 32, 16, 2, 1e-3
TOL = 1e-3 * LR  # 0.1% of one step's movement (an AdamW step moves each element by about LR)
FUNC_LINE = (
    "        func = torch._fused_adam_ if not decoupled_weight_decay else torch._fused_adamw_\n"
)
PATCH = (  # (upstream text, patched text) in torch/optim/adam.py, _fused_adam
    (
        FUNC_LINE,
        FUNC_LINE
        + "        # The CPU kernel walks each tensor's memory as numel() contiguous elements:\n"
        "        # step contiguous copies of strided tensors, then write them back.\n"
        "        originals = (device_params, device_grads, device_exp_avgs, device_exp_avg_sqs,\n"
        "                     device_max_exp_avg_sqs)\n"
        '        if device.type == "cpu":\n'
        "            (device_params, device_grads, device_exp_avgs, device_exp_avg_sqs,\n"
        "             device_max_exp_avg_sqs) = (\n"
        "                [t.contiguous() for t in ts] for ts in originals)\n",
    ),
    (
        "            found_inf=device_found_inf,\n        )\n",
        "            found_inf=device_found_inf,\n        )\n"
        "        for olds, news in zip(originals, (device_params, device_grads, device_exp_avgs,\n"
        "                                          device_exp_avg_sqs, device_max_exp_avg_sqs)):\n"
        "            for old, new in zip(olds, news):\n"
        "                if new is not old:\n"
        "                    old.copy_(new)\n",
    ),
)


def patched_fused_adam():
    """torch.optim.adam._fused_adam with PATCH applied to its installed source."""
    src = inspect.getsource(adam_module._fused_adam)
    for old, new in PATCH:
        assert src.count(old) == 1, f"upstream text not found once: {old!r}"
        src = src.replace(old, new)
    namespace = dict(vars(adam_module))
    exec(compile(src, "adam.py (patched _fused_adam)", "exec"), namespace)  # noqa: S102
    return namespace["_fused_adam"]


def train(fused: bool, contiguous: bool, dtype: torch.dtype):
    """Rank 1's shard of a row-parallel linear, loaded from the sliced full weight, stepped STEPS
    times by AdamW. Returns (the shard, the full weight it was loaded from, the shard before)."""
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(OUT, IN, generator=gen).to(dtype)
    xs = [torch.randn(4, K, generator=gen).to(dtype) for _ in range(STEPS)]
    shard = full[:, K : 2 * K]
    before = shard.float().clone()
    lin = nn.Linear(K, OUT, bias=False, device="meta", dtype=dtype)
    lin.load_state_dict({"weight": shard.contiguous() if contiguous else shard}, assign=True)
    opt = torch.optim.AdamW(lin.parameters(), lr=LR, weight_decay=0.01, fused=fused, foreach=False)
    for x in xs:
        opt.zero_grad()
        (lin(x) ** 2).sum().backward()
        opt.step()
    return lin.weight.detach().float(), full.float(), before


def compare(contiguous: bool, dtype: torch.dtype) -> tuple[float, int, int]:
    """max |fused - for-loop| over the shard; elements of the shard the fused step left unchanged
    and elements of the full weight outside the shard it changed (the for-loop step: 0 and 0)."""
    fused, fused_full, before = train(True, contiguous, dtype)
    loop, loop_full, _ = train(False, False, dtype)
    outside = torch.ones(OUT, IN, dtype=torch.bool)
    outside[:, K : 2 * K] = False
    return (
        float((fused - loop).abs().max()),
        int((fused == before).sum()),
        int((fused_full != loop_full)[outside].sum()),
    )


def main() -> int:
    print(f"torch {torch.__version__}, CPU, AdamW lr {LR}, {STEPS} steps, tolerance {TOL:g}")
    shard = torch.empty(OUT, IN)[:, K : 2 * K]
    print(f"shard {list(shard.shape)} of a [{OUT}, {IN}] weight, stride {shard.stride()}")
    results = {}
    for name, dtype in (("float32", torch.float32), ("float64", torch.float64)):
        for variant in ("as shipped", "workaround", "upstream code"):
            if variant == "upstream code":
                original = adam_module._fused_adam
                adam_module._fused_adam = patched_fused_adam()  # the patch, monkeypatched
            try:
                diff, unchanged, outside = compare(variant == "workaround", dtype)
            finally:
                if variant == "upstream code":
                    adam_module._fused_adam = original
            results[(variant, name)] = (diff, unchanged, outside)
            print(
                f"{name} {variant:>13}: max |fused - for-loop| = {diff:.3g}, shard elements "
                f"not stepped = {unchanged} of {OUT * K}, elements outside the shard changed = "
                f"{outside} of {OUT * (IN - K)}"
            )
    bad = [r for (v, _), r in results.items() if v == "as shipped" and (r[0] > TOL or any(r[1:]))]
    if not bad:
        print("NOT REPRODUCED: the fused step agrees with the for-loop one")
        return 1
    diff, unchanged, outside = results[("as shipped", "float32")]
    print(
        f"REPRODUCED: the fused CPU AdamW steps a strided shard wrongly (float32: {diff:.3g}; "
        f"{unchanged} shard elements not stepped, {outside} elements outside it overwritten)"
    )
    code = 0
    for label, variant, what in (
        ("workaround", "workaround", "the shard made contiguous before it becomes a parameter"),
        ("upstream code", "upstream code", "_fused_adam steps contiguous copies on the CPU"),
    ):
        ok = all(d <= TOL and u == o == 0 for (v, _), (d, u, o) in results.items() if v == variant)
        print(f"FIX {'VERIFIED' if ok else 'FAILED'} ({label}): {what}")
        code = code if ok else 2
    return code


if __name__ == "__main__":
    sys.exit(main())
