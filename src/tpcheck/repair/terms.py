"""What a repair entry says on the terminal, and the fix written as its user applies it.

- `tpcheck hf --repair`: the `tp_plan` a transformers user passes to `from_pretrained`
  (`DistributedConfig(tp_plan=...)`, rules merged over the model's own plan), transformers' own
  styles first; a fix that needs a style tpcheck provides says so, with the shipped-style one
  beside it when the search found one.
- `tpcheck verify --repair`: the lines that put the verified all-reduce into the TP module, as a
  case file builds it (`tp = ...` and its `group`).

Each fix printed here is the override or insertion whose own full check said `equivalent`.
"""

from __future__ import annotations

import json


def slim(result: dict) -> dict:
    """A verifying run's case for the table printed after a repair: every field but its checks."""
    return {k: v for k, v in result.items() if k != "checks"}


# ------------------------------------------------------------------ tpcheck hf --repair


def plan_rule_lines(entry: dict) -> list[str]:
    """The terminal's account of one `plan_rule` entry (each line prefixed `tpcheck: `)."""
    head = f"{entry['architecture']} (tp{entry['world_size']}, {entry['dtype']})"
    lines = [f"repair {head}: {entry['verdict']} at {entry['where']}"]
    if entry.get("plan_keys"):
        keys = ", ".join(f"{k}={v or '(no rule)'}" for k, v in entry["plan_keys"].items())
        lines.append(f"  plan keys of the failing modules: {keys}")
    lines += _tried_lines(entry["tried"], "tried")
    status = entry["status"]
    if status == "repaired":
        lines.append(
            "  verified (the full check re-run with the override): " + entry["verified"]["summary"]
        )
        alt = entry.get("shipped")
        if alt is not None:
            lines += _tried_lines(alt["tried"], "with transformers' own styles only, tried")
            lines.append("  " + _shipped_sentence(alt))
            if alt["status"] == "repaired":
                lines.append(f"  pass: tpcheck hf {entry['architecture']} {alt['flags']}")
        lines.append(f"  pass: tpcheck hf {entry['architecture']} {entry['flags']}")
    elif status == "verified_in_float64":
        w = entry["working"]
        lines += [
            "  verified in float64 (the full check re-run with the override in float64): "
            + entry["verified"]["summary"],
            f"  in {entry['dtype']} it stays not equivalent by rounding only: {w['failed']} "
            f"check(s) over their bounds by at most {w['worst_over_bound']:.2g}x (near_bound); "
            f"{w['summary'][:200]}",
            f"  the override: tpcheck hf {entry['architecture']} {entry['flags']}",
        ]
    elif status == "budget_spent":
        lines.append(
            f"  no override verified within the budget of {entry['budget']} candidates "
            f"({entry['untried']} untried; raise --repair-budget); it fails at {entry['where']}"
        )
    else:
        lines.append(
            f"  no plan change among the {entry['candidates']} candidates fixes it (one rule, a "
            "pair or a group of the failing modules' rules set to one style): the model code must "
            f"change; it fails at {entry['where']}"
        )
    return lines


def _tried_lines(tried: list[dict], verb: str) -> list[str]:
    lines = []
    for t in tried:
        rules = ", ".join(f"{k}={v}" for k, v in t["override"].items())
        in_float64 = f" (in float64: {t['float64']})" if t.get("float64") else ""
        moved = (
            f"; it fixes the first divergence, kept: the next is at {t['moved_on']}"
            if t.get("moved_on")
            else ""
        )
        lines.append(f"  {verb} {rules}: {t['verdict']}{in_float64}{moved}")
    return lines


def _shipped_sentence(alt: dict) -> str:
    if alt["status"] == "repaired":
        return (
            "verified with transformers' own styles (the full check re-run): "
            + alt["verified"]["summary"]
        )
    if alt["status"] == "budget_spent" and not alt["tried"]:
        return (
            "only a style tpcheck provides fits; no budget was left to look for one made of "
            "transformers' own styles (raise --repair-budget)"
        )
    return (
        f"only a style tpcheck provides fits: no override made of transformers' own styles among "
        f"the {len(alt['tried'])} tried is equivalent"
        + (f" ({alt['untried']} left untried: raise --repair-budget)" if alt.get("untried") else "")
    )


SHIPPED_HEAD = "every style in it ships with transformers; verified equivalent"
TPCHECK_HEAD = "with a style tpcheck provides (transformers does not ship it)"


def tp_plan_patch(entry: dict) -> str:
    """The repair as Python a transformers user runs: the shipped-style plan first where one was
    verified, then the faster one with tpcheck's style; "" when nothing was repaired."""
    if entry.get("status") != "repaired":
        return ""
    alt = entry.get("shipped")
    cls = entry.get("model_class") or "AutoModel"
    if alt is None:  # the repair itself is made of shipped styles
        return _plan_block(entry, cls, SHIPPED_HEAD)
    if alt["status"] != "repaired":
        return _plan_block(entry, cls, f"{TPCHECK_HEAD}; verified equivalent", tpcheck_styles=True)
    return "\n".join(
        [
            _plan_block(alt, cls, SHIPPED_HEAD),
            _plan_block(entry, cls, f"faster, {TPCHECK_HEAD}", tpcheck_styles=True),
        ]
    )


def _plan_block(found: dict, cls: str, head: str, tpcheck_styles: bool = False) -> str:
    rules = found.get("rules") or found["override"]
    lines = [f"# {head}:"]
    for param, ops in (found.get("converted_at_load") or {}).items():
        lines.append(
            f"# caution: from_pretrained converts {param} at load ({', '.join(ops)}) after "
            "sharding the checkpoint's tensor; this rule was verified on the model built in "
            "memory, not through that conversion: check it on a checkpoint before use"
        )
    lines.append("from transformers.distributed import DistributedConfig")
    if tpcheck_styles:
        lines.append(
            "import tpcheck.adapters.transformers.styles  # registers its styles in transformers"
        )
    lines.append("")
    lines.append("tp_plan = {  # merged over the model's own plan")
    lines += [f"    {json.dumps(k)}: {json.dumps(v)}," for k, v in rules.items()]
    lines += [
        "}",
        f"model = {cls}.from_pretrained(",
        "    path, distributed_config=DistributedConfig(tp_plan=tp_plan)",
        ")",
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------ tpcheck verify --repair


def collective_lines(entry: dict) -> list[str]:
    """The terminal's account of one `collective` entry."""
    head = f"repair {entry['case']}: {entry['verdict']}"
    if entry["status"] == "not_repairable":
        sig = entry["signature"] or "no signature"
        return [
            f"{head} ({sig} at {entry['where'] or '?'}): --repair inserts a missing all-reduce "
            "where a tensor is a partial sum; none is here, nothing to insert"
        ]
    lines = [f"{head} ({entry['signature']} at {entry['where']}): {entry['sentence']}"]
    if entry["status"] == "repaired":
        lines.append("  verified (the full check re-run): " + entry["verified"]["summary"])
    return lines


_CODE = {
    "after": (
        "from tpcheck.parallel import reduce_from_tp_region  # all-reduce forward, identity back",
        "tp{get}.register_forward_hook(lambda mod, args, out: reduce_from_tp_region(out, group))",
    ),
    "before_bias": (
        "from tpcheck.parallel import reduce_from_tp_region  # all-reduce forward, identity back",
        "mod = tp{get}  # its output reduced before its bias is added",
        "mod.register_forward_hook(",
        "    lambda mod, args, out: reduce_from_tp_region(out - mod.bias, group) + mod.bias",
        ")",
    ),
    "grad_of_output": (
        "def reduce_grad(grad):  # the gradient of the output, summed over the TP ranks",
        "    grad = grad.clone()",
        "    torch.distributed.all_reduce(grad, group=group.pg)",
        "    return grad",
        "",
        "tp{get}.register_forward_hook(lambda mod, args, out: out.register_hook(reduce_grad))",
    ),
    "grad": (
        "def reduce_grad(grad):  # each micro-batch's gradient, summed over the TP ranks",
        "    grad = grad.clone()",
        "    torch.distributed.all_reduce(grad, group=group.pg)",
        "    return grad",
        "",
        "tp{get}.register_hook(reduce_grad)",
    ),
}


def collective_patch(entry: dict) -> str:
    """The verified insertion as the lines a case file adds after building its TP module (`tp`,
    on `group`, every rank); "" when nothing was repaired."""
    if entry.get("status") != "repaired":
        return ""
    where, site = entry["insertion"]["where"], entry["insertion"]["site"]
    kind = "get_parameter" if where == "grad" else "get_submodule"
    get = f".{kind}({site!r})" if site else ""
    head = f"# in your case file, after the TP module `tp` is built on `group`: {entry['sentence']}"
    return "\n".join([head, *(line.format(get=get) for line in _CODE[where]), ""])
