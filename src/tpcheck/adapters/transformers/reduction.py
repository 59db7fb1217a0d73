"""The reduction rules: the config fields to override (by the config's own field names) so that an
architecture's default config shrinks to a few-hundred-thousand-parameter model, one set of rules
for every architecture (`small_overrides`): sizes by field name and pattern, layer patterns (one
layer of each kind), per-layer overrides, other layer counts scaled, rope sections scaled with the
rotated dims.
"""

from __future__ import annotations

import inspect
import re

from tpcheck.adapters.transformers.common import CONFIG_MAPPING, SEQ, VOCAB, available

_DROPOUT = re.compile(r"(dropout|_pdrop|dropout_rate|drop_path_rate)$")


def _sizes(world: int) -> dict[str, int]:
    kv = max(4, world)
    return {
        "kv": kv,
        "heads": 2 * kv,
        "head_dim": 8,
        "hidden": 16 * kv,
        "ffn": 32 * kv,
        "expert_ffn": 8 * kv,
    }


# Sizes named otherwise in some architectures: by the field name's pattern, applied only to a field
# that exists in the default config and is larger than the reduced value.
_PATTERNS = (
    (re.compile(r"intermediate_size"), "expert_ffn"),  # shared-expert / per-expert FFN widths
    (re.compile(r"head_dim$"), "head_dim"),  # global_head_dim, linear_key_head_dim, ...
    (re.compile(r"^(mamba_)?d_ssm$|^mamba_d_inner$"), "ffn"),
    (re.compile(r"(d_state|state_size)$"), 16),
    (re.compile(r"chunk_size$"), SEQ),
    (re.compile(r"vocab_size"), VOCAB),  # vocab_size_per_layer_input, unpadded_vocab_size
    (re.compile(r"size_per_layer_input$"), 8),
    (re.compile(r"^num_layers$|^n_layers?$|^num_blocks$"), 2),  # num_blocks: a conformer's
    (re.compile(r"^(mamba|ssm)_(n|num)_heads$"), "kv"),  # SSM heads: must divide expand x hidden
    (re.compile(r"^(mamba_)?n_groups$"), "kv"),  # SSM groups: must divide the SSM heads
    (re.compile(r"_lora_rank$"), 16),  # o_lora_rank, ...
    (re.compile(r"^(n|num)_\w*experts$|_expert_num$"), 4),  # zero_expert_num, ...
    (re.compile(r"^\w+_hidden_size$"), "hidden"),  # moe_hidden_size
    (re.compile(r"^top_?k_experts$"), 2),
    (re.compile(r"_(n|kv)_heads$"), "kv"),  # indexer_n_heads, indexer_kv_heads
    (re.compile(r"_compress_ratio$"), 2),
    (re.compile(r"_budget$"), SEQ // 2),  # tokens a sparse attention keeps
    (re.compile(r"codebook_size$"), VOCAB),  # an audio codebook: a vocabulary per codebook
    (re.compile(r"^num_dense_layers$"), 1),  # leading dense layers: one, the next ones MoE
    # the widths a projector or adapter maps between (adapter_in_dim, projector_output_dim,
    # vision_output_dim): the hidden size, which the model on either side has when reduced
    (re.compile(r"(^|_)(in|out|input|output)_dim$"), "hidden"),
)


def _by_pattern(field: str, value: int, s: dict) -> int | None:
    for pattern, size in _PATTERNS:
        if pattern.search(field):
            target = s[size] if isinstance(size, str) else size
            return target if value > target else None
    return None


def small_overrides(
    defaults: dict,
    attribute_map: dict,
    world: int,
    *,
    fill: bool = False,
    head_dim: int = 8,
    prefix: int | None = None,
    nested: bool = False,
    patterns: bool = False,
    sections: bool = False,
    rope_keys: tuple[str, ...] = (),
    layer_kinds: dict[str, list[str]] | None = None,
) -> dict:
    """Config fields to override (by the config's own field names), from its default values: the
    reduction rules, one set for every architecture. Grouped-query attention keeps 2 query heads per
    KV head; an architecture whose defaults have as many KV heads as heads keeps that. A size whose
    default is 0 (a rope part of no dims, say) stays 0.

    The fallbacks `small_config` tries when the first reduction does not build: `fill` also sets
    the sizes and counts the defaults leave None (a None the model divides by); `head_dim` a
    wider head; `prefix` cuts the layers to the first `prefix` of the default `layer_types` (not one
    of each kind: for a validator that needs the pattern), with every other layer count
    (`n_*_layers`, `num_*_layers`) scaled to it; `nested` reduces the sub-configs (a composite
    config's `text_config`, `audio_config`, ...) by the same rules; `patterns` keeps the first
    layer of each combination of the per-layer kinds and cuts every per-layer list to those layers
    (`_kept_layers`, `_per_layer_lists`; in sub-configs too); `sections` gives a rope that has
    none multimodal sections (`_rope_sections`). `rope_keys`: the rope keys the config class
    lets its model default (`ignore_keys_at_rope_validation`). `layer_kinds`: the kinds the model
    compares each per-layer pattern field to (`_layer_kinds`); under `fill`, such a field left
    None gets one layer of each kind, and an empty `rope_parameters` one default rope per layer
    type (a model that reads `rope_parameters[layer_type]`)."""
    s = _sizes(world)
    s["head_dim"] = head_dim
    heads_field = attribute_map.get("num_attention_heads", "num_attention_heads")
    kv_field = attribute_map.get("num_key_value_heads", "num_key_value_heads")
    heads, kv = defaults.get(heads_field), defaults.get(kv_field)
    if isinstance(heads, int) and isinstance(kv, int) and heads == kv:
        # multi-head attention stays multi-head (MLA's k and v have every head)
        s["heads"] = s["kv"]
        s["hidden"] = s["heads"] * s["head_dim"]  # many attentions assume hidden = heads x head_dim
    want = {
        "hidden_size": s["hidden"],
        "hidden_sizes": s["hidden"],  # one per stage of an encoder
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv"],
        "head_dim": s["head_dim"],
        "intermediate_size": s["ffn"],
        "vocab_size": VOCAB,
        "moe_intermediate_size": s["expert_ffn"],
        "shared_expert_intermediate_size": s["expert_ffn"],
        "num_experts": 4,
        "num_local_experts": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "sliding_window": SEQ // 2,
        "rotary_dim": s["head_dim"] // 2,
        "use_cache": False,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
    }
    out = {}
    for key, value in want.items():
        field = attribute_map.get(key, key)
        if field not in defaults:
            continue
        default = defaults[field]
        if default is None and not fill and key != "head_dim":
            continue
        if default is None and key in ("q_lora_rank", "rotary_dim"):
            continue  # None: the feature is off (no query LoRA, every dim rotated)
        if default == 0 and key.endswith(("_dim", "_rank")):
            continue  # a part of no dims stays so (NoPE attention: no rope dims)
        if isinstance(default, list) and all(isinstance(v, int) for v in default):
            out[field] = [min(v, value) for v in default]  # one size per layer
            continue
        out[field] = value
    for field, value in defaults.items():
        if isinstance(value, bool) or field in out:
            continue
        if value is None and fill and (rule := _by_pattern(field, 1 << 30, s)) is not None:
            out[field] = rule
        if not isinstance(value, (int, float)):
            continue
        if _DROPOUT.search(field):
            out[field] = 0.0
        elif isinstance(value, int) and (rule := _by_pattern(field, value, s)) is not None:
            out[field] = rule
    out.update(_shuffled_width(defaults, out, attribute_map))
    out.update(_image_grid(defaults))
    out.update(_hidden_channels(defaults, out, attribute_map))
    experts = [f for f in ("num_experts", "num_local_experts", "n_routed_experts") if f in out]
    if experts and defaults.get("num_experts_per_tok", 0) is None:
        out["num_experts_per_tok"] = want["num_experts_per_tok"]  # a router needs its top-k
    if (
        "head_dim" in out
        and defaults.get("head_dim") is not None
        and defaults.get("head_dim") == defaults.get("qk_rope_head_dim")
    ):
        out["head_dim"] = out["qk_rope_head_dim"]  # MLA's rotary head_dim is the rope part, kept so
    parts = [defaults.get(f) for f in ("qk_nope_head_dim", "qk_rope_head_dim")]
    if all(isinstance(v, int) for v in parts) and defaults.get("qk_head_dim") == sum(parts):
        # MLA's query head: the nope and rope parts together, kept so
        out["qk_head_dim"] = sum(
            out.get(f, d) for f, d in zip(("qk_nope_head_dim", "qk_rope_head_dim"), parts)
        )
    for field in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = defaults.get(field)
        if isinstance(value, int) and value >= VOCAB:
            out[field] = VOCAB - 1
        elif isinstance(value, list):
            out[field] = [min(v, VOCAB - 1) for v in value if isinstance(v, int)]
    layers = attribute_map.get("num_hidden_layers", "num_hidden_layers")
    types = defaults.get("layer_types")
    if isinstance(types, list) and types and prefix is not None:
        out["layer_types"] = types[:prefix]
        out[layers] = prefix
        out.update(_scaled_layer_counts(defaults, layers, prefix))
        for field, value in defaults.items():  # one value per layer: the first `prefix`
            if isinstance(value, list) and len(value) == len(types) and field != "layer_types":
                out[field] = out.get(field, value)[:prefix]
    elif isinstance(types, list) and types:
        distinct = list(dict.fromkeys(types))
        kept = distinct if len(distinct) >= 2 else distinct * 2
        out["layer_types"] = kept
        out[layers] = len(kept)
    elif layers in defaults:
        out[layers] = 2
    kept = _kept_layers(defaults, layers) if patterns else None
    if kept:
        out.update(_per_layer_lists(defaults, out, layers, kept))
    if fill:
        out.update(_filled_layer_patterns(defaults, out, layers, layer_kinds or {}))
    out.update(_rope_sections(defaults, out, attribute_map, rope_keys, sections))
    for field, value in defaults.items():
        if _per_layer(value):  # per-layer overrides ({"05": {"head_dim": 512}}): reduced alike
            out[field] = _per_layer_reduced(
                value, defaults, out, attribute_map, world, head_dim, kept
            )
    if nested:
        for field, value in defaults.items():
            if isinstance(value, dict) and isinstance(value.get("model_type"), str):
                sub_cls = CONFIG_MAPPING.get(value["model_type"]) if available() else None
                sub_map = dict(getattr(sub_cls, "attribute_map", {}) or {})
                sub = small_overrides(
                    value, sub_map, world, fill=fill, head_dim=head_dim, patterns=patterns
                )
                out[field] = {**value, **sub}
    return out


_CHANNELS = re.compile(r"_channels?$")


def _hidden_channels(defaults: dict, out: dict, attribute_map: dict) -> dict:
    """Channel counts whose default is the hidden size (a conformer's pointwise and depthwise
    convolutions, `ext_pw_out_channel`, `nemo_conv_channels`): the hidden size reduced, as the
    residual stream they add into has; those of another default keep their rules."""
    field = attribute_map.get("hidden_size", "hidden_size")
    hidden, reduced = defaults.get(field), out.get(field)
    if not isinstance(hidden, int) or not isinstance(reduced, int):
        return {}
    return {
        f: reduced
        for f, v in defaults.items()
        if _CHANNELS.search(f) and v == hidden and not isinstance(v, bool) and f not in out
    }


def _shuffled_width(defaults: dict, out: dict, attribute_map: dict) -> dict:
    """A config that shuffles pixels into channels (`pixel_shuffle_ratio` r < 1: r x r patches
    become one of 1/r^2 times the width) feeds the shuffled hidden states, hidden / r^2 wide, to
    an MLP whose input width is `intermediate_size`: reduced, that width is hidden / r^2, tied
    so (the default config's own sizes need not tie them: the shipped ones do)."""
    ratio = defaults.get("pixel_shuffle_ratio")
    hidden = out.get(attribute_map.get("hidden_size", "hidden_size"))
    if not isinstance(ratio, float) or not 0 < ratio < 1 or not isinstance(hidden, int):
        return {}
    if "intermediate_size" not in out:
        return {}
    return {"intermediate_size": round(hidden / ratio**2)}


MAX_GRID = 16  # patches per side of the reduced image: a few hundred tokens at most


def _image_grid(defaults: dict) -> dict:
    """An image of more than MAX_GRID patches per side (`image_size` / `patch_size`) made 8
    patches per side: the encoder's sequence (and its position table) shrinks with it, and 8 is a
    multiple of the merge and shuffle factors (2, 4) the encoders group patches by."""
    size, patch = defaults.get("image_size"), defaults.get("patch_size")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (size, patch)):
        return {}
    return {"image_size": 8 * patch} if patch > 0 and size // patch > MAX_GRID else {}


def _kept_layers(defaults: dict, layers: str) -> list[int]:
    """The default layers kept under `patterns`: the first of each distinct combination of the
    per-layer kinds (every list of strings as long as the default depth: `layer_types`,
    `mlp_layer_types`, ...), at least 2; without kinds, the first 2 (an encoder's stages, each
    with its own sizes). A depth of 3 or less has no pattern to cut."""
    total = defaults.get(layers)
    if not isinstance(total, int) or total < 4:
        return []
    kinds = [
        v
        for v in defaults.values()
        if isinstance(v, list) and len(v) == total and all(isinstance(x, str) for x in v)
    ]
    if not kinds:
        return [0, 1]  # per-stage sizes with no kinds: the first two stages
    firsts = dict.fromkeys(tuple(k[i] for k in kinds) for i in range(total))
    kept = [next(i for i in range(total) if tuple(k[i] for k in kinds) == c) for c in firsts]
    if len(kept) < 2:
        kept.append(next(i for i in range(total) if i not in kept))
    return sorted(kept)


def _per_layer_lists(defaults: dict, out: dict, layers: str, kept: list[int]) -> dict:
    """Under `patterns`: every per-layer list (one value per default layer: the kinds, and a
    `layer_rope_theta` or sizes alike) cut to the `kept` layers, and the depth set to their
    count, so that a validator comparing each list's length to the depth holds, and a model
    indexing a list by layer reads the value of the layer it stands for."""
    total = defaults[layers]
    fixed: dict = {layers: len(kept)}
    for field, value in defaults.items():
        if isinstance(value, list) and len(value) == total:
            base = out.get(field, value)
            fixed[field] = [base[i] for i in kept] if len(base) == total else base
    return fixed


def _filled_layer_patterns(defaults: dict, out: dict, layers: str, kinds: dict) -> dict:
    """Under `fill`: a per-layer pattern field the defaults leave None (`layer_types`,
    `mlp_layer_types`) -> one layer of each kind its model compares it to (at least 2 layers);
    an empty `rope_parameters` beside a `layer_types` -> one default rope per layer type."""
    fixed: dict = {}
    for field, values in kinds.items():
        if field in defaults and defaults[field] is None and values:
            n = max(len(values), out.get(layers, 2) or 2)
            fixed[field] = [values[i % len(values)] for i in range(n)]
            fixed[layers] = max(fixed.get(layers, 0), n)
    types = fixed.get("layer_types", out.get("layer_types", defaults.get("layer_types")))
    if defaults.get("rope_parameters") == {} and isinstance(types, list) and types:
        theta = defaults.get("rope_theta") or 10000.0
        fixed["rope_parameters"] = {
            t: {"rope_type": "default", "rope_theta": theta} for t in dict.fromkeys(types)
        }
    return fixed


_COMPARED = re.compile(r"config\.(\w*layer_types)\[[^\]]+\]\s*(?:==|!=)\s*[\"'](\w+)[\"']")


def _layer_kinds(config_cls) -> dict[str, list[str]]:
    """The kinds each per-layer pattern field takes, read from the architecture's modeling module:
    the string literals it compares `config.<field>[i]` to (`config.mlp_layer_types[i] ==
    "sparse"`); `layer_types` also holds "full_attention", the layer type transformers' attention
    masks are keyed by."""
    import importlib

    try:
        module = importlib.import_module(
            config_cls.__module__.replace(".configuration_", ".modeling_")
        )
        source = inspect.getsource(module)
    except Exception:  # noqa: BLE001 - no modeling source: no kinds known
        return {}
    kinds: dict[str, list[str]] = {}
    for field, value in _COMPARED.findall(source):
        kinds.setdefault(field, ["full_attention"] if field == "layer_types" else [])
        if value not in kinds[field]:
            kinds[field].append(value)
    return kinds


def _per_layer(value) -> bool:
    """Whether a config value holds per-layer overrides: a dict keyed by layer index whose values
    are dicts of config fields."""
    return (
        isinstance(value, dict)
        and bool(value)
        and all(str(k).isdigit() and isinstance(v, dict) for k, v in value.items())
    )


def _per_layer_reduced(
    value: dict,
    defaults: dict,
    out: dict,
    attribute_map: dict,
    world: int,
    head_dim: int,
    kept: list[int] | None = None,
) -> dict:
    """Per-layer overrides reduced by the same rules, re-keyed to the kept layers: the override of
    a layer of a kind (in the default `layer_types`) goes to the first kept layer of that kind,
    one override per kind; with the layers `kept` (`_kept_layers`), that of each kept layer goes to
    its place among them; else those of the first 2 layers stay. A dim or rank
    that is a multiple of the default's keeps that multiple of the reduced value (a global layer's
    head twice as wide stays twice as wide)."""
    old, new = defaults.get("layer_types"), out.get("layer_types")
    reduced = {}
    for key, fields in value.items():
        index = int(key)
        if kept:
            if index not in kept:
                continue
            index = kept.index(index)
        elif old and new:
            kind = old[index] if index < len(old) else None
            if kind not in new:
                continue
            index = new.index(kind)
        elif index >= 2:
            continue
        small = {**fields, **small_overrides(fields, attribute_map, world, head_dim=head_dim)}
        for field, v in fields.items():
            d, r = defaults.get(field), out.get(field)
            if (
                field.endswith(("_dim", "_rank"))
                and all(isinstance(x, int) and not isinstance(x, bool) for x in (v, d, r))
                and d > 0
                and v % d == 0
            ):
                small[field] = r * (v // d)
        reduced.setdefault(
            str(index).zfill(len(str(key))) if isinstance(key, str) else index, small
        )
    return reduced


_LAYER_COUNT = re.compile(r"^(n|num)_\w+_layers$")


def _scaled_layer_counts(defaults: dict, layers: str, kept: int) -> dict:
    """The other layer counts (`n_input_layers`, `num_kv_shared_layers`, ...) scaled from the
    default depth to `kept` layers, rounded so that counts summing to the depth still do."""
    total = defaults.get(layers)
    fields = [
        f
        for f, v in defaults.items()
        if f != layers and _LAYER_COUNT.match(f) and isinstance(v, int) and not isinstance(v, bool)
    ]
    if not isinstance(total, int) or total <= 0 or not fields:
        return {}
    parts = [defaults[f] for f in fields]
    target = round(sum(parts) * kept / total)
    return dict(zip(fields, _apportion(parts, target)))


def _apportion(parts: list[int], total: int) -> list[int]:
    """`parts` scaled to sum to `total` (largest remainders), each at least 0."""
    whole = sum(parts)
    if whole <= 0:
        return [0 for _ in parts]
    exact = [p * total / whole for p in parts]
    out = [int(x) for x in exact]
    order = sorted(range(len(parts)), key=lambda i: out[i] - exact[i])
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


def _rope_dim(config: dict, attribute_map: dict) -> float | None:
    """The rotated dims per head: the MLA rope part, else the head dim (or hidden / heads)."""
    rope = config.get("qk_rope_head_dim")
    if isinstance(rope, int) and rope > 0:
        return rope
    head = config.get(attribute_map.get("head_dim", "head_dim"))
    if isinstance(head, int) and head > 0:
        return head
    hidden = config.get(attribute_map.get("hidden_size", "hidden_size"))
    heads = config.get(attribute_map.get("num_attention_heads", "num_attention_heads"))
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden / heads
    return None


def _rope_sections(
    defaults: dict, out: dict, attribute_map: dict, rope_keys=(), sections: bool = False
) -> dict:
    """Multimodal rope sections (`mrope_section`: how many of the rotated dims each axis of time,
    height and width takes; they sum to half the rotated dims) scaled with the rotated dims, in
    the field itself or in `rope_parameters` (per layer type or not). Where the config leaves the
    sections to its model's default (`mrope_section` a rope key it does not validate, no value;
    or any rope without sections under `sections`), three near-equal sections of the reduced rotated
    dims are set (the first two equal, the last taking the remainder)."""
    old = _rope_dim(defaults, attribute_map)
    new = _rope_dim({**defaults, **out}, attribute_map)
    if not old or not new:
        return {}
    rope = defaults.get("rope_parameters")
    if (
        ("mrope_section" in rope_keys or sections)
        and isinstance(rope, dict)
        and "rope_type" in rope
        and not any("mrope_section" in k for k in defaults)
        and "mrope_section" not in rope
    ):
        factor = rope.get("partial_rotary_factor", defaults.get("partial_rotary_factor")) or 1.0
        half = int(new * factor) // 2
        # near-equal, the first two equal (height and width, which some models rotate together)
        third = half // 3
        return {"rope_parameters": {**rope, "mrope_section": [third, third, half - 2 * third]}}

    def scaled(value):
        if isinstance(value, dict):
            return {
                k: (
                    _apportion(v, round(sum(v) * new / old))
                    if "mrope_section" in k and _ints(v)
                    else scaled(v)
                )
                for k, v in value.items()
            }
        return value

    fixed = {}
    for field, value in defaults.items():
        if "mrope_section" in field and _ints(value):
            fixed[field] = _apportion(value, round(sum(value) * new / old))
        elif field.startswith("rope") and isinstance(value, dict) and scaled(value) != value:
            fixed[field] = scaled(value)
    return fixed


def _ints(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) for v in value)
