"""`tpcheck hf ARCH --repair`: from a failed check of transformers' plan to a verified override.

For a case that is `not equivalent` or `error`:

1. **The failing modules**: the module of the first divergent tensor and of every other failed check
   (`grad:P`, `update:P`, `act:M`, ...: a parameter's module, or the module itself); for an `error`,
   the modules whose class's `forward` holds a line of the traceback (the innermost frame whose
   modules share one plan key), else none; their submodules' plan keys are candidates too.
2. **The plan keys** that cover them in transformers' plan (the layer-wildcarded key equal to the
   module, or an ancestor's key); a failing module no rule covers gets a new key of its own. A
   failing parameter with a rule of its own (a MoE's grouped `experts.gate_up_proj`) puts that key
   first. With no failing module (only the model's output failed, or the frame is outside every
   module), every key of the plan.
3. **Candidate overrides**, group by group, the first divergence's group first (keys of one module
   kind under one current style, q_norm and k_norm), smallest change first within a group: one key
   at a time, then pairs set to one style together, then the whole group; last, every key of one
   kind at once;
   each key's candidate styles are transformers' own for its kind of module (a Linear: colwise,
   rowwise, ...; a module whose parameters are vectors, a norm: tpcheck's
   `tpcheck_reduce_grad_on_arrival`, `replicated_with_grad_allreduce`, `replicate`; an embedding:
   the embedding styles; a parameter's own rule: `packed_colwise`, `packed_rowwise`, `colwise`,
   `rowwise`, `replicate`) other than its current one.
   A first divergence diagnosed `op_on_shard` (an operation that reads a whole dimension ran on a
   rank's shard of it) puts its own candidates before these: for a reduction, every rule inside the
   module whose code runs it set to `replicate` together (the dimension it reads is then whole on
   every rank); for a split, each `colwise` rule there set to `packed_colwise` (each packed part
   sharded on its own). A `packed_shard` diagnosis (a packed weight sharded as one block whose
   output is split) puts first that weight's module's `colwise` rule set to `packed_colwise`.
   The rules are layer-wildcarded, as every key is: transformers looks a
   module up by its name with the layer numbers as `*` (`_get_parameter_plan`,
   distributed/parallel_utils.py:59-61), so no rule can name one layer.
4. **Each candidate checked with the full check**, the run's own settings, one at a time; the
   first whose verdict is `equivalent` is the repair. A budget caps the candidates tried
   (`--repair-budget`); when it runs out with candidates left untried, the entry says so. When
   every candidate was tried and none is equivalent, no override of one rule, of a pair of rules or
   of a group of rules with one style fixes it: the model code must change (the entry names the
   first divergence or the error's frame).

The search never accepts a candidate on anything but its own verifying run's verdict (`verified`).
One candidate short of it is kept apart: the first whose run fails by rounding only (`near_bound`:
its first divergence within 1e-3 relative and every failed check within twice its bound) and whose
full check in float64 (bounds of about 2e-10 relative, where any structural bug shows) is
equivalent. The search goes on; if no candidate is verified, the entry's status is
`verified_in_float64`: that override, its float64 check, and what its working-dtype run left
over its bounds, said as such (never "repaired").
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import linecache
import re
import shlex

from torch import nn

from tpcheck.checker.checkid import CheckId
from tpcheck.repair.shipped import converted_at_load, gathered_regions, shipped, wildcard
from tpcheck.repair.terms import slim

DEFAULT_BUDGET = 16
_RAISED = re.compile(r"raised at (\S+?):(\d+)")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ')
_LINEAR_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicate")
_EMBEDDING_STYLES = ("embedding_rowwise", "embedding_colwise", "replicate")
_CONTAINER_STYLES = ("replicate", "all_reduce")
# a parameter with a rule of its own (a MoE's grouped experts: gate_up_proj, down_proj): the packed
# styles first (a fused gate/up weight split as one block is the usual defect), then the plain ones
_PARAM_STYLES = ("packed_colwise", "packed_rowwise", "colwise", "rowwise", "replicate")


def verified(result: dict) -> bool:
    """A candidate is the repair only if its own full check says equivalent."""
    return result.get("verdict") == "equivalent"


def rounding_only(result: dict) -> bool:
    """A run that failed by rounding only: its first divergence diagnosed `near_bound` and every
    failed check within `NEAR` times its bound."""
    from tpcheck.checker.verdict.diagnose import NEAR

    if result.get("verdict") != "not equivalent":
        return False
    if (result.get("diagnosis") or {}).get("signature") != "near_bound":
        return False
    failed = [c for c in result.get("checks") or () if not c.get("passed", True)]
    return bool(failed) and all(c.get("bound") and c["error"] <= NEAR * c["bound"] for c in failed)


# ------------------------------------------------------------------ where it fails


def failing_modules(result: dict, modules: dict[str, nn.Module], params: set[str]) -> list[str]:
    """Module names (concrete, the model's own) of the first divergent tensor and of every failed
    check, first divergence first; for an error, the modules whose forward holds the raising
    line."""
    found: list[str] = []
    for check in _failed_ids(result):
        for token in _tokens(check):
            module = _module_of(token, modules, params)
            if module and module not in found:
                found.append(module)
    if result.get("verdict") == "error":
        found += [m for m in raising_modules(result, modules) if m not in found]
    return found


def _failed_ids(result: dict) -> list[CheckId]:
    """The identities of the first divergent check and of every failed check, in that order (a
    report's names read back)."""
    first = (result.get("first_divergence") or {}).get("name")
    failed = [c["name"] for c in result.get("checks", ()) if not c.get("passed", True)]
    return [CheckId.parse(n) for n in ([first] if first else []) + failed]


def _tokens(check: CheckId) -> list[str]:
    """What of a check may name a module or a parameter: its target (with a state's entry) and its
    pass."""
    target = check.target + (f".{check.entry}" if check.entry else "")
    return [t for t in (target, check.pass_) if t]


def raising_modules(result: dict, modules: dict[str, nn.Module]) -> list[str]:
    """The modules an error was raised in: of the traceback's frames, innermost first, the first
    whose line is in the `forward` of modules under one plan key (a norm class used in twenty
    places is passed over for the one embedding that calls it); else those of tpcheck's frame."""
    frames = []
    for problem in result.get("problems") or ():
        frames += [(f, int(n)) for f, n in _FRAME.findall(problem.get("traceback") or "")]
    for path, line in reversed(frames):
        hits = frame_modules(modules, path, line)
        if hits and len({wildcard(m) for m in hits}) == 1:
            return called_submodules(hits, modules, path, line) or hits
    frame = error_frame(result)
    return frame_modules(modules, *frame) if frame else []


_CALL = re.compile(r"self\.([A-Za-z_]\w*)\s*\(")


def called_submodules(hits: list[str], modules: dict, path: str, line: int) -> list[str]:
    """Where the raising line of a module's forward calls one of its submodules and no other
    (`out = self.o_proj(x)`: the error is raised in that call, in its forward hooks or its
    forward), that submodule of each hit; else [] (none, or several: which one raised is not
    told by the line)."""
    line_text = linecache.getline(path, line)
    called = {a for a in _CALL.findall(line_text) if f"{hits[0]}.{a}" in modules}
    return [f"{m}.{a}" for m in hits for a in called] if len(called) == 1 else []


def _module_of(token: str, modules: dict, params: set[str]) -> str | None:
    if token in params:
        return token.rpartition(".")[0]
    while token:
        if token in modules and token:
            return token
        token = token.rpartition(".")[0]
    return None


def error_frame(result: dict) -> tuple[str, int] | None:
    """(file, line) of the frame tpcheck names for an error ("raised at FILE:LINE")."""
    m = _RAISED.search(result.get("summary") or "")
    return (m.group(1), int(m.group(2))) if m else None


def frame_modules(modules: dict[str, nn.Module], path: str, line: int) -> list[str]:
    """Modules whose class's `forward` spans `path`:`line` (the path as tpcheck prints it, a suffix
    of the source file's)."""
    out = []
    for name, module in modules.items():
        # the forward's own code, under a decorator that wraps it (transformers' deprecation one)
        code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
        if code is None or not code.co_filename.endswith(path):
            continue
        lines = [n for _, _, n in code.co_lines() if n is not None]
        if lines and code.co_firstlineno <= line <= max(lines):
            out.append(name)
    return out


# ------------------------------------------------------------------ the plan keys and their styles


def own_param_keys(result: dict, params: set[str], plan: dict[str, str]) -> list[str]:
    """The plan keys that are failing parameters' own rules (a key naming the parameter, not its
    module), first divergence first."""
    keys = [wildcard(t) for n in _failed_ids(result) for t in _tokens(n) if t in params]
    return list(dict.fromkeys(k for k in keys if k in plan))


def covering_keys(failing: list[str], plan: dict[str, str]) -> list[str]:
    """The plan keys covering each failing module (its own key, else its closest ancestor's), a new
    key for a module no rule covers; in the order of `failing`."""
    keys: list[str] = []
    for module in failing:
        w = wildcard(module)
        parts = w.split(".")
        ancestors = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        key = next((a for a in ancestors if a in plan), w)
        if key not in keys:
            keys.append(key)
    return keys


def module_kind(key: str, modules: dict[str, nn.Module], params: set[str]) -> str:
    """ "param", "embedding", "linear", "vectors" (a module whose own parameters are all vectors: a
    norm) or "container"."""
    if any(wildcard(p) == key for p in params):
        return "param"
    module = next((m for n, m in modules.items() if wildcard(n) == key), None)
    if isinstance(module, nn.Embedding):
        return "embedding"
    own = list(module.parameters(recurse=False)) if module is not None else []
    if isinstance(module, nn.Linear) or any(p.dim() == 2 for p in own):
        return "linear"
    if own and all(p.dim() <= 1 for p in own):
        return "vectors"
    return "container"


def style_choices(kind: str, current: str | None) -> list[str]:
    from tpcheck.adapters.transformers.styles import REDUCE_GRAD_ON_ARRIVAL, ROWWISE_ANY_INPUT

    styles = {
        "param": _PARAM_STYLES,
        "embedding": _EMBEDDING_STYLES,
        "linear": _LINEAR_STYLES,
        "vectors": (REDUCE_GRAD_ON_ARRIVAL, "replicated_with_grad_allreduce", "replicate"),
        "container": _CONTAINER_STYLES,
    }[kind]
    if kind == "linear" and current == "rowwise":  # rowwise kept where its input is a slice
        styles = (ROWWISE_ANY_INPUT, *styles)
    return [s for s in styles if s != current]


def candidates(keys: list[str], plan: dict[str, str], kinds: dict[str, str]) -> list[dict]:
    """Overrides {key: style}, group by group: keys of one kind under one current style form a
    group, taken in the order of their first key (the first divergence's first); within a group,
    smallest first: each key alone, then pairs set to the same style, then the whole group (3 or
    more). Last, every key of one kind at once (3 or more, of several current styles: q_norm and
    k_norm under one style and an activation's scalars under no rule)."""
    groups: dict[tuple, list[str]] = {}
    for k in keys:
        groups.setdefault((kinds[k], plan.get(k)), []).append(k)
    out = []
    for (kind, current), members in groups.items():
        styles = style_choices(kind, current)
        out += [{k: s} for k in members for s in styles]
        for a, b in itertools.combinations(members, 2):
            out += [{a: s, b: s} for s in styles]
        if len(members) > 2:
            out += [dict.fromkeys(members, s) for s in styles]
    kinds_keys: dict[str, list[str]] = {}
    for k in keys:
        kinds_keys.setdefault(kinds[k], []).append(k)
    for kind, members in kinds_keys.items():  # every key of one kind, whatever its current style
        if len(members) > 2 and len({plan.get(k) for k in members}) > 1:
            out += [dict.fromkeys(members, s) for s in style_choices(kind, None)]
    return _unique(out)


def shard_op_candidates(result: dict, plan: dict[str, str]) -> list[dict]:
    """The overrides an `op_on_shard` or `packed_shard` diagnosis points at (step 3 of the module
    docstring)."""
    diagnosis = result.get("diagnosis") or {}
    evidence = diagnosis.get("evidence") or {}
    if diagnosis.get("signature") == "packed_shard":  # the packed weight's module, colwise
        key = wildcard(evidence.get("weight", "").rpartition(".")[0])
        return [{key: "packed_colwise"}] if plan.get(key) == "colwise" else []
    if diagnosis.get("signature") != "op_on_shard":
        return []
    out: list[dict] = []
    for op in evidence.get("ops") or ():
        owner = op["module"]
        if not owner:
            continue  # the model's own code: every rule is inside it
        inside = [k for k in plan if k.startswith(wildcard(owner) + ".")]
        if op["kind"] == "reduction" and inside:
            out.append(dict.fromkeys(inside, "replicate"))
        elif op["kind"] == "split":
            out += [{k: "packed_colwise"} for k in inside if plan.get(wildcard(k)) == "colwise"]
    return _unique(out)


def _unique(overrides: list[dict]) -> list[dict]:
    """Each override once, in first-seen order (the same rules in any order are one)."""
    unique: dict[tuple, dict] = {}
    for c in overrides:
        unique.setdefault(tuple(sorted(c.items())), c)
    return list(unique.values())


def rule_flags(override: dict[str, str]) -> str:
    return " ".join(f"--rule {shlex.quote(f'{k}={v}')}" for k, v in override.items())


# ------------------------------------------------------------------ the search


@dataclasses.dataclass
class Target:
    """What the search needs of one failed case: its result, its spec and the plan it ran."""

    result: dict
    spec: object  # CaseSpec
    rules: dict[str, str]


@dataclasses.dataclass
class Space:
    """The failed case's model (its modules and parameter names, built on the meta device) and
    the plan its run used."""

    modules: dict[str, nn.Module]
    params: set[str]
    plan: dict[str, str]
    model_class: str
    converted: dict[str, list[str]]  # parameter (layer-wildcarded) -> its load-time conversion


def repair_case(target: Target, run_one, budget: int = DEFAULT_BUDGET) -> dict:
    """The report's repair entry for one failed case; `run_one(spec) -> result dict` runs a full
    check. A candidate that is not equivalent but moves the first divergence on (the check that
    diverged first now passes everywhere: it fixed that defect, and another one follows) is kept,
    and the search goes on from its run, within the same budget: a model with two defects gets
    both rules. A repair that needs a style tpcheck provides is followed by a second search, with
    the budget left, among overrides made of transformers' own styles only (`shipped`), the
    gathered region first: the entry's `shipped` says what it found."""
    space = _space(target)
    result = target.result
    entry = {
        "kind": "plan_rule",
        "case": result["name"],
        "architecture": target.spec.target.name,
        "model_class": space.model_class,
        "world_size": target.spec.world_size,
        "dtype": result.get("dtype"),
        "verdict": result["verdict"],
        "where": _where(result),
        "budget": budget,
        "tried": [],
        "kept": [],  # the overrides that moved the first divergence on, in order
        "override": None,
        "flags": "",
        "verified": None,
    }
    _settle(entry, target, space, _search(target, run_one, space, entry, budget))
    if entry["status"] == "repaired" and not shipped(entry["override"]):
        alt = {"tried": [], "kept": [], "override": None, "flags": "", "verified": None}
        left = budget - len(entry["tried"])
        if left > 0:
            tried = len(entry["tried"])
            found = _search(target, run_one, space, alt, left, tried, shipped_only=True)
            _settle(alt, target, space, found)
        else:
            alt.update(status="budget_spent", untried=None)
        entry["shipped"] = alt
    return entry


def _space(target: Target) -> Space:
    import torch

    from tpcheck.adapters import transformers as hf

    arch = target.spec.target.name
    prep = hf.prepare(arch, target.spec.world_size, target.rules or None)
    meta = hf.build_lm(arch, prep.config, torch.float32, device="meta")
    params = {n for n, _ in meta.named_parameters()}
    return Space(
        dict(meta.named_modules()),
        params,
        {**meta.tp_plan, **target.rules},
        type(meta).__name__,
        converted_at_load(arch, params),
    )


def _search(
    target: Target,
    run_one,
    space: Space,
    entry: dict,
    budget: int,
    offset: int = 0,
    shipped_only: bool = False,
):
    """Candidates checked one at a time until one verifies, the budget is spent or none is left;
    (status, override, its run, its float64 run). `offset`: the candidates run before this search
    (their labels go on from it); `shipped_only`: overrides of transformers' own styles only."""
    result = target.result
    kept: dict[str, str] = {}
    current, near, untried = result, None, 0
    while True:
        keys, todo = _search_space(current, space, {**space.plan, **kept}, shipped_only)
        if current is result:
            entry.update(
                failing_modules=list(
                    dict.fromkeys(
                        wildcard(m) for m in failing_modules(result, space.modules, space.params)
                    )
                ),
                plan_keys={k: space.plan.get(k) for k in keys},
                candidates=len(todo),
            )
        moved = None
        for n, override in enumerate(todo):
            if len(entry["tried"]) >= budget:
                untried = len(todo) - n
                break
            full = {**kept, **override}
            r, candidate = _try(target, full, run_one, offset + len(entry["tried"]) + 1, entry)
            if verified(r):
                return "repaired", full, r, None
            if near is None and target.spec.settings.dtype != "float64" and rounding_only(r):
                f64 = run_one(_in_float64(candidate))
                entry["tried"][-1]["float64"] = f64.get("verdict")
                if verified(f64):
                    near = (full, r, f64)
            if moved_on(current, r):
                entry["tried"][-1]["moved_on"] = _where(r)
                moved = (override, r)
                break
        if moved is None:
            break
        kept.update(moved[0])
        entry["kept"].append({"override": moved[0], "moved_on": _where(moved[1])})
        current = moved[1]
    if near is not None:
        return ("verified_in_float64", *near)
    entry["untried"] = untried
    return "budget_spent" if untried else "no_plan_fix", None, None, None


def _settle(entry: dict, target: Target, space: Space, outcome: tuple) -> None:
    status, override, r, f64 = outcome
    if override is None:
        entry["status"] = status
        return
    _repaired(entry, status, target, space, override, r, f64)


def _search_space(result: dict, space: Space, plan: dict[str, str], shipped_only: bool = False):
    """(the plan keys of the failing modules, the candidate overrides) of one failed run; with
    `shipped_only`, the gathered regions first and only overrides of transformers' own styles."""
    modules, params = space.modules, space.params
    failing = failing_modules(result, modules, params)
    # a failing parameter's own rule first (the most specific), then its module's and the others'
    keys = own_param_keys(result, params, plan)
    keys += [k for k in (covering_keys(failing, plan) if failing else plan) if k not in keys]
    raising = raising_modules(result, modules) if result.get("verdict") == "error" else []
    for module in raising:
        inside = wildcard(module) + "."  # the rules of the raising module's submodules
        keys += [k for k in plan if k.startswith(inside) and k not in keys]
    kinds = {k: module_kind(k, modules, params) for k in keys}
    first = shard_op_candidates(result, plan)
    if shipped_only:
        first = gathered_regions(keys, plan, kinds) + first
    todo = first + [c for c in candidates(keys, plan, kinds) if c not in first]
    return keys, [c for c in todo if shipped(c)] if shipped_only else todo


def _try(target: Target, override: dict, run_one, n: int, entry: dict):
    """Check the plan with `override` (the run's own rules under it); its run and spec."""
    rules = {**target.rules, **override}
    candidate = dataclasses.replace(
        target.spec,
        overrides=(("tp_plan", tuple(sorted(rules.items()))),),
        label=f"{target.result['name']}/repair{n}",
    )
    r = run_one(candidate)
    entry["tried"].append(
        {
            "override": override,
            "verdict": r.get("verdict"),
            "summary": (r.get("summary") or "")[:300],
            "seconds": round(float(r.get("seconds", 0.0)), 3),
        }
    )
    return r, candidate


def moved_on(before: dict, after: dict) -> bool:
    """Whether `after` (a candidate's failed run) fixed `before`'s first divergence: that check
    (its name, at its step) is in `after` and passed on every rank; or, where the candidate's plan
    no longer checks it (a module no longer sharded), `after` first diverges at a later step or a
    later stage of the step."""
    first, later = before.get("first_divergence") or {}, after.get("first_divergence") or {}
    if after.get("verdict") != "not equivalent" or not first.get("name") or not later.get("name"):
        return False
    same = [
        c
        for c in after.get("checks") or ()
        if c["name"] == first["name"] and c.get("step") == first.get("step")
    ]
    if same:
        return all(c.get("passed", True) for c in same)
    return _position(later) > _position(first)


_STAGE_ORDER = ("weights", "forward", "loss", "backward", "grads", "optimizer", "buffers")


def _position(divergence: dict) -> tuple[int, int]:
    """Where a divergence sits in the run: its step, then its stage in a step's flow."""
    stage = divergence.get("stage")
    return divergence.get("step") or 0, _STAGE_ORDER.index(stage) if stage in _STAGE_ORDER else -1


def _repaired(
    entry: dict, status: str, target: Target, space: Space, override: dict, r: dict, f64=None
):
    """The entry of a verified override (`status` "repaired"), or of one verified in float64 only,
    `r` its working-dtype run and `f64` its float64 one ("verified_in_float64")."""
    proof = f64 if f64 is not None else r
    rules = {**target.rules, **override}
    entry.update(
        status=status,
        override=override,
        rules=rules,
        flags=rule_flags(rules),
        converted_at_load={
            p: ops
            for p, ops in space.converted.items()
            if any(p == k or p.startswith(k + ".") for k in override)
        },
        verified={
            "case": proof["name"],
            "verdict": proof["verdict"],
            "summary": proof["summary"],
            "result": slim(proof),
        },
    )
    if f64 is not None:
        failed = [c for c in r.get("checks") or () if not c.get("passed", True)]
        entry["working"] = {
            "case": r["name"],
            "verdict": r["verdict"],
            "failed": len(failed),
            "worst_over_bound": max(c["error"] / c["bound"] for c in failed),
            "summary": r["summary"],
        }
    return entry


def _in_float64(candidate):
    """The candidate's spec checked in float64 (no float64 run of its own to follow)."""
    run = dataclasses.replace(candidate.settings, dtype="float64", float64_run="off")
    return dataclasses.replace(candidate, run=run, label=f"{candidate.label}/float64")


def _where(result: dict) -> str:
    """The first divergence (name, stage, step) or the error's frame."""
    first = result.get("first_divergence") or {}
    if first.get("name"):
        return f"{first['name']} ({first['stage']}, step {first['step']})"
    frame = error_frame(result)
    return f"{frame[0]}:{frame[1]}" if frame else (result.get("summary") or "")[:200]
