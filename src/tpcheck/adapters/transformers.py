"""Check HuggingFace transformers' own tensor-parallel plans (optional extra
`tpcheck[transformers]`, transformers==5.24.0) on CPU/gloo, architecture by architecture.

    tpcheck hf llama mistral --world-size 2 4
    tpcheck hf --all --world-size 2 --json sweep.json --html sweep.html

For one architecture (a `model_type` whose config declares `base_model_tp_plan`):

- **The class checked** (`model_class`): its causal LM (AutoModelForCausalLM's entry, else a
  `*ForCausalLM` class of its modeling module built from its config class), its logits the output
  (`CausalLMLogits`, cross-entropy); else its base model (AutoModel's entry, else a non-head class
  of the modeling module built from its config class), its last hidden state the output
  (`HiddenStates`, mean squared error against a random target: `hidden_loss`). Parameter and module
  names stay the HF ones; transformers resolves the plan for the class built.
- **A shape-reduced config** (`small_config`) from the architecture's own defaults: only the sizes
  shrink (hidden 16 per KV head group, 8-wide heads, 2 query heads per KV head with at least as many
  KV heads as ranks, vocab 128, FFN and expert widths divisible by the world size and by 2 for
  packed gate/up weights, 4 experts, one layer of each layer type and at least 2, rope sections
  scaled with the rotated dims); every dropout is 0 and attention runs `eager`, so both sides
  compute the same math. When that config or its model does not build or run, fallbacks by the same
  rules: None sizes filled, sub-configs reduced, rope sections set, a wider head, a prefix of the
  default layer pattern with the other layer counts scaled (`_fallbacks`).
- **The dense model**: that class built from that config, seeded random weights. Modules that run
  only in float32 (a router casting its input) are found by running the float64 forward and kept
  in float32 in the float64 truth (`_float32_pinned`; a weaker bound there, named in the label).
- **The TP model**: a copy of the dense model holding the dense weights, sharded by transformers
  itself (`PreTrainedModel.maybe_distribute_model`: its plan, its styles, its forward hooks, its
  `distribute_tensor` of each weight) over one mesh per world size (transformers builds two meshes
  per `from_pretrained(distributed_config=...)` and never frees their gloo groups; reused here, a
  sweep of 100+ models keeps a constant number of threads). Its parameters become DTensors, or stay
  plain for replicated ones; `TransformersTP` shows the engine their local shards
  (`adapters.dtensor.LocalShards`).
- **Checked as a tpcheck case** with no plan written: each parameter's placement is inferred from
  the values transformers put on each rank (checker/rank/inference.py), so a rule that shards a
  weight inconsistently is reported by name; the output of every module the plan parallelizes
  (placed as its style lays it out) and of every decoder layer; logits, loss, every gradient, AdamW
  state and weights over the steps, with gradient accumulation; and the **no-grad forward**, which
  transformers runs through another path (local matmuls and a plain `dist.all_reduce`
  instead of DTensor ops).

Architectures that cannot be checked are reported "skipped" with the reason: no token-id input (an
encoder of another modality), a model that needs more than token ids, a config no reduction builds,
a plan with no rule at this world size. Nothing is special-cased per architecture: the class choice
is one rule over the modeling module's classes, the reduction one set of rules over config field
names.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import re
import signal
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpcheck.adapters.dtensor import LocalShards
from tpcheck.checker.case import Case, CaseSpec, RunSettings
from tpcheck.checker.usercode import HF_PREFIX
from tpcheck.errors import UsageError
from tpcheck.parallel.group import TPGroup
from tpcheck.plan import Fused, Placement, Replicate, Shard

PINNED = "5.24.0"
SEQ, BATCH, VOCAB = 8, 2, 128
MAX_PARAMS = 1_000_000  # a shape-reduced model beyond this kept sizes the rules do not know

try:  # imported at module load, before the ranks fork
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_MAPPING_NAMES,
    )

    from tpcheck.adapters import transformers_styles  # noqa: F401 - registers tpcheck's styles
except ImportError as e:  # pragma: no cover - depends on the optional extra
    TRANSFORMERS_ERROR: str | None = (
        f"transformers is not importable ({e}); pip install 'tpcheck[transformers]' "
        f"(transformers=={PINNED})"
    )
else:
    TRANSFORMERS_ERROR = None


def available() -> bool:
    return TRANSFORMERS_ERROR is None


def version() -> str | None:
    return transformers.__version__ if available() else None


class Skip(Exception):
    """An architecture that cannot be checked here, with the reason."""


# ------------------------------------------------------------------------------ architectures


def architectures(names: list[str] | None = None) -> list[str]:
    """The model_types (all of transformers', or those of `names` it knows) whose config class
    declares a TP plan (`base_model_tp_plan`), sorted. Each config class is imported to be read (all
    of them: ~8 s), once per installed transformers: the list of all of them is kept in a file
    (`discovery_cache_path`) under the installation's fingerprint (`_fingerprint`) and read from it
    while the fingerprint matches."""
    if not available():
        raise UsageError(TRANSFORMERS_ERROR)
    everything = _cached_architectures()
    if names is None:
        return everything
    return sorted(n for n in dict.fromkeys(names) if n in everything)


def discovery_cache_path():
    """The file the architectures with a TP plan are kept in: $TPCHECK_CACHE_DIR, else
    $XDG_CACHE_HOME/tpcheck, else ~/.cache/tpcheck; one file per transformers version."""
    import os
    from pathlib import Path

    root = os.environ.get("TPCHECK_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "tpcheck"
    )
    return Path(root) / f"hf-architectures-{transformers.__version__}.json"


def _fingerprint() -> str:
    """What the list depends on: transformers' version and location, its model_type -> config
    class table, and the newest modification time of its configuration files (a reinstall or an
    edited config at the same version makes the list stale). Reads no config class."""
    import glob
    import hashlib
    import os

    root = os.path.dirname(transformers.__file__)
    files = glob.glob(os.path.join(root, "models", "*", "configuration_*.py"))
    newest = max((os.stat(f).st_mtime_ns for f in files), default=0)
    text = repr((transformers.__version__, root, sorted(CONFIG_MAPPING_NAMES.items()), newest))
    return hashlib.sha256(text.encode()).hexdigest()


def _cached_architectures() -> list[str]:
    import json
    import os
    import tempfile

    path, fingerprint = discovery_cache_path(), _fingerprint()
    try:
        kept = json.loads(path.read_text())
        if kept.get("fingerprint") == fingerprint and isinstance(kept.get("architectures"), list):
            return list(kept["architectures"])
    except (OSError, ValueError, AttributeError):
        pass  # none yet, unreadable or not ours: read the config classes
    found = _scan_architectures()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:  # written whole, then renamed: a reader sees all or none
            json.dump({"fingerprint": fingerprint, "architectures": found}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache directory: the list is read again next time
    return found


def _scan_architectures() -> list[str]:
    """Every model_type whose config class declares a TP plan, each config class imported."""
    out = []
    for model_type in CONFIG_MAPPING_NAMES:
        try:
            cls = CONFIG_MAPPING[model_type]
        except Exception:  # noqa: BLE001 - a config class that does not import is not a TP plan we can read
            continue
        if getattr(cls, "base_model_tp_plan", None):
            out.append(model_type)
    return sorted(out)


def model_types() -> list[str]:
    """Every model_type transformers knows, plan or not (nothing imported)."""
    return sorted(CONFIG_MAPPING_NAMES)


LOGITS, HIDDEN = "logits", "hidden states"


@dataclass(frozen=True)
class ModelChoice:
    """The class checked for an architecture and what its output is: `LOGITS` (a causal LM:
    cross-entropy on the logits) or `HIDDEN` (a base model or encoder: its last hidden state,
    mean-squared error against a random target, a loss whose gradient reaches every parameter)."""

    cls: type
    kind: str


def _takes_token_ids(cls) -> bool:
    try:
        return "input_ids" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return False


def _own_classes(config_cls) -> list[type]:
    """The model classes of the config's own modeling module built from that config class (its
    `config_class`), in definition order; abstract `*PreTrainedModel` bases left out."""
    import importlib

    from transformers import PreTrainedModel

    module_name = config_cls.__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - no modeling module: no class to build
        return []
    return [
        v
        for k, v in vars(module).items()
        if isinstance(v, type)
        and issubclass(v, PreTrainedModel)
        and v.__module__ == module_name
        and getattr(v, "config_class", None) is config_cls
        and not k.endswith("PreTrainedModel")
    ]


@functools.cache
def model_class(model_type: str) -> ModelChoice:
    """The class checked for `model_type`, by one rule for every architecture: its causal LM
    (AutoModelForCausalLM's entry, else a `*ForCausalLM` class of its modeling module built from
    its config class); else its base model (AutoModel's entry built from its config class, else a
    class of its modeling module built from its config class that is no task head), seen through
    its last hidden state. Only classes whose forward takes `input_ids`; raises Skip when none."""
    config_cls = CONFIG_MAPPING[model_type]
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if isinstance(name, str) and getattr(transformers, name, None) is not None:
        return ModelChoice(getattr(transformers, name), LOGITS)
    own = _own_classes(config_cls)
    for cls in own:
        if cls.__name__.endswith("ForCausalLM") and _takes_token_ids(cls):
            return ModelChoice(cls, LOGITS)
    base = MODEL_MAPPING_NAMES.get(model_type)
    base_cls = getattr(transformers, base, None) if isinstance(base, str) else None
    candidates = [base_cls] if base_cls is not None else []
    candidates += [c for c in own if "For" not in c.__name__ and c is not base_cls]
    candidates = [c for c in candidates if getattr(c, "config_class", None) is config_cls]
    for cls in candidates:
        if _takes_token_ids(cls):
            return ModelChoice(cls, HIDDEN)
    for cls in candidates:
        if not _unmade_inputs(cls):
            return ModelChoice(cls, HIDDEN)  # run from random pixels or embeddings
    if own or base_cls is not None:
        inputs = sorted({_signature(c) for c in (own or [base_cls])})
        unmade = sorted({i for c in candidates for i in _unmade_inputs(c)})
        raise Skip(
            "it takes no token ids: its models encode another modality "
            f"({'; '.join(inputs[:2])}) and need "
            f"{', '.join(f'`{i}`' for i in unmade) or 'inputs'} that no generic rule makes "
            "(made: token ids, `pixel_values` of its config's image size, random "
            "`*_embeds` / `*hidden_states` of its hidden size)"
        )
    raise Skip(
        "no model class is built from its config class (no causal LM, no base model): it is "
        "a part configured inside another architecture's model"
    )


_EMBEDDED = re.compile(r"(_embeds|hidden_states)$")


def _required_inputs(cls) -> list[str]:
    """The forward's parameters without a default (not `self`, not `*args`/`**kwargs`)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return []
    return [
        p.name
        for p in params
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _unmade_inputs(cls) -> list[str]:
    """The required inputs of a forward that takes no token ids that no generic rule makes: made
    are `pixel_values` (an image of the config's size) and `*_embeds` / `*hidden_states` (random
    vectors of its hidden size). A forward requiring nothing it needs (no input at all) is
    unmade too."""
    required = _required_inputs(cls)
    unmade = [n for n in required if n != "pixel_values" and not _EMBEDDED.search(n)]
    return unmade if required else ["an input"]


def _signature(cls) -> str:
    args = list(inspect.signature(cls.forward).parameters)[1:3]
    return f"{cls.__name__}.forward({', '.join(args)}, ...)"


IDS = (("input_ids", (BATCH, SEQ), "ids"),)


def _input_sets(cls, cfg) -> list[tuple]:
    """The input sets a forward is tried with, in turn, each a tuple of (name, shape, "ids" |
    "float"): token ids; random `inputs_embeds` of the hidden size (a model that embeds nothing
    itself); each of those with random `encoder_hidden_states` where the forward takes them (a
    decoder that cross-attends). A forward taking no token ids: its required inputs,
    `pixel_values` of the config's image size and `*_embeds` / `*hidden_states` of its hidden
    size (`model_class` chose it only when it needs nothing else)."""
    cfg = _own_config(cls, cfg)
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return [IDS]
    hidden = getattr(cfg, "hidden_size", None)
    vector = lambda name: (name, (BATCH, SEQ, hidden), "float")  # noqa: E731
    if "input_ids" in params:
        sets = [IDS]
        if not isinstance(hidden, int):
            return sets
        if "inputs_embeds" in params:
            sets.append((vector("inputs_embeds"),))
        if "encoder_hidden_states" in params:
            sets += [s + (vector("encoder_hidden_states"),) for s in sets]
        return sets
    return [
        tuple(
            (name, _image_shape(cfg), "float") if name == "pixel_values" else vector(name)
            for name in _required_inputs(cls)
        )
    ]


def _image_shape(cfg) -> tuple[int, ...]:
    """(batch, channels, height, width) of the config's images (`num_channels` or `in_channels`,
    `image_size`; 4 patches a side without one)."""
    channels = getattr(cfg, "num_channels", None) or getattr(cfg, "in_channels", None) or 3
    size = getattr(cfg, "image_size", None) or 4 * (getattr(cfg, "patch_size", None) or 16)
    h, w = (size, size) if isinstance(size, int) else tuple(size)[:2]
    return (BATCH, channels, h, w)


def causal_lm_class(model_type: str):
    """The class checked for `model_type` (`model_class(model_type).cls`)."""
    return model_class(model_type).cls


# ------------------------------------------------------------------------------ the small config

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
    (re.compile(r"^num_layers$|^n_layers?$"), 2),
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
    config's `text_config`, `audio_config`, ...) by the same rules; `sections` gives a rope that
    has none multimodal sections (`_rope_sections`). `rope_keys`: the rope keys the config class
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
    if fill:
        out.update(_filled_layer_patterns(defaults, out, layers, layer_kinds or {}))
    out.update(_rope_sections(defaults, out, attribute_map, rope_keys, sections))
    for field, value in defaults.items():
        if _per_layer(value):  # per-layer overrides ({"05": {"head_dim": 512}}): reduced alike
            out[field] = _per_layer_reduced(value, defaults, out, attribute_map, world, head_dim)
    if nested:
        for field, value in defaults.items():
            if isinstance(value, dict) and isinstance(value.get("model_type"), str):
                sub_cls = CONFIG_MAPPING.get(value["model_type"]) if available() else None
                sub_map = dict(getattr(sub_cls, "attribute_map", {}) or {})
                sub = small_overrides(value, sub_map, world, fill=fill, head_dim=head_dim)
                out[field] = {**value, **sub}
    return out


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
    value: dict, defaults: dict, out: dict, attribute_map: dict, world: int, head_dim: int
) -> dict:
    """Per-layer overrides reduced by the same rules, re-keyed to the kept layers: the override of
    a layer of a kind (in the default `layer_types`) goes to the first kept layer of that kind,
    one override per kind; without layer types, those of the first 2 layers stay. A dim or rank
    that is a multiple of the default's keeps that multiple of the reduced value (a global layer's
    head twice as wide stays twice as wide)."""
    old, new = defaults.get("layer_types"), out.get("layer_types")
    reduced = {}
    for key, fields in value.items():
        index = int(key)
        if old and new:
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
        built = built or cfg
        if _runs(model_type, cfg):
            return cfg
    if built is not None:
        return built
    raise first_error


def _runs(model_type: str, cfg) -> bool:
    """Whether the model of `cfg` is within the size cap and its float32 forward runs (of one of
    its input sets: `_input_sets`): on the meta device, else on the CPU (a model that reads
    values)."""
    meta = build_lm(model_type, cfg, torch.float32, device="meta")
    if sum(p.numel() for p in meta.parameters()) > MAX_PARAMS:
        return False
    try:
        _running(model_type, cfg, meta)
    except _Failed:
        return False
    return True


def _running(model_type: str, cfg, meta: nn.Module) -> tuple:
    """(device, model, inputs, output shape) of the first of the architecture's input sets whose
    float32 forward runs: each on the meta device, else on the CPU with real weights (built once,
    only when a meta forward fails). Token ids alone come first, so a model that runs from them is
    run once. Raises the first set's _Failed when none runs."""
    kind = _kind(model_type)
    cpu, first = None, None
    for inputs in _input_sets(model_class(model_type).cls, cfg):
        try:
            return "meta", meta, inputs, _forward(meta, kind, "meta", inputs)
        except _Failed:
            pass
        cpu = cpu or build_lm(model_type, cfg, torch.float32)
        try:
            return "cpu", cpu, inputs, _forward(cpu, kind, "cpu", inputs)
        except _Failed as e:
            first = first or e
    raise first


def _kind(model_type: str) -> str:
    return model_class(model_type).kind


def _fallbacks(defaults: dict) -> list[dict]:
    """The options of `small_overrides` tried in turn."""
    out = [{}, {"fill": True}, {"fill": True, "nested": True}, {"fill": True, "sections": True}]
    out += [{"fill": True, "head_dim": 16}, {"fill": True, "head_dim": 32}]
    types = defaults.get("layer_types")
    if isinstance(types, list) and types:
        kinds = set(types)
        first = next(i + 1 for i in range(len(types)) if set(types[: i + 1]) == kinds)
        out += [{"fill": True, "prefix": n} for n in range(max(first, 2), min(len(types), 16) + 1)]
    return out


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


def _validated(cls, overrides: dict):
    """`cls(**overrides)`; where a validator rejects it stating the value a field requires
    ("requires indexer_kv_heads=1") or a sum it must equal ("head_dim must equal qk_nope_head_dim +
    qk_rope_head_dim", of the reduced values), that value is set and the config built again.
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
    not set: the class's default); (None, None) when it states none this can compute."""
    if required := _REQUIRES.search(message):
        return required.group(1), int(required.group(2))
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


def _first_line(e: BaseException) -> str:
    """The message's first line (with the next one when the first only introduces it: '...:')."""
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    first = (
        " ".join(text[:2]) if len(text) > 1 and text[0].endswith(":") else (text[0] if text else "")
    )
    return first[:300]


# ------------------------------------------------------------------------------ models


def _call_kwargs(model: nn.Module, inputs: dict) -> dict:
    """The forward's keyword arguments: the batch's inputs, and no KV cache where it takes one."""
    kwargs = dict(inputs)
    if "use_cache" in inspect.signature(type(model).forward).parameters:
        kwargs["use_cache"] = False
    return kwargs


def _last_hidden_state(out) -> torch.Tensor:
    """The last hidden state of a base model's output; else its first output (a tuple's, or a
    ModelOutput's first field set: the logits of a head class registered as the base model)."""
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None:
        hidden = out if torch.is_tensor(out) else out[0]
    return hidden


class CausalLMLogits(nn.Module):
    """A causal LM seen as `input_ids -> logits`, under the HF parameter and module names: it shares
    the model's submodules (its `_modules` dict) instead of holding the model as a child."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "lm", lm)
        object.__setattr__(self, "_modules", lm._modules)
        object.__setattr__(self, "_parameters", lm._parameters)
        object.__setattr__(self, "_buffers", lm._buffers)

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.lm(**_call_kwargs(self.lm, inputs)).logits


class HiddenStates(CausalLMLogits):
    """A base model (no LM head) seen as `input_ids -> last hidden state`, under the HF names
    (the same sharing of submodules as `CausalLMLogits`)."""

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return _last_hidden_state(self.lm(**_call_kwargs(self.lm, inputs)))


def wrap(model: nn.Module, kind: str) -> nn.Module:
    """The model seen as `input_ids -> output` for its kind (`LOGITS` or `HIDDEN`)."""
    return CausalLMLogits(model) if kind == LOGITS else HiddenStates(model)


def build_lm(
    model_type: str,
    cfg,
    dtype: torch.dtype,
    device=None,
    tie: bool = True,
    pinned: tuple[str, ...] = (),
) -> nn.Module:
    """The architecture's model (`model_class`) from `cfg`. tie=False: embeddings left untied, as
    `from_pretrained` builds a model it is about to shard (it ties them after the plan is
    applied). `pinned`: modules kept in float32 whatever `dtype` (those that cast their input to
    float32 and so run in no other dtype: `_float32_pinned`)."""
    from transformers import initialization

    cls = model_class(model_type).cls
    cfg = _own_config(cls, cfg)
    untied = initialization.no_tie_weights() if not tie else contextlib.nullcontext()
    with torch.device(device or "cpu"), untied:
        model = cls(copy.deepcopy(cfg))
    model = model.to(dtype).eval()
    for name in pinned:
        model.get_submodule(name).float()
    return model


def _own_config(cls, cfg):
    """The config `cls` is built from: `cfg`, or its sub-config of the class's `config_class` (a
    composite config whose causal-LM entry is the text model's class)."""
    config_cls = getattr(cls, "config_class", None)
    if not isinstance(config_cls, type) or isinstance(cfg, config_cls):
        return cfg
    subs = [v for v in vars(cfg).values() if isinstance(v, config_cls)]
    if subs:
        subs[0]._attn_implementation = "eager"
        subs[0]._experts_implementation = "eager"
        subs[0].use_cache = False
    return subs[0] if subs else cfg


_MESHES: dict[int, tuple] = {}


def mesh_manager(world: int):
    """transformers' DistributedConfig and mesh manager
    for `world` ranks: built once per process."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import initialize_distributed_mesh

    if world not in _MESHES:
        dc = DistributedConfig(tp_size=world)
        _, manager = initialize_distributed_mesh(dc)
        _MESHES[world] = (dc, manager)
    return _MESHES[world]


def resolved_plan(model: nn.Module, world: int, rules: dict[str, str] | None) -> dict[str, str]:
    """transformers' own plan for this model at `world` ranks, one entry per module or parameter."""
    from transformers.distributed import DistributedConfig

    dc = DistributedConfig(tp_size=world, tp_plan=dict(rules) if rules else None)
    tp_plan, _, _ = model._resolve_parallel_plans(dc)
    return tp_plan


class TransformersTP(LocalShards):
    """The TP side: built on the first `load` from the dense weights (a copy of the dense model
    sharded by `maybe_distribute_model`), refilled on a later load by the same `distribute_tensor`
    of each weight to its placement. (The checker loads once; each later step restarts the local
    shards in place through the plan.)"""

    def __init__(
        self, model_type: str, cfg, dtype: torch.dtype, group: TPGroup, rules: dict | None
    ) -> None:
        nn.Module.__init__(self)
        self.model_type, self.cfg, self.dtype_, self.group, self.rules = (
            model_type,
            cfg,
            dtype,
            group,
            rules,
        )
        object.__setattr__(self, "parallel", None)
        self.specs, self.shards, self.comm, self.mesh = {}, nn.ParameterDict(), None, None

    def load(self, state: dict[str, torch.Tensor]) -> None:
        if self.parallel is None:
            self._build(state)
            return
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            for name, p in self.named_parameters():
                full = state[name].to(self.dtype_)
                if name in self.specs:
                    placements = self.specs[name][0]
                    full = distribute_tensor(
                        full, self.mesh, placements, src_data_rank=None
                    ).to_local()
                p.copy_(full)

    def _build(self, state: dict[str, torch.Tensor]) -> None:
        from transformers.distributed import DistributedConfig

        dc, manager = mesh_manager(self.group.world_size)
        if self.rules:
            dc = DistributedConfig(tp_size=self.group.world_size, tp_plan=dict(self.rules))
        lm = build_lm(self.model_type, self.cfg, self.dtype_, tie=False)
        lm.load_state_dict({k: v.to(self.dtype_) for k, v in state.items()}, strict=False)
        lm = type(lm).maybe_distribute_model(lm, dc, manager)
        lm.tie_weights()
        if not any(hasattr(p, "to_local") for p in lm.parameters()):
            raise UsageError(
                f"transformers sharded no parameter of {self.model_type} at world size "
                f"{self.group.world_size}: its plan applied nothing"
            )
        parallel = wrap(lm, model_class(self.model_type).kind)
        LocalShards.__init__(self, parallel, manager.get_mesh("tp"), self.group, None)
        names = {n for n, _ in self.named_parameters()}
        if names != set(state):
            raise UsageError(
                f"{self.model_type}: the sharded model's parameters differ from the dense model's: "
                f"only TP {sorted(names - set(state))[:5]}, only dense "
                f"{sorted(set(state) - names)[:5]}"
            )


# ------------------------------------------------------------------------------ activations

_REPLICATED_OUTPUT = {
    "rowwise",
    "rowwise_rep",
    "rowwise_split_input",
    "colwise_gather_output",
    "colwise_rep",
    "embedding_rowwise",
    "embedding_colwise",
    "all_reduce",
    "moe_tp_experts",
}
_LAYER = re.compile(r"(^|\.)layers\.\d+$")


def activation_placements(
    model: nn.Module, tp_plan: dict[str, str], world: int
) -> dict[str, Placement]:
    """The module outputs checked, placed as the styles lay them out: colwise -> this rank's slice
    of the last dim; packed_colwise -> this rank's slice of each packed part; rowwise, gathered,
    embedding and moe_tp_experts (all-reduced) outputs -> whole on every rank; every decoder layer
    (`*.layers.N`) -> whole (the residual stream). Modules under other styles (MLA, sequence
    parallel) are checked through their layer."""
    modules = dict(model.named_modules())
    out: dict[str, Placement] = {}
    for name in modules:
        if _LAYER.search(name):
            out[name] = Replicate()
    for name, style in tp_plan.items():
        module = modules.get(name)
        if module is None:
            continue  # a parameter rule
        if style == "colwise" and isinstance(module, nn.Linear):
            out[name] = Shard(-1)
        elif (
            style == "packed_colwise"
            and isinstance(module, nn.Linear)
            and module.out_features % (2 * world) == 0
        ):
            half = module.out_features // 2
            out[name] = Fused(-1, (half, half))
        elif style in _REPLICATED_OUTPUT:
            out[name] = Replicate()
    return out


def output_placement(tp_plan: dict[str, str], kind: str = LOGITS) -> Placement:
    """How the TP output relates to the dense one: whole, unless the LM head's rule leaves the
    logits sharded (Skip: no loss transformers applies reads them so). A base model's last
    hidden state comes out of its final norm, whole."""
    if kind != LOGITS:
        return Replicate()
    style = tp_plan.get("lm_head")
    if style in (None, *_REPLICATED_OUTPUT):
        return Replicate()
    raise Skip(
        f"its lm_head rule {style!r} leaves the logits sharded; the loss would need a "
        "vocab-parallel cross-entropy transformers does not apply"
    )


# ------------------------------------------------------------------------------ the case


def batch_maker(inputs: tuple, kind: str = LOGITS, shape: tuple[int, ...] = ()):
    """`make_batch` of the architecture's inputs (`_input_sets`: token ids, or random pixels or
    vectors in the run's dtype) and its target: token labels for a causal LM's logits, a random
    tensor of the output's `shape` for a base model's hidden states."""

    def make_batch(g: torch.Generator, dtype: torch.dtype):
        batch = {
            name: torch.randint(0, VOCAB, size, generator=g)
            if k == "ids"
            else torch.randn(size, generator=g).to(dtype)
            for name, size, k in inputs or IDS
        }
        if kind == LOGITS:
            return batch, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        return batch, torch.randn(shape, generator=g).to(dtype)

    return make_batch


def _make_batch(g: torch.Generator, dtype: torch.dtype):
    return batch_maker(IDS)(g, dtype)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def hidden_batch(shape: tuple[int, ...]):
    """`make_batch` of a base model: token ids and a random target of its hidden states' shape."""

    return batch_maker(IDS, HIDDEN, shape)


def hidden_loss(hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The base model's loss: the mean squared error of its last hidden state against a random
    target. Its gradient (2(h - t)/n) is dense and random, so it reaches every parameter the
    hidden state depends on; a plain sum would not (through a LayerNorm whose gain is uniform the
    sum's gradient cancels)."""
    return F.mse_loss(hidden, target.to(hidden.dtype))


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
    inputs: tuple = ()  # the forward's inputs, (name, shape, "ids" | "float") each: `_input_sets`


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


class _Failed(Exception):
    """A forward that raised: the message and the innermost running module holding parameters."""

    def __init__(self, message: str, module: str | None) -> None:
        super().__init__(message)
        self.message, self.module = message, module


def _forward(model: nn.Module, kind: str, device: str, inputs: tuple = ()) -> torch.Size:
    """The output's shape of one no-grad forward of `inputs`' shapes (zeros; token ids when
    empty); raises _Failed naming the
    innermost module holding parameters that was running when it raised (forward pre-hooks push,
    forward hooks pop)."""
    stack: list[str] = []
    handles = []
    for name, module in model.named_modules():
        if name and any(True for _ in module.parameters()):
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: _push(stack, n)))
            handles.append(module.register_forward_hook(lambda m, a, o: _pop(stack)))
    try:
        with torch.no_grad():
            out = wrap(model, kind)(**_zeros(inputs or IDS, model, device))
        return out.shape
    except Exception as e:  # noqa: BLE001
        raise _Failed(f"{type(e).__name__}: {_first_line(e)}", stack[-1] if stack else None) from e
    finally:
        for h in handles:
            h.remove()


def _zeros(inputs: tuple, model: nn.Module, device: str) -> dict:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {
        name: torch.zeros(shape, dtype=torch.long if k == "ids" else dtype, device=device)
        for name, shape, k in inputs
    }


def _push(stack: list[str], name: str) -> None:
    stack.append(name)  # a hook returning a value would replace the module's input or output


def _pop(stack: list[str]) -> None:
    stack.pop()


def _probe(model_type: str, cfg, meta: nn.Module, kind: str) -> tuple[tuple, tuple, tuple]:
    """(the output's shape, the modules pinned to float32, the inputs) from a forward in float32
    then in float64: on the meta device (shapes and dtypes, no arithmetic, no weights), or on the
    CPU with real weights for a model whose meta forward fails (it reads values: `.item()`); of
    the first input set that runs (`_input_sets`). Raises Skip when the float32 forward of a base
    model fails (it needs more than its inputs made here)."""
    try:
        device, model, inputs, shape = _running(model_type, cfg, meta)
    except _Failed as e:
        if kind == HIDDEN:
            raise Skip(
                f"its model {model_class(model_type).cls.__name__} does not run from the inputs "
                f"made here ({_input_names(model_type, cfg)}): {e.message}"
            ) from None
        return (), (), IDS  # a causal LM that fails is run anyway: its error is the verdict
    return tuple(shape), _float32_pinned(model, kind, device, inputs), inputs


def _input_names(model_type: str, cfg) -> str:
    sets = _input_sets(model_class(model_type).cls, cfg)
    return " or ".join("+".join(name for name, _, _ in inputs) for inputs in sets)


def _float32_pinned(
    model: nn.Module, kind: str, device: str, inputs: tuple = ()
) -> tuple[str, ...]:
    """The modules to keep in float32 so that the model runs with the rest in float64 (the ground
    truth): a module that casts its input to float32 (a router, say) runs in no other dtype. Found
    by running: while the float64 forward fails, the innermost module running when it raised is
    pinned; raises Skip when pinning does not make it run."""
    pinned: list[str] = []
    try:
        while True:
            model.to(torch.float64)
            for name in pinned:
                model.get_submodule(name).float()
            try:
                _forward(model, kind, device, inputs)
            except _Failed as e:
                if e.module is None or e.module in pinned or len(pinned) >= 16:
                    raise Skip(
                        "it does not run in float64, the ground truth tpcheck bounds errors "
                        f"with: {e.message}"
                    ) from None
                pinned.append(e.module)
                continue
            return _outermost(pinned)
    finally:
        model.to(torch.float32)


def _outermost(names: list[str]) -> tuple[str, ...]:
    """`names` without those inside another of them, sorted."""
    return tuple(
        sorted(n for n in names if not any(n.startswith(m + ".") for m in names if m != n))
    )


def prepare_spec(spec: CaseSpec) -> tuple[Prepared, dict[str, str] | None]:
    """(`prepare` of the spec's architecture, the plan rules it overrides) for `spec.block` =
    "hf:<model_type>" (rules in `spec.overrides["tp_plan"]`); Skip becomes bad input naming it."""
    model_type = spec.block[len(HF_PREFIX) :]
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
    label = label or f"{HF_PREFIX}{model_type}/tp{world_size}/{dtype}" + ("/rules" if rules else "")
    if _has_pinned(model_type, world_size, rules):
        label += "/float32-truth"  # its float32-pinned modules bound against a float32 truth
    return CaseSpec(
        block=HF_PREFIX + model_type,
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
