"""Warm-up forwards (`RunSettings(warmup=N)`, `--warmup N`): N forward passes of every side before
the first checked step, for TP code whose path depends on how often it has been called (a fused
kernel taken after N warm-up calls, a CUDA graph captured on the N-th, a cache filled on the first).

Without them a check sees `steps x micro_batches` forwards and the last step's eval-mode one (7 by
default, one more per step with `Case.no_grad_forward`): a path taken from the 8th call on is never
checked. With them the
checked steps are calls N+1, N+2, ... of the TP module.

Each warm-up pass feeds the first batch to the dense model, rank 0's float64 truth and the TP model
(so both sides have seen the same calls), under the default generators seeded as the steps seed them
(`training_rng`, "step 0"), and restored after. Nothing is compared: the outputs are dropped. A
training run makes them with autograd, as its steps' forwards are made, but no backward (no
gradient, no optimizer step: the weights stay as loaded); a forward-only run without (as its
passes), and its modules' buffers are restored as built before each step (forward_only.py). The TP
side's collectives are recorded in the ledger's phase "warmup" (`CollectiveTap.warming_up`),
outside the per-step counts, and the ranks' ledgers are synced after them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tpcheck.checker.rank.loading import cast
from tpcheck.checker.rank.rng import training_rng

if TYPE_CHECKING:
    from tpcheck.checker.rank.sides import Sides


def warm_up(s: Sides, train: bool) -> int:
    """`s.settings.warmup` forwards of every side on the first batch (with autograd where the case
    trains: `train`), outputs dropped; returns the
    calls of the TP module seen (a forward pre-hook counts them; the report's self-test holds the
    count to the setting on every rank)."""
    passes = s.settings.warmup
    if not passes:
        return 0
    inputs, _ = s.first_batch
    calls = []
    counting = s.tp.register_forward_pre_hook(lambda *_: calls.append(1))
    references = [(s.dense, s.dtype)]
    if s.has_truth:
        references.append((s.truth, torch.float64))
    with torch.set_grad_enabled(train):
        for i in range(passes):
            with training_rng(s.device, s.settings.seed, 0, i):
                for model, dtype in references:
                    model(**{k: cast(v, dtype) for k, v in inputs.items()})
                with s.tap.warming_up():
                    s.tp(**s.tp_inputs(inputs))
    counting.remove()
    s.sync(f"the {passes} warm-up forward(s)")
    return len(calls)
