"""Two mechanisms of a wrong gradient of a replicated parameter, named from the numbers the ranks
kept beside its evidence (checker/rank/grad_evidence.py):

  grad_accumulation_reduced  the TP gradient, with n micro-batches whose gradients (summed over
                    the ranks) are G_1..G_n, is W^(n-1)·G_1 + ... + W·G_{n-1} + G_n (W the world
                    size) instead of G_1 + ... + G_n, within the check's bound, and the plain sum
                    is not: a hook all-reduces the *accumulated* `.grad` after every backward
                    (`register_post_accumulate_grad_hook`), so each earlier micro-batch's gradient,
                    already reduced, is summed over the ranks again.
  no_plan_rule      the gradient is a partial sum over the ranks (`partial_sum`) and the TP code's
                    own plan (`Case.plan_rules`) has no rule for the parameter or any module it
                    lives in: nothing reduces it because nothing in the plan says it must be.

Two mechanisms of a wrong activation, named from what the ranks noted of the forward's operations
(checker/rank/shard_ops.py):

  op_on_shard       the first divergence is a mismatch at a module output, and the code of that
                    module, of a module inside it or of its parent between its children runs an
                    operation that reads a whole dimension (a reduction: mean, std, softmax,
                    top-k; a split: chunk) on a smaller dimension on the TP side than on the dense
                    side, at the same source line (for the model's output: in the model's own
                    code): it runs on each rank's shard of a dimension the
                    plan shards, and computes there something other than its part of the dense
                    result.

  packed_shard      the first divergence is a mismatch (or replicas that differ) at a module
                    output, and the code within it splits the output of a module into parts
                    (q, k, v; gate, up) while that module's weight is sharded as one block along
                    them (a plain Shard where the output is not placed Fused): each rank's
                    contiguous rows hold the wrong parts. Named at the weight, with the Fused
                    placement that shards each part on its own.

One mechanism of a wrong discrete decision, named by the rank that judged it
(checker/rank/decisions.py):

  decision_bias     (a routing check) the TP side's input to a top-k, argmax or sort is offset on
                    one index (an expert) from the others, averaged over the rows, by more than the
                    dense side's own rounding averages to: a constant added to some scores before
                    the decision (a router-logit bias, a load-balancing correction applied on one
                    side), which sends tokens to that index at near-ties that are not rounding.

Each is a test on numbers, on the plan's keys or on shapes, never on a model or a parameter's name.
"""

from __future__ import annotations

import numpy as np

from tpcheck.checker.sourcelines import readable_path
from tpcheck.checker.verdict.divergence import FirstDivergence

GRAD_ACCUMULATION_REDUCED = "grad_accumulation_reduced"
NO_PLAN_RULE = "no_plan_rule"
OP_ON_SHARD = "op_on_shard"
PACKED_SHARD = "packed_shard"
DECISION_BIAS = "decision_bias"

CAUSES = {
    GRAD_ACCUMULATION_REDUCED: (
        "a micro-batch's gradient counted world times: the accumulated .grad is all-reduced after "
        "every backward (a post-accumulate-grad hook), so each earlier micro-batch's gradient is "
        "summed over the ranks again; reduce each micro-batch's gradient as it arrives (a tensor "
        "hook), not the accumulated .grad"
    ),
    NO_PLAN_RULE: (
        "no rule of the TP plan covers this replicated parameter: its gradient is a partial sum "
        "over the ranks that nothing reduces"
    ),
    OP_ON_SHARD: (
        "an operation that reads a whole dimension (a reduction such as mean, std, softmax or "
        "top-k; a split such as chunk) runs on each rank's shard of a dimension the plan shards"
    ),
    PACKED_SHARD: (
        "a packed weight ([q; k; v], [gate; up]) sharded as one block: each rank holds contiguous "
        "rows of the whole, so the parts its code splits are not the ranks' shards of the parts"
    ),
    DECISION_BIAS: (
        "a systematic bias before a discrete decision: the TP side's scores for one index (an "
        "expert) are offset from the others' on every row, beyond what rounding averages to, so "
        "its top-k/argmax/sort leans towards (or away from) that index: the flips it makes are "
        "no near-ties. Look for a constant added to the router logits (or a bias, a "
        "load-balancing correction) on the TP side only, or applied twice"
    ),
}


def _param(first: FirstDivergence) -> str | None:
    """The parameter of a gradient check ('grad:NAME', grads stage), else None."""
    if first.stage != "grads" or first.id.kind != "grad":
        return None
    return first.id.target


def accumulation_weights(world: int, n: int) -> np.ndarray:
    """The factors of G_1..G_n in a gradient whose accumulated `.grad` is all-reduced after each
    of n backwards over `world` ranks: W^(n-1), ..., W, 1."""
    return float(world) ** np.arange(n - 1, -1, -1)


def reduced_accumulated(first: FirstDivergence, ev: dict[int, dict], world: int) -> tuple | None:
    """(signature, details, cause) when the first divergent gradient is the accumulated `.grad`
    reduced after every micro-batch; else None."""
    param, bound = _param(first), first.bound
    if param is None or world < 2 or len(ev) != world or not bound:
        return None
    parts = [ev[r].get("micro_grads") for r in range(world)]
    if any(p is None for p in parts) or parts[0].shape[0] < 2:
        return None
    n = parts[0].shape[0]
    factors = accumulation_weights(world, n)
    off_formula = off_sum = 0.0
    for r in range(world):
        tp, g = np.asarray(ev[r]["tp"], dtype=np.float64), parts[r]
        if g.shape[1:] != tp.shape:
            return None
        off_formula = max(off_formula, float(np.abs(tp - np.tensordot(factors, g, 1)).max()))
        off_sum = max(off_sum, float(np.abs(tp - g.sum(0)).max()))
    if not (off_formula <= bound < off_sum):
        return None
    terms = " + ".join(
        f"{world}^{n - 1 - k}·G_{k + 1}" if n - 1 - k > 1 else f"{world}·G_{k + 1}"
        for k in range(n - 1)
    )
    details = {
        "parameter": param,
        "world": world,
        "micro_batches": n,
        "tp_minus_formula": off_formula,
        "tp_minus_sum": off_sum,
        "bound": bound,
        **_style(ev),
    }
    cause = (
        f"a micro-batch's gradient counted world times: the gradient of {param} is {terms} + G_{n} "
        f"(W = {world} ranks, n = {n} micro-batches, G_k micro-batch k's gradient summed over the "
        f"ranks) instead of {' + '.join(f'G_{k + 1}' for k in range(n))} (within the bound "
        f"{bound:.3g}; the plain sum is "
        f"{off_sum:.3g} off): the accumulated .grad is all-reduced after every backward, so each "
        "earlier micro-batch's gradient is summed over the ranks again. Fix: reduce each "
        "micro-batch's gradient as it arrives (a tensor hook, param.register_hook), not the "
        "accumulated .grad (register_post_accumulate_grad_hook)"
    )
    return GRAD_ACCUMULATION_REDUCED, details, cause


def unruled(first: FirstDivergence, ev: dict[int, dict]) -> tuple | None:
    """(signature, details, cause) when the first divergent gradient, a partial sum over the
    ranks, is of a parameter no rule of the TP code's plan covers; else None (no plan given,
    or a rule covers it)."""
    param = _param(first)
    rule = next((e["plan_rule"] for _, e in sorted(ev.items()) if "plan_rule" in e), None)
    if param is None or rule is None or rule.get("rule") is not None:
        return None
    module = param.rpartition(".")[0] or param
    own = module.rpartition(".")[2]
    cause = (
        f"no rule of the TP plan matches {param} or a module it is in ({module}, ...): the "
        "parameter stays replicated, its gradient is a partial sum over the ranks, and nothing "
        "reduces it"
    )
    details = {"parameter": param, "plan_rule": None, "plan_styles": rule.get("styles", [])}
    if sibling := rule.get("sibling"):
        cause += (
            f"; its sibling {sibling} has a rule ({rule['sibling_rule']!r}: "
            f"{rule['sibling_style']}), {own} has none"
        )
        details.update(
            sibling=sibling, sibling_rule=rule["sibling_rule"], sibling_style=rule["sibling_style"]
        )
    cause += f". Fix: a rule for {module} in the plan (a style that all-reduces its gradient)"
    return NO_PLAN_RULE, details, cause


def _style(ev: dict[int, dict]) -> dict:
    """The plan rule and style covering the parameter, where the TP code's plan was given."""
    rule = next((e["plan_rule"] for _, e in sorted(ev.items()) if "plan_rule" in e), None)
    if rule is None:
        return {}
    return {
        "plan_rule": rule.get("rule"),
        "style": rule.get("style"),
        "plan_styles": rule.get("styles", []),
    }


def _module_of(first: FirstDivergence) -> str | None:
    """The module whose output a forward check compares ('act:NAME', its pass included), '' for
    the model's output, else None."""
    if first.stage != "forward":
        return None
    if first.id.kind == "act":
        return first.id.location
    return "" if first.id.kind == "output" else None


def _within(op_module: str, module: str) -> bool:
    """Whether code of `op_module` runs inside `module`'s output: the module itself, a module in it,
    or its parent's own code (between its children, where a module's input is computed). For the
    model's output, the model's own code only: an operation inside a module whose output passed
    (or was not checked) is not taken as the cause."""
    if not module:
        return op_module == ""
    return (
        op_module == module
        or op_module.startswith(module + ".")
        or op_module == module.rpartition(".")[0]
    )


def source_line(at: str) -> str:
    """'path:line' as people read it ('transformers/models/x/modeling_x.py:970'): sourcelines.py's
    `readable_path`."""
    path, _, line = at.rpartition(":")
    return f"{readable_path(path)}:{line}"


def _op_words(op: dict) -> str:
    where = f"at {source_line(op['at'])}" + (f" (code of {op['module']})" if op["module"] else "")
    if op["kind"] == "split":
        return (
            f"{op['op']} over dim {op['dim']} {where} splits each rank's {op['tp_size']} of the "
            f"{op['dense_size']} elements of that dimension, not the whole: the parts it makes are "
            "not the ranks' shards of the dense parts (a packed [gate; up] or [q; k; v] sharded as "
            "one block). Fix: shard each packed part on its own (transformers' packed_colwise), or "
            "split before sharding"
        )
    return (
        f"{op['op']} over dim {op['dim']} {where} reads {op['tp_size']} of the "
        f"{op['dense_size']} elements of that dimension on each rank: it computes a statistic of "
        "the rank's shard, not of the whole. Fix: combine the partial results across the ranks "
        "(all-reduce the sums it is built from), gather the dimension before it, or leave the "
        "modules that produce it unsharded"
    )


def _same_op_in(op: dict, ops: list[dict]) -> list[str]:
    """The modules where the operation at `op`'s source line ran on a shard (each layer's)."""
    return list(
        dict.fromkeys(o["module"] for o in ops if (o["at"], o["op"]) == (op["at"], op["op"]))
    )


def op_on_shard(first: FirstDivergence, ops: list[dict]) -> tuple | None:
    """(signature, details, cause) when the first divergence, a mismatch at a module output, has
    in its code an operation the TP side ran on a shard of the dimension it reads
    (checker/rank/shard_ops.py); else None."""
    module = _module_of(first)
    if module is None:
        return None
    found = [
        {**op, "in_modules": _same_op_in(op, ops)} for op in ops if _within(op["module"], module)
    ]
    if not found:
        return None
    cause = _op_words(found[0])
    if len(found) > 1:
        more = ", ".join(f"{op['op']} at {source_line(op['at'])}" for op in found[1:4])
        cause += f"; also {more}" + (" ..." if len(found) > 4 else "")
    return OP_ON_SHARD, {"ops": found}, cause


def packed_shard(first: FirstDivergence, ops: list[dict]) -> tuple | None:
    """(signature, details, cause) when the code within the first divergent module output splits
    the output of a module whose weight is sharded as one block (shard_ops.py's `packed`); else
    None."""
    module = _module_of(first)
    if module is None:
        return None
    found = [op for op in ops if op.get("packed") and _within(op["module"], module)]
    if not found:
        return None
    op = found[0]
    weight = op["packed"][0]
    parts = op["parts"]
    cause = (
        f"{weight['param']} is sharded as one block ({weight['placement']}), but the output of "
        f"{op['producer']} is split into {len(parts)} parts (dense sizes {tuple(parts)}) by "
        f"{op['op']} at {source_line(op['at'])}"
        + (f" (code of {op['module']})" if op["module"] else "")
        + ": each rank's contiguous rows are not its shard of each part. Shard each part on its "
        f"own: {weight['param']} as {weight['fused']} (transformers' `packed_colwise`; with "
        "your own loader, rank r loads its block of every part and concatenates them)"
    )
    details = {"weight": weight["param"], "placement": weight["placement"],
               "suggested": weight["fused"], "split_at": op["at"], "parts": parts}  # fmt: skip
    return PACKED_SHARD, details, cause
