"""The diagnosis of a clipped gradient that diverges first (`clipped:<parameter>`, stage optimizer).

The TP side's gradients were within their bounds before the clipping (the grads stage), and its
total norm may be right too (`clip:grad_norm`); what is left is how the clipping applied its factor.
Each rank kept, beside the check's tensors, the factor its clipping scaled each of its gradients by
and the dense side's coefficient (checker/rank/training.py's `keep_clip_scales`):

  clip_partial  the dense coefficient is below 1, and some gradients were scaled by 1 (left
                unclipped) while the dense rule scales every one: the clipping's list of
                gradients left some out (often the replicated ones, when a TP clipping walks the
                sharded parameters only)
"""

from __future__ import annotations

CAUSES = {
    "clip_partial": (
        "the TP clipping left some gradients unscaled: it multiplied only part of the parameters' "
        "gradients by the clip coefficient (the dense rule scales every one), so the parameters "
        "it left out step with unclipped gradients"
    ),
}


def clipped_signature(ev: dict[int, dict]) -> tuple[str, dict] | None:
    """`clip_partial` with the parameters left unscaled on the ranks that kept the numbers, or
    None."""
    infos = [e["clip_scales"] for e in ev.values() if "clip_scales" in e]
    left = sorted({n for info in infos for n in info["unscaled"]})
    if not left:
        return None
    scaled = sorted(
        {
            n
            for info in infos
            for n, k in info["scales"].items()
            if abs(k - info["coef"]) <= info["tol"] * max(1.0, info["coef"])
        }
    )
    return "clip_partial", {
        "coefficient": infos[0]["coef"],
        "left_unscaled": left,
        "scaled": len(scaled),
    }
