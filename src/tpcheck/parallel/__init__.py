"""The TP library: process-group value, autograd collectives, parallel layers."""

from tpcheck.parallel.collectives import (
    all_reduce_grad_,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from tpcheck.parallel.cross_entropy import vocab_parallel_cross_entropy
from tpcheck.parallel.embedding import VocabParallelEmbedding
from tpcheck.parallel.group import TPGroup
from tpcheck.parallel.layers import ColumnParallelLinear, RowParallelLinear, finalize_grads
from tpcheck.parallel.losses import sp_mse_loss
from tpcheck.parallel.random import ParallelDropout, RNGTracker

__all__ = [
    "TPGroup",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "finalize_grads",
    "all_reduce_grad_",
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "gather_from_tp_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "sp_mse_loss",
    "RNGTracker",
    "ParallelDropout",
]
