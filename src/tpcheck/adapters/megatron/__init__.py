"""Check real Megatron-Core layers (optional extra
`tpcheck[megatron]`, megatron-core==0.16.1) on CPU/gloo.

Cases: `column_case` (ColumnParallelLinear), `row_case` (RowParallelLinear), `embedding_case`
(VocabParallelEmbedding), `cross_entropy_case` (vocab_parallel_cross_entropy after a column-parallel
head), `gated_mlp_case` (the gated MLP built from a TransformerConfig), `transformer_layer_case` (a
TransformerLayer: GQA self-attention + gated MLP, optionally sequence parallel) and `gpt_model_case`
(a tiny GPTModel returning its per-token vocab-parallel cross-entropy), each against a dense twin
with the same parameter names.

Running Megatron-Core on CPU needs four things, done by `init_megatron(group)` on every rank
(runtime.py; the single layers are in layers.py, the transformer layer and the GPT model in
models.py):
- `torch.cuda.current_device` is replaced by a function returning the CPU device (its layers ask for
  it when they allocate weights; a process-wide monkeypatch, only on the rank processes);
- Megatron's CUDA RNG tracker is replaced by its CPU counterpart (`_CPUTracker`): the same named
  states, seeded as `model_parallel_cuda_manual_seed` seeds them (the model-parallel one
  `seed + 2718 + tp rank`), swapped into the CPU generator by `fork()` (DotProductAttention forks
  around the attention dropout, TransformerBlock around every layer under SP, the embedding around
  its dropout under SP), so the cases can train with dropout and tpcheck checks where
  Megatron draws each mask;
- the config sets `use_cpu_initialization=True, gradient_accumulation_fusion=False`;
- `parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)` on the rank's
  existing gloo group (once per process: a rank pool serves one world size).
Attention gets an explicit causal mask (`causal_mask`): given None, Megatron makes it on "cuda".
Megatron's layers return `(output, bias)`; `Unpack` keeps the output (bias is None when
`skip_bias_add=False`). Megatron's collectives do not pass through a TPGroup, so the case ledger
holds only the checker's own; every tensor is still compared on every rank.
"""

from tpcheck.adapters.megatron.layers import (
    column_case,
    cross_entropy_case,
    embedding_case,
    gated_mlp_case,
    row_case,
)
from tpcheck.adapters.megatron.models import gpt_model_case, transformer_layer_case
from tpcheck.adapters.megatron.runtime import MEGATRON_ERROR, available, init_megatron

__all__ = [
    "MEGATRON_ERROR",
    "available",
    "column_case",
    "cross_entropy_case",
    "embedding_case",
    "gated_mlp_case",
    "gpt_model_case",
    "init_megatron",
    "row_case",
    "transformer_layer_case",
]
