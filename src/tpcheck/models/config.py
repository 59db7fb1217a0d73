"""One config builds a dense model and its TP twin. Presets name the shapes we check."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tpcheck.errors import UsageError

GATE_UP_LAYOUTS = ("stacked", "concat")


# the dimensions a block may split over the ranks: the FFN width, the attention heads (and the KV
# heads with them), the vocabulary
SHARDED = ("ffn", "heads", "vocab")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes of a block or tiny LM. Activations are `[seq, batch, hidden]`.

    dropout: hidden dropout (Megatron's `hidden_dropout`): after the embedding, and on each block's
    output before its residual add. attention_dropout: on the attention
    probabilities. Both 0 by default.

    gate_up_layout: "stacked" stores the SwiGLU gate/up weight as [2, ffn, hidden] (the seed's
    layout; TP shards dim 1); "concat" stores it as [gate; up] = [2*ffn, hidden] (Megatron-Core's
    fc1), where rank r holds [gate_r; up_r] (`Fused`).
    """

    seq: int
    batch: int
    hidden: int
    ffn: int
    heads: int = 0
    kv_heads: int = 0
    vocab: int = 0
    layers: int = 1
    eps: float = 1e-6
    rope_theta: float = 10000.0
    gate_up_layout: str = "stacked"
    tie_embeddings: bool = False
    dropout: float = 0.0
    attention_dropout: float = 0.0
    # one element of a hidden-state input [s, b, h] set to this value (0: none): the "massive
    # activation" of an LLM's residual stream, for measuring bounds and detectability with outliers
    outlier: float = 0.0

    def __post_init__(self) -> None:
        for name in ("dropout", "attention_dropout"):
            p = getattr(self, name)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
                raise UsageError(f"{name} must be a probability in [0, 1), got {p!r}")
        for name in ("seq", "batch", "hidden", "ffn", "layers"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.gate_up_layout not in GATE_UP_LAYOUTS:
            raise UsageError(
                f"gate_up_layout {self.gate_up_layout!r} is not one of {GATE_UP_LAYOUTS}"
            )
        if self.heads:
            if self.hidden % self.heads:
                raise UsageError(f"hidden {self.hidden} does not divide by heads {self.heads}")
            kv = self.kv_heads or self.heads
            if self.heads % kv:
                raise UsageError(f"heads {self.heads} does not divide by kv_heads {kv}")
            if (self.hidden // self.heads) % 2:
                raise UsageError(f"head dim {self.hidden // self.heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def check_world_size(
        self, world: int, *, sequence_parallel: bool = False, dims: tuple[str, ...] = SHARDED
    ) -> None:
        """Raise UsageError, naming both numbers, unless the dimensions in `dims` (of `SHARDED`:
        those a block splits over the ranks; a block checks its own) split over `world` ranks."""
        if world < 1:
            raise UsageError(f"world size must be >= 1, got {world}")
        if "ffn" in dims and self.ffn % world:
            raise UsageError(
                f"world size {world} does not divide the FFN width {self.ffn}; "
                f"use a world size that divides {self.ffn}"
            )
        if "heads" in dims and self.heads and self.heads % world:
            raise UsageError(f"world size {world} does not divide the number of heads {self.heads}")
        kv = self.num_kv_heads if self.heads and "heads" in dims else 0
        if kv and kv % world and world % kv:
            raise UsageError(
                f"kv_heads {kv} and world size {world}: one must divide the other "
                "(KV heads are sharded, or replicated over world // kv_heads ranks)"
            )
        if "vocab" in dims and self.vocab and self.vocab % world:
            raise UsageError(
                f"world size {world} does not divide the vocabulary {self.vocab}; "
                "pad the vocabulary to a multiple of the world size"
            )
        if sequence_parallel and self.seq % world:
            raise UsageError(
                f"sequence parallelism: world size {world} does not divide seq {self.seq}"
            )


PRESETS: dict[str, ModelConfig] = {
    # The seed fixture: reference.py's shapes.
    "seed": ModelConfig(seq=3, batch=2, hidden=8, ffn=12),
    # A tiny debug transformer: every feature on, seconds to check.
    "tiny": ModelConfig(seq=8, batch=2, hidden=32, ffn=64, heads=4, kv_heads=2, vocab=64, layers=2),
    # The layer shapes of Llama-3-8B (one layer; seq 256, batch 1).
    "llama3-8b-layer": ModelConfig(
        seq=256,
        batch=1,
        hidden=4096,
        ffn=14336,
        heads=32,
        kv_heads=8,
        vocab=128256,
        layers=1,
        rope_theta=500000.0,
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
