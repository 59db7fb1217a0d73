"""Vocab-parallel embedding (Megatron's VocabParallelEmbedding).

The dense weight `[V, h]` is sharded on the vocabulary: rank r holds rows r*V/tp .. (r+1)*V/tp - 1,
i.e. `Shard(0)`. Each rank looks up only the token ids it owns: ids outside its block are masked to
0 (a valid local row) and their output rows zeroed BEFORE the reduction, so that summing over ranks
gives every token exactly one embedding row. The reduction is an all-reduce (output replicated
`[s, b, h]`) or, under sequence parallelism, a reduce-scatter along the sequence (`[s/tp, b, h]`).

The weight's gradient is complete on each rank (the backward of either reduction hands every rank
the full output grad), so nothing is reduced in the optimizer phase.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpcheck.parallel.collectives import (
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
)
from tpcheck.parallel.group import TPGroup
from tpcheck.parallel.layers import ParallelModule, divide


class VocabParallelEmbedding(ParallelModule):
    """tokens `[s, b]` (global ids) -> `[s, b, h]` (or `[s/tp, b, h]` under sequence parallelism).

    Collectives: forward all-reduce (reduce-scatter
    under SP); backward identity (all-gather under SP).
    """

    def __init__(
        self,
        vocab: int,
        hidden: int,
        group: TPGroup,
        *,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(group)
        self.vocab_local = divide(
            vocab, group.world_size, "vocabulary size of a vocab-parallel embedding"
        )
        self.vocab_start = group.rank * self.vocab_local
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(self.vocab_local, hidden, dtype=dtype))  # [V/tp, h]
        nn.init.normal_(self.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # [s, b]
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_start + self.vocab_local)
        ids_local = torch.where(outside, torch.zeros_like(tokens), tokens - self.vocab_start)
        partial = F.embedding(ids_local, self.weight)  # [s, b, h]
        # other ranks' tokens contribute nothing
        partial = partial.masked_fill(outside[..., None], 0.0)
        if self.sequence_parallel:
            # [s/tp, b, h]
            return reduce_scatter_to_sequence_parallel_region(partial, self.group, self.site)
        return reduce_from_tp_region(partial, self.group, self.site)  # [s, b, h]
