"""An architecture made a tpcheck case: what the parent learns of it before any rank runs
(`prepare`: the small config, transformers' resolved plan, the activations checked, the inputs and
the float32-pinned modules; cached, and prepared ahead for a sweep by forked workers:
`prepare_all`), its spec (`hf_spec`) and its Case (`hf_case`).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch
from torch import nn

from tpcheck.adapters.transformers.build import (
    TransformersTP,
    activation_placements,
    build_lm,
    model_class,
    output_placement,
    resolved_plan,
    wrap,
)
from tpcheck.adapters.transformers.common import (
    CONFIG_MAPPING_NAMES,
    LOGITS,
    MAX_PARAMS,
    TRANSFORMERS_ERROR,
    Skip,
    _first_line,
    available,
)
from tpcheck.adapters.transformers.configs import small_config
from tpcheck.adapters.transformers.inputs import batch_maker, hidden_loss, lm_loss
from tpcheck.adapters.transformers.probe import _probe
from tpcheck.checker.case import Case, CaseSpec, Target
from tpcheck.checker.settings import RunSettings
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Placement


@dataclass(frozen=True)
class Prepared:
    """What the parent learns of an architecture before any rank runs it."""

    model_type: str
    config: object
    tp_plan: dict
    activations: dict
    output: Placement
    kind: str = LOGITS
    output_shape: tuple[int, ...] = ()
    pinned: tuple[str, ...] = ()  # modules kept in float32 in the float64 truth
    # the forward's inputs, (name, shape, "ids" | "float" | fixed values) each: `_input_sets`
    inputs: tuple = ()


def prepare(model_type: str, world: int, rules: dict | None = None) -> Prepared:
    """The small config, transformers' resolved plan and the checked activations
    (a model on the meta
    device: no weights). Raises Skip with the reason when the architecture cannot be checked.
    Cached: the parent prepares each architecture once for the sweep and once more to
    validate its case. On one intra-op thread: its probes run models of at most a million
    parameters on 2 x 8 tokens, too small for a thread team to pay (a float64 depthwise conv1d
    takes seconds on two threads of a busy machine, a millisecond on one), and the ranks forked
    after it inherit no OpenMP team."""
    key = (model_type, world, tuple(sorted((rules or {}).items())))
    if key not in _PREPARED:
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _PREPARED[key] = _prepare(*key)
        except Skip as e:
            _PREPARED[key] = e  # an architecture that cannot be checked says why each time asked
            raise
        finally:
            torch.set_num_threads(before)
    outcome = _PREPARED[key]
    if isinstance(outcome, Skip):
        raise Skip(str(outcome))
    return outcome


# prepare's outcomes by (model_type, world, rules): what the ranks forked later find here
_PREPARED: dict[tuple, Prepared | Skip] = {}


def prepare_all(model_types: list[str], world: int, rules: dict | None = None) -> None:
    """`prepare` each of `model_types` ahead of its use, the CPUs shared: the sweep prepares ~150
    architectures (a meta-device build, a float64 probe, the resolved plan: 13 s on one core here)
    before the first rank forks. Each CPU but this process's gets a worker forked from it, with
    a share of the architectures (every `workers`-th); this process prepares its own share
    meanwhile, then takes in the workers' outcomes (a Prepared, or a Skip's reason) into its cache.
    An architecture whose preparation raised anything else, or whose worker died, is left to
    `prepare`, which raises it where it is asked for. With one CPU for this process's forks
    (`spawn._cpus`: a parent that may have started a thread team forks nothing that computes on
    several threads), or a few architectures, nothing runs here."""
    import multiprocessing as mp

    from tpcheck.checker.pool.spawn import _cpus

    items = tuple(sorted((rules or {}).items()))
    todo = [(m, world, items) for m in dict.fromkeys(model_types)]
    todo = [key for key in todo if key not in _PREPARED]
    workers = min(_cpus()[0], len(todo) // PREPARE_CHUNK)
    if workers < 2:
        return
    ctx = mp.get_context("fork")
    shares = [todo[i::workers] for i in range(workers)]
    conns, procs = [], []
    try:
        for share in shares[1:]:
            mine, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_prepare_share, args=(share, theirs, os.getpid()), daemon=True
            )
            proc.start()
            theirs.close()
            conns.append(mine)
            procs.append(proc)
        for key in shares[0]:
            _prepared(key)
        for conn in conns:
            try:
                outcomes = conn.recv()
            except (EOFError, OSError):  # the worker died: its share is prepared when asked
                continue
            for key, kind, value in outcomes:
                if kind == "ok":
                    _PREPARED[key] = value
                elif kind == "skip":
                    _PREPARED[key] = Skip(value)
    finally:
        for conn in conns:
            conn.close()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()


PREPARE_CHUNK = 8  # fewer architectures per worker than this: not worth forking one


def _prepare_share(share: list[tuple], conn, parent_pid: int) -> None:
    """A worker of `prepare_all`: prepares `share`, sends the outcomes, exits. The parent's signal
    handlers are not its own: SIGTERM and SIGHUP end it, Ctrl-C is the parent's to handle (it
    kills the workers), and it dies with the parent."""
    from tpcheck.checker.pool.spawn import die_with_parent, stop_on_signals

    stop_on_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)
    conn.send([_prepared(key) for key in share])
    conn.close()


def _prepared(key: tuple) -> tuple[tuple, str, object]:
    """(key, "ok", Prepared) | (key, "skip", reason) | (key, "raised", None), cached here too."""
    try:
        return key, "ok", prepare(key[0], key[1], dict(key[2]))
    except Skip as e:
        return key, "skip", str(e)
    except Exception:  # noqa: BLE001 - asked again where it is used, which raises it there
        return key, "raised", None


def _prepare(model_type: str, world: int, rule_items: tuple) -> Prepared:
    rules = dict(rule_items)
    if not available():
        raise UsageError(TRANSFORMERS_ERROR)
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UsageError(
            f"unknown architecture {model_type!r}: not a transformers model_type; "
            "`tpcheck hf --list` lists those with a TP plan"
        )
    choice = model_class(model_type)
    cfg = small_config(model_type, world)
    try:
        meta = build_lm(model_type, cfg, torch.float32, device="meta")
    except Skip:
        raise
    except Exception as e:  # noqa: BLE001
        raise Skip(
            f"the model does not build from the shape-reduced config: {type(e).__name__}: "
            f"{_first_line(e)}"
        ) from None
    params = sum(p.numel() for p in meta.parameters())
    if params > MAX_PARAMS:
        big = max(meta.named_parameters(), key=lambda kv: kv[1].numel())
        raise Skip(
            f"the shape-reduced model still has {params:,} parameters (> {MAX_PARAMS:,}; largest "
            f"{big[0]} {list(big[1].shape)}): sizes in its config that the "
            "reduction rules do not know"
        )
    shape, pinned, inputs = _probe(model_type, cfg, meta, choice.kind)
    try:
        tp_plan = resolved_plan(meta, world, rules) if world > 1 else {}
    except Exception as e:  # noqa: BLE001
        raise Skip(
            f"transformers cannot resolve its plan: {type(e).__name__}: {_first_line(e)}"
        ) from None
    if world > 1 and not tp_plan:
        raise Skip(f"its resolved TP plan is empty for {choice.cls.__name__}")
    return Prepared(
        model_type,
        cfg,
        tp_plan,
        activation_placements(meta, tp_plan, world),
        output_placement(tp_plan, choice.kind),
        choice.kind,
        shape,
        pinned,
        inputs,
    )


def prepare_spec(spec: CaseSpec) -> tuple[Prepared, dict[str, str] | None]:
    """(`prepare` of the spec's architecture, the plan rules it overrides) for `spec.block` =
    "hf:<model_type>" (rules in `spec.overrides["tp_plan"]`); Skip becomes bad input naming it."""
    model_type = spec.target.name
    rules = dict(dict(spec.overrides).get("tp_plan", ())) or None
    try:
        return prepare(model_type, spec.world_size, rules), rules
    except Skip as e:
        raise UsageError(f"{model_type} (tp{spec.world_size}) cannot be checked: {e}") from None


def hf_case(spec: CaseSpec) -> Case:
    """The Case of `spec.block` = "hf:<model_type>"
    (rules overriding the plan in `spec.overrides`)."""
    prep, rules = prepare_spec(spec)
    model_type, cfg, kind = prep.model_type, prep.config, prep.kind

    def build_dense(dtype: torch.dtype) -> nn.Module:
        pinned = prep.pinned if dtype == torch.float64 else ()
        return wrap(build_lm(model_type, cfg, dtype, pinned=pinned), kind)

    def build_tp(group: TPGroup, dtype: torch.dtype) -> nn.Module:
        return TransformersTP(model_type, cfg, dtype, group, rules)

    def load_tp(tp: TransformersTP, state: dict, group: TPGroup) -> None:
        tp.load(state)

    return Case(
        name=spec.name,
        build_dense=build_dense,
        build_tp=build_tp,
        plan=None,
        load_tp=load_tp,
        make_batch=batch_maker(prep.inputs, kind, prep.output_shape),
        loss=lm_loss if kind == LOGITS else hidden_loss,
        grad_inputs=(),
        output_placement=prep.output,
        activations=prep.activations,
        no_grad_forward=True,
        plan_rules=prep.tp_plan,
        run=spec.settings,
    )


def hf_spec(
    model_type: str,
    world_size: int,
    dtype: str = "float32",
    rules: dict | None = None,
    *,
    label: str | None = None,
    **settings,
) -> CaseSpec:
    """The spec of one architecture with transformers' own plan (`rules` override some of its
    rules); `settings`: run settings besides the dtype (steps, micro_batches, ...)."""
    overrides = (("tp_plan", tuple(sorted(rules.items()))),) if rules else ()
    block = str(Target("hf", model_type))
    label = label or f"{block}/tp{world_size}/{dtype}" + ("/rules" if rules else "")
    if _has_pinned(model_type, world_size, rules):
        label += "/float32-truth"  # its float32-pinned modules bound against a float32 truth
    return CaseSpec(
        block=block,
        world_size=world_size,
        run=RunSettings(dtype=dtype, **settings),
        overrides=overrides,
        label=label,
    )


def _has_pinned(model_type: str, world: int, rules: dict | None) -> bool:
    """Whether the architecture's float64 truth keeps modules in float32 (its bound there is the
    float32 one: docs/hf.md); False when it cannot be prepared (the spec says why when run)."""
    try:
        return bool(prepare(model_type, world, rules).pinned)
    except (Skip, UsageError):
        return False
