"""Input checks the parent can make before forking a rank: each raises UsageError naming the value
and the fix, so bad input costs milliseconds and never leaves a process behind."""
from __future__ import annotations

import math
import os

from tpcheck.check.case import DTYPES, CaseSpec
from tpcheck.errors import UsageError

# Each rank is a process on this machine. Beyond ~8 ranks per core, gloo's rendezvous and collectives
# are slow enough to trip the collective timeout, and a false "hang" is worse than a clear refusal.
# (Under torchrun the ranks are torchrun's business: this limit is not applied there.)
MAX_WORLD_SIZE = 64
RANKS_PER_CPU = 8
MAX_STEPS = 10_000  # steps and micro-batches: beyond this a typo, not a check


def max_world_size() -> int:
    return min(MAX_WORLD_SIZE, RANKS_PER_CPU * (os.cpu_count() or 1))


def check_world_size(world: int) -> None:
    limit = max_world_size()
    if not isinstance(world, int) or not 1 <= world <= limit:
        raise UsageError(f"world size {world} is outside 1..{limit}: each rank is a process on this machine "
                         f"({os.cpu_count()} CPUs, at most {RANKS_PER_CPU} ranks per CPU and {MAX_WORLD_SIZE} "
                         "in all); choose a smaller world size or run under torchrun on more machines")


def validate_spec(spec: CaseSpec) -> None:
    """What the parent can check before forking anything; raises UsageError naming the value and the fix.
    Built-in blocks get their config checked too (sizes that do not divide the world size)."""
    check_world_size(spec.world_size)
    if spec.dtype not in DTYPES:
        raise UsageError(f"dtype {spec.dtype!r} is not one of {sorted(DTYPES)} (complex and integer dtypes "
                         "cannot be checked: the tolerances are for real floating point)")
    for name, most in (("steps", MAX_STEPS), ("micro_batches", MAX_STEPS)):
        value = getattr(spec, name)
        if not isinstance(value, int) or not 1 <= value <= most:
            raise UsageError(f"{name} must be an integer in 1..{most}, got {value!r} (a check needs a few steps; "
                             "drift over many steps shows within tens)")
    if spec.lr is not None and not (math.isfinite(spec.lr) and spec.lr > 0):
        raise UsageError(f"learning rate {spec.lr!r} must be a finite number > 0")
    if not -(2**63) <= spec.seed < 2**64:
        raise UsageError(f"seed {spec.seed} is outside torch's range [-2**63, 2**64)")
    if spec.block.startswith(("file:", "registered:")):
        return
    from tpcheck.models.cases import BLOCKS, config_for

    if spec.block not in BLOCKS:
        raise UsageError(f"unknown block {spec.block!r}; choose one of {sorted(BLOCKS)}")
    config_for(spec)
    if spec.fault:
        from tpcheck.faults import get_fault

        fault = get_fault(spec.fault)
        if not fault.applies(spec.block, spec.world_size):
            raise UsageError(f"fault {fault.name!r} applies to block(s) {list(fault.blocks)} at world sizes "
                             f"{list(fault.worlds)}, not {spec.block!r} at {spec.world_size}")
