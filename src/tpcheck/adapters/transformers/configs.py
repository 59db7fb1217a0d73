"""The shape-reduced config of an architecture (`small_config`): the first reduction
(`reduction.small_overrides`, then its fallbacks: `_fallbacks`) whose config builds, whose model
builds and whose forward runs; a validator's stated requirement met (`_validated`), a field the
model reads that the config lacks set by the same rules (`_built_config`).
"""

from __future__ import annotations

import re

import torch

from tpcheck.adapters.transformers.build import build_lm
from tpcheck.adapters.transformers.common import CONFIG_MAPPING, Skip, _first_line
from tpcheck.adapters.transformers.probe import _runs
from tpcheck.adapters.transformers.reduction import _DROPOUT, _layer_kinds, small_overrides


def small_config(model_type: str, world: int):
    """The architecture's default config, shape-reduced; raises Skip when it cannot be built.

    The first reduction (`small_overrides`) whose config builds, whose model builds and whose
    float32 forward runs on the meta device wins; the fallbacks tried in turn: the None sizes
    filled, a wider head, the layers cut to a prefix of the default `layer_types` pattern (for a
    validator that needs it). A field the model reads that the config lacks is set by the same
    rules. When no reduction runs on the meta device, the first whose model builds is kept (a
    model that reads values, `.item()`, runs on the CPU only)."""
    cls = CONFIG_MAPPING[model_type]
    try:
        default = cls()
    except Exception as e:  # noqa: BLE001 - the architecture's own default config does not build
        raise Skip(
            f"its default config does not build: {type(e).__name__}: {_first_line(e)}"
        ) from None
    defaults = default.to_dict()
    attribute_map = dict(getattr(cls, "attribute_map", {}) or {})
    keys = tuple(getattr(cls, "ignore_keys_at_rope_validation", ()) or ())
    first_error, built, kinds = None, None, None
    for options in _fallbacks(defaults):
        if options.get("fill") and kinds is None:
            kinds = _layer_kinds(cls)  # read only once the first reduction failed
        overrides = small_overrides(
            defaults, attribute_map, world, rope_keys=keys, layer_kinds=kinds, **options
        )
        try:
            cfg = _built_config(model_type, cls, overrides, world)
        except Skip as e:
            first_error = first_error or e
            continue
        if not _consistent(cfg):
            continue  # layers whose kinds the config does not say: `patterns` cuts the lists
        built = built or cfg
        if _runs(model_type, cfg):
            return cfg
    if built is not None:
        return built
    raise first_error


def _fallbacks(defaults: dict) -> list[dict]:
    """The options of `small_overrides` tried in turn."""
    out = [{}, {"fill": True}, {"fill": True, "nested": True}, {"fill": True, "sections": True}]
    out += [{"fill": True, "head_dim": 16}, {"fill": True, "head_dim": 32}]
    types = defaults.get("layer_types")
    if isinstance(types, list) and types:
        kinds = set(types)
        first = next(i + 1 for i in range(len(types)) if set(types[: i + 1]) == kinds)
        out += [{"fill": True, "prefix": n} for n in range(max(first, 2), min(len(types), 16) + 1)]
    return out + [{"patterns": True}, {"fill": True, "nested": True, "patterns": True}]


def _consistent(cfg) -> bool:
    """Whether every per-layer kind list of the built config (`*layer_types`) has one entry per
    layer: a config that derives its list from a schedule of its own (25 dense layers, then
    sparse ones) keeps it whole when the depth shrinks, and its model then builds only the
    first kind."""
    depth = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(depth, int):
        return True
    return all(
        len(v) == depth
        for k, v in vars(cfg).items()
        if k.endswith("layer_types") and not k.startswith("mtp_") and isinstance(v, list)
    )


_MISSING = re.compile(r"object has no attribute '(\w+)'")


def _built_config(model_type: str, cls, overrides: dict, world: int):
    """The config of `overrides` with its model built on the meta device; a field the model reads
    that the config lacks (`AttributeError`) is set by the reduction rules and the build retried.
    Raises Skip with the reason."""
    cfg = _validated(cls, dict(overrides))
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the grouped-matmul kernels take no float64 (the truth)
    cfg.use_cache = False
    for _ in range(8):
        try:
            build_lm(model_type, cfg, torch.float32, device="meta")
            return cfg
        except Exception as e:  # noqa: BLE001
            missing = _MISSING.search(str(e)) if isinstance(e, AttributeError) else None
            value = _missing_value(missing.group(1), world) if missing else None
            if value is None or hasattr(cfg, missing.group(1)):
                raise Skip(
                    "the model does not build from the shape-reduced config: "
                    f"{type(e).__name__}: {_first_line(e)}"
                ) from None
            setattr(cfg, missing.group(1), value)
    raise Skip("the model does not build from the shape-reduced config")  # pragma: no cover


_REQUIRES = re.compile(r"requires (\w+)\s*=\s*(-?\d+)\b")

# a validator stating a sum: "head_dim must equal qk_nope_head_dim + qk_rope_head_dim"
_EQUALS_SUM = re.compile(r"(\w+) must equal (\w+(?:\s*\+\s*\w+)+)")


# a validator tying a field to another: "adapter_in_dim must match hidden_size"
_MATCHES = re.compile(r"(\w+) must match (\w+)")


def _validated(cls, overrides: dict):
    """`cls(**overrides)`; where a validator rejects it stating the value a field requires
    ("requires indexer_kv_heads=1"), a field it must match ("adapter_in_dim must match
    hidden_size") or a sum it must equal ("head_dim must equal qk_nope_head_dim +
    qk_rope_head_dim"), of the reduced values, that value is set and the config built again.
    Raises Skip with the reason."""
    for _ in range(4):
        try:
            return cls(**overrides)
        except Exception as e:  # noqa: BLE001
            field, value = _required(cls, overrides, str(e))
            if field is None or not hasattr(cls, field) or overrides.get(field) == value:
                raise Skip(
                    f"the shape-reduced config does not build: {type(e).__name__}: {_first_line(e)}"
                ) from None
            overrides[field] = value
    raise Skip("the shape-reduced config does not build")  # pragma: no cover


def _required(cls, overrides: dict, message: str) -> tuple[str | None, int | None]:
    """(field, value) a validator's `message` states, of the reduced `overrides` (a term they do
    not set: the class's default; a field to match: only one they reduce); (None, None) when it
    states none this can compute."""
    if required := _REQUIRES.search(message):
        return required.group(1), int(required.group(2))
    if (match := _MATCHES.search(message)) and match.group(2) in overrides:
        return match.group(1), overrides[match.group(2)]
    if stated := _EQUALS_SUM.search(message):
        terms = [t.strip() for t in stated.group(2).split("+")]
        values = [overrides.get(t, getattr(cls, t, None)) for t in terms]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            return stated.group(1), sum(values)
    return None, None


def _missing_value(field: str, world: int):
    """A field's value by the reduction rules, for a config that lacks it; None when no rule
    names it."""
    if _DROPOUT.search(field):
        return 0.0
    return small_overrides({field: None}, {}, world, fill=True).get(field)
