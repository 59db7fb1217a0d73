"""Check HuggingFace transformers' own tensor-parallel plans (optional extra
`tpcheck[transformers]`, transformers==5.24.0) on CPU/gloo, architecture by architecture.

    tpcheck hf llama mistral --world-size 2 4
    tpcheck hf --all --world-size 2 --json sweep.json --html sweep.html

For one architecture (a `model_type` whose config declares `base_model_tp_plan` and that has a
causal-LM class):

- **A shape-reduced config** (`small_config`) from the architecture's own defaults: only the sizes
  shrink (hidden 16 per KV head group, 8-wide heads, 2 query heads per KV head with at least as many
  KV heads as ranks, vocab 128, FFN and expert widths divisible by the world size and by 2 for
  packed gate/up weights, 4 experts, one layer of each layer type and at least 2); every dropout is
  0 and attention runs `eager`, so both sides compute the same math.
- **The dense model**: the causal-LM class built from that config, seeded random weights; its logits
  for `input_ids` are the output (`CausalLMLogits`; parameter and module names stay the HF ones).
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

Architectures that cannot be checked are reported "skipped" with the reason (`screen`): no causal-LM
class, a config the reduction cannot build, a plan with no rule at this world size. Nothing is
special-cased per architecture: the reduction is one set of rules over config field names.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
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
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
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


def causal_lm_class(model_type: str):
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        raise Skip("no causal-LM class (AutoModelForCausalLM has no entry for it)")
    cls = getattr(transformers, name, None)
    if cls is None:
        raise Skip(f"its causal-LM class {name} is not importable")
    return cls


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
)


def _by_pattern(field: str, value: int, s: dict) -> int | None:
    for pattern, size in _PATTERNS:
        if pattern.search(field):
            target = s[size] if isinstance(size, str) else size
            return target if value > target else None
    return None


def small_overrides(defaults: dict, attribute_map: dict, world: int) -> dict:
    """Config fields to override (by the config's own field names), from its default values: the
    reduction rules, one set for every architecture. Grouped-query attention keeps 2 query heads per
    KV head; an architecture whose defaults have as many KV heads as heads keeps that."""
    s = _sizes(world)
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
        if field in defaults and (defaults[field] is not None or key in ("head_dim",)):
            if key in ("q_lora_rank", "sliding_window", "rotary_dim") and defaults[field] is None:
                continue
            out[field] = value
    for field, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or field in out:
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
    for field in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = defaults.get(field)
        if isinstance(value, int) and value >= VOCAB:
            out[field] = VOCAB - 1
        elif isinstance(value, list):
            out[field] = [min(v, VOCAB - 1) for v in value if isinstance(v, int)]
    layers = attribute_map.get("num_hidden_layers", "num_hidden_layers")
    types = defaults.get("layer_types")
    if isinstance(types, list) and types:
        distinct = list(dict.fromkeys(types))
        kept = distinct if len(distinct) >= 2 else distinct * 2
        out["layer_types"] = kept
        out[layers] = len(kept)
    elif layers in defaults:
        out[layers] = 2
    return out


def small_config(model_type: str, world: int):
    """The architecture's default config, shape-reduced; raises Skip when it cannot be built."""
    cls = CONFIG_MAPPING[model_type]
    try:
        default = cls()
    except Exception as e:  # noqa: BLE001 - the architecture's own default config does not build
        raise Skip(
            f"its default config does not build: {type(e).__name__}: {_first_line(e)}"
        ) from None
    overrides = small_overrides(
        default.to_dict(), dict(getattr(cls, "attribute_map", {}) or {}), world
    )
    try:
        # the rest: the defaults, derived fields recomputed from the new sizes
        cfg = cls(**overrides)
    except Exception as e:  # noqa: BLE001
        raise Skip(
            f"the shape-reduced config does not build: {type(e).__name__}: {_first_line(e)}"
        ) from None
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the grouped-matmul kernels take no float64 (the truth)
    cfg.use_cache = False
    return cfg


def _first_line(e: BaseException) -> str:
    """The message's first line (with the next one when the first only introduces it: '...:')."""
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    first = (
        " ".join(text[:2]) if len(text) > 1 and text[0].endswith(":") else (text[0] if text else "")
    )
    return first[:300]


# ------------------------------------------------------------------------------ models


class CausalLMLogits(nn.Module):
    """A causal LM seen as `input_ids -> logits`, under the HF parameter and module names: it shares
    the model's submodules (its `_modules` dict) instead of holding the model as a child."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "lm", lm)
        object.__setattr__(self, "_modules", lm._modules)
        object.__setattr__(self, "_parameters", lm._parameters)
        object.__setattr__(self, "_buffers", lm._buffers)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def build_lm(model_type: str, cfg, dtype: torch.dtype, device=None, tie: bool = True) -> nn.Module:
    """The causal LM from `cfg`. tie=False: embeddings left untied, as `from_pretrained` builds a
    model it is about to shard (it ties them after the plan is applied)."""
    from transformers import initialization

    cls = causal_lm_class(model_type)
    untied = initialization.no_tie_weights() if not tie else contextlib.nullcontext()
    with torch.device(device or "cpu"), untied:
        model = cls(copy.deepcopy(cfg))
    return model.to(dtype).eval()


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
        parallel = CausalLMLogits(lm)
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
}
_LAYER = re.compile(r"(^|\.)layers\.\d+$")


def activation_placements(
    model: nn.Module, tp_plan: dict[str, str], world: int
) -> dict[str, Placement]:
    """The module outputs checked, placed as the styles lay them out: colwise -> this rank's slice
    of the last dim; packed_colwise -> this rank's slice of each packed part; rowwise, gathered and
    embedding outputs -> whole on every rank; every decoder layer (`*.layers.N`) -> whole (the
    residual stream). Modules under other styles (experts, MLA, sequence parallel) are checked
    through their layer."""
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


def output_placement(tp_plan: dict[str, str]) -> Placement:
    style = tp_plan.get("lm_head")
    if style in (None, *_REPLICATED_OUTPUT):
        return Replicate()
    raise Skip(
        f"its lm_head rule {style!r} leaves the logits sharded; the loss would need a "
        "vocab-parallel cross-entropy transformers does not apply"
    )


# ------------------------------------------------------------------------------ the case


def _make_batch(g: torch.Generator, dtype: torch.dtype):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids}, labels


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@dataclass(frozen=True)
class Prepared:
    """What the parent learns of an architecture before any rank runs it."""

    model_type: str
    config: object
    tp_plan: dict
    activations: dict
    output: Placement


def prepare(model_type: str, world: int, rules: dict | None = None) -> Prepared:
    """The small config, transformers' resolved plan and the checked activations
    (a model on the meta
    device: no weights). Raises Skip with the reason when the architecture cannot be checked.
    Cached: the parent prepares each architecture once for the sweep and once more to
    validate its case."""
    return _prepare(model_type, world, tuple(sorted((rules or {}).items())))


@functools.cache
def _prepare(model_type: str, world: int, rule_items: tuple) -> Prepared:
    rules = dict(rule_items)
    if not available():
        raise UsageError(TRANSFORMERS_ERROR)
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UsageError(
            f"unknown architecture {model_type!r}: not a transformers model_type; "
            "`tpcheck hf --list` lists those with a TP plan"
        )
    causal_lm_class(model_type)
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
    if (problem := _float64_problem(model_type, cfg, meta)) is not None:
        raise Skip(
            f"it does not run in float64, the ground truth tpcheck bounds errors with: {problem}"
        )
    try:
        tp_plan = resolved_plan(meta, world, rules) if world > 1 else {}
    except Exception as e:  # noqa: BLE001
        raise Skip(
            f"transformers cannot resolve its plan: {type(e).__name__}: {_first_line(e)}"
        ) from None
    if world > 1 and not tp_plan:
        raise Skip("its resolved TP plan is empty for the causal-LM class")
    return Prepared(
        model_type,
        cfg,
        tp_plan,
        activation_placements(meta, tp_plan, world),
        output_placement(tp_plan),
    )


def _float64_problem(model_type: str, cfg, meta: nn.Module) -> str | None:
    """Why the model's forward fails in float64 but not in float32 (a router or a kernel pinned to
    float32, say); None when float64 runs. First on the meta device (shapes and dtypes, no
    arithmetic, no weights); a model whose meta forward fails in float32 too (it reads values:
    `.item()`) is tried on the CPU with real weights."""

    def fails(model: nn.Module, dtype: torch.dtype, device: str) -> str | None:
        try:
            with torch.no_grad():
                model.to(dtype)(
                    input_ids=torch.zeros(BATCH, SEQ, dtype=torch.long, device=device),
                    use_cache=False,
                )
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {_first_line(e)}"
        return None

    if fails(meta, torch.float32, "meta") is None:
        return fails(meta, torch.float64, "meta")
    real = build_lm(model_type, cfg, torch.float32)
    return fails(real, torch.float64, "cpu") if fails(real, torch.float32, "cpu") is None else None


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
    model_type, cfg = prep.model_type, prep.config

    def build_dense(dtype: torch.dtype) -> nn.Module:
        return CausalLMLogits(build_lm(model_type, cfg, dtype))

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
        make_batch=_make_batch,
        loss=lm_loss,
        grad_inputs=(),
        output_placement=prep.output,
        activations=prep.activations,
        no_grad_forward=True,
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
    return CaseSpec(
        block=HF_PREFIX + model_type,
        world_size=world_size,
        run=RunSettings(dtype=dtype, **settings),
        overrides=overrides,
        label=label,
    )
