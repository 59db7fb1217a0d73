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
  the values transformers put on each rank (checker/rank/plan_inference.py), so a rule that shards a
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

One module per job: `common` (the pinned version, `available`, `Skip`, the shapes), `discovery`
(the architectures with a plan, cached), `build` (the class checked, the dense and TP models, the
placements of the outputs), `inputs` (input sets, batches, losses), `reduction` (the reduction
rules), `configs` (the small config that builds and runs), `probe` (forwards run in the parent:
output shape, float32-pinned modules), `sweep` (`prepare`, `prepare_all`, `hf_spec`, `hf_case`) and
`styles` (the parallel styles tpcheck registers in transformers).
"""

from tpcheck.adapters.transformers.build import ModelChoice, build_lm, model_class
from tpcheck.adapters.transformers.common import (
    BATCH,
    HIDDEN,
    LOGITS,
    MAX_PARAMS,
    PINNED,
    TRANSFORMERS_ERROR,
    VOCAB,
    Skip,
    available,
    version,
)
from tpcheck.adapters.transformers.configs import small_config
from tpcheck.adapters.transformers.discovery import (
    architectures,
    discovery_cache_path,
    model_types,
)
from tpcheck.adapters.transformers.inputs import IDS, batch_maker
from tpcheck.adapters.transformers.reduction import small_overrides
from tpcheck.adapters.transformers.sweep import (
    hf_case,
    hf_spec,
    prepare,
    prepare_all,
    prepare_spec,
)

__all__ = [
    "BATCH",
    "HIDDEN",
    "IDS",
    "LOGITS",
    "MAX_PARAMS",
    "PINNED",
    "TRANSFORMERS_ERROR",
    "VOCAB",
    "ModelChoice",
    "Skip",
    "architectures",
    "available",
    "batch_maker",
    "build_lm",
    "discovery_cache_path",
    "hf_case",
    "hf_spec",
    "model_class",
    "model_types",
    "prepare",
    "prepare_all",
    "prepare_spec",
    "small_config",
    "small_overrides",
    "version",
]
