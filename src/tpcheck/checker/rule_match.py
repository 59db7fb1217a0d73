"""The TP code's own plan rules (`Case.plan_rules`: pattern -> style), read to name things only:
which rule covers a parameter, and, when none does, the rule of its closest sibling.

A rule matches a name as transformers matches it (`_get_parameter_plan` in
transformers/distributed/parallel_utils.py): the name itself, or the name with each all-digit
segment (a layer index of an `nn.ModuleList`) written `*`, is a key of the plan. A parameter is
covered by a rule on itself or on one of the modules it lives in (its own module's rule sets the
style of its parameters; an ancestor's style, MoE experts say, handles what is inside it).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping

_INDEX = re.compile(r"(?<![^.])\d+(?=\.|$)")


def generic(name: str) -> str:
    """`name` with its layer indices written `*` ('model.layers.0.mlp' -> 'model.layers.*.mlp')."""
    return _INDEX.sub("*", name)


def _rule(name: str, rules: Mapping[str, str]) -> str | None:
    """The key of `rules` that matches `name` (itself, or its generic form), or None."""
    if name in rules:
        return name
    return generic(name) if generic(name) in rules else None


def _generic_rules(rules: Mapping[str, str]) -> dict[str, str]:
    """{generic form of a key: the key} (a resolved plan lists every layer; one stands for all)."""
    out: dict[str, str] = {}
    for key in rules:
        out.setdefault(generic(key), key)
    return out


def covering(param: str, rules: Mapping[str, str]) -> dict:
    """How `rules` cover the parameter `param`: {"rule": key, "style": its style, "on": the name
    it matched (the parameter or one of its modules)}, or {"rule": None} with the closest rule of
    a sibling (`sibling`, `sibling_rule`, `sibling_style`) where there is one."""
    parts = param.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        key = _rule(name, rules)
        if key is not None:
            return {"rule": key, "style": rules[key], "on": name}
    return {"rule": None, **_closest_sibling(param, rules, _generic_rules(rules))}


def _closest_sibling(param: str, rules: Mapping[str, str], wild: Mapping[str, str]) -> dict:
    """The module beside `param`'s own (same parent) with a rule, its name the most like the
    parameter's module's ('k_norm' beside 'q_norm' before 'q_proj'); {} when none has one."""
    module, _, leaf = param.rpartition(".")
    parent, _, own = module.rpartition(".")
    if not own:
        return {}
    parent_g = generic(parent)
    found: dict[str, str] = {}  # sibling module name (generic) -> rule key
    for g, key in wild.items():
        for mod in (g, g[: -len(leaf) - 1] if g.endswith("." + leaf) else None):
            if mod and mod.rpartition(".")[0] == parent_g and mod != generic(module):
                found.setdefault(mod, key)
    if not found:
        return {}

    def likeness(mod: str) -> float:
        return difflib.SequenceMatcher(None, mod.rpartition(".")[2], own).ratio()

    best = max(sorted(found), key=likeness)
    return {
        "sibling": best.rpartition(".")[2],
        "sibling_rule": found[best],
        "sibling_style": rules[found[best]],
    }


def styles(rules: Mapping[str, str]) -> list[str]:
    """The styles the plan uses, each once, sorted."""
    return sorted(set(rules.values()))
