"""Random numbers under tensor parallelism: where each rank must draw the same mask, and where not.

The rule Megatron-Core's model-parallel RNG tracker enforces (`get_cuda_rng_tracker().fork()`):
- in a region whose activations are sharded over the ranks (a rank's attention heads, the
  column-parallel FFN activations, the sequence shards under sequence parallelism) each rank must
  draw a *different* mask, or the shards' masks are copies of one another (correlated dropout);
- in a replicated region (after the row-parallel all-reduce, without sequence parallelism) every
  rank must draw the *same* mask, or the replicas drift apart.

`RNGTracker` holds a model-parallel generator state seeded per rank (`seed + 2718 + rank`,
Megatron's offset) next to the default generator (seeded the same on every rank by the training
script), and `fork()` swaps it in for the duration of a block. `ParallelDropout` is dropout for a
sharded region: it draws inside `fork()`. Plain `nn.Dropout` is dropout for a replicated region. The
tracker is a value held by the modules that use it (never a module global), like the process group.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tpcheck.parallel.group import TPGroup

MODEL_PARALLEL_OFFSET = 2718  # Megatron-Core's offset of the tensor-model-parallel seed


def default_rng_state(device: torch.device) -> torch.Tensor:
    """The state of `device`'s default generator (what F.dropout draws from there)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


@contextlib.contextmanager
def drawing_from(states: dict, name: str, device: torch.device = torch.device("cpu")):
    """Inside the block `device`'s default generator draws from `states[name]`; after it, the
    advanced state is stored back there and the default one restored (the fork
    of an RNG tracker)."""
    saved = default_rng_state(device)
    _set_state(states[name], device)
    try:
        yield
    finally:
        states[name] = default_rng_state(device)
        _set_state(saved, device)


class RNGTracker:
    """The model-parallel generator of one TP group on this rank (CPU, or the current CUDA device).

    `fork()` makes the default generator draw from the model-parallel state inside the block and
    restores the default state after it (the model-parallel state advances, the default one does
    not). Seeded with `seed + MODEL_PARALLEL_OFFSET + rank`, so ranks draw different masks; the
    default generator is the training script's, the same on every rank."""

    def __init__(self, group: TPGroup, seed: int, *, device: str | torch.device = "cpu") -> None:
        self.group, self.device = group, torch.device(device)
        self.seed(seed)

    def seed(self, seed: int, *, by_rank: bool = True) -> None:
        """(Re)seed the model-parallel state: `seed + 2718 + rank` (by_rank=False: the same on every
        rank, which is the bug this tracker exists to prevent; kept for the fault catalogue)."""
        self.model_parallel_seed = (
            seed + MODEL_PARALLEL_OFFSET + (self.group.rank if by_rank else 0)
        )
        self.states = {
            "model-parallel": torch.Generator(device=self.device)
            .manual_seed(self.model_parallel_seed)
            .get_state()
        }

    def fork(self):
        """Draw from the model-parallel state inside the
        block (forward: the masks of a sharded region)."""
        return drawing_from(self.states, "model-parallel", self.device)


class ParallelDropout(nn.Dropout):
    """Dropout for a region sharded over the ranks: draws under `tracker.fork()`, so each rank's
    shard gets its own mask. Use plain `nn.Dropout` in replicated regions (the default generator,
    the same on every rank)."""

    def __init__(self, p: float, tracker: RNGTracker) -> None:
        super().__init__(p)
        self.tracker = tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with self.tracker.fork():
            return super().forward(x)
