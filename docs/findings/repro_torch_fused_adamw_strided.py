"""torch's fused CPU AdamW steps a non-contiguous parameter wrongly: a TP column shard kept as a
view of the full weight (what `load_state_dict(..., assign=True)` of a sliced state dict gives a
row-parallel linear) moves by other amounts than the for-loop AdamW moves it, silently.

    python docs/findings/repro_torch_fused_adamw_strided.py

Exit 0: REPRODUCED and FIX VERIFIED printed; 1: the defect is gone; 2: it reproduces but the fix
does not verify."""

import sys

import torch

WORLD, OUT, IN, STEPS = 2, 16, 32, 2


def step(param: torch.Tensor, grads: list[torch.Tensor], fused: bool) -> torch.Tensor:
    """`param` stepped by torch.optim.AdamW (fused or the for-loop one) over `grads`."""
    p = torch.nn.Parameter(param, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=fused, foreach=False)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach().clone()


def shard_diff(contiguous: bool) -> float:
    """Rank 1's column shard of a row-parallel weight, as the loader leaves it (a view of the
    full weight, or a contiguous copy): max |fused - for-loop| after STEPS steps."""
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(OUT, IN, generator=gen)
    k = IN // WORLD
    grads = [torch.randn(OUT, k, generator=gen) for _ in range(STEPS)]
    strided = full.clone()[:, k : 2 * k]  # what the sliced state dict holds: a strided view
    shard = strided.contiguous() if contiguous else strided
    fused = step(shard, grads, True)
    loop = step(strided.contiguous(), grads, False)
    return float((fused - loop).abs().max())


def main() -> int:
    print(f"torch {torch.__version__}")
    strided = shard_diff(contiguous=False)
    print(
        f"column shard as a view (stride {torch.empty(OUT, IN)[:, : IN // WORLD].stride()}): "
        f"max |fused - for-loop| = {strided:.3g} (lr 1e-3: the for-loop step moves each element "
        "by about 1e-3)"
    )
    if strided <= 1e-6:
        print("NOT REPRODUCED: the fused step agrees with the for-loop one")
        return 1
    print(f"REPRODUCED: the fused CPU AdamW moves a strided parameter wrongly ({strided:.3g})")
    fixed = shard_diff(contiguous=True)
    print(f"the same shard made contiguous first: max |fused - for-loop| = {fixed:.3g}")
    if fixed > 1e-6:
        return 2
    print("FIX VERIFIED: with a contiguous parameter the fused step is the for-loop one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
