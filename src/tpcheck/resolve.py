"""CaseSpec -> Case: the one place that knows every kind of case.

A spec names a built-in block (`tpcheck.blocks.BLOCKS`), a user's case file ("file:PATH[:NAME]"), a
Case registered in this process ("registered:ID") or a HuggingFace architecture with transformers'
own TP plan ("hf:MODEL_TYPE", `tpcheck.adapters.transformers`), optionally with a catalogue fault
(`tpcheck.faults`). `RESOLVER` is handed to the launcher: the checker (`tpcheck.check`) runs
whatever Case it is given and imports neither the blocks nor the faults.
"""

from __future__ import annotations

from tpcheck.blocks import BLOCKS, config_for
from tpcheck.checker.case import Case, CaseSpec
from tpcheck.checker.casefile import build_user_case
from tpcheck.checker.pool.launch import DEFAULT_TIMEOUT_S, Launcher, TorchrunLauncher
from tpcheck.errors import UsageError
from tpcheck.faults import CATALOGUE, apply_fault, check_applies


class DefaultResolver:
    """Built-in blocks (+ catalogue faults), case files and registered Cases."""

    def prepare(self, spec: CaseSpec) -> CaseSpec:
        if spec.fault and spec.fault in CATALOGUE and not spec.target.user:
            return CATALOGUE[spec.fault].prepare(spec)
        return spec

    def validate(self, spec: CaseSpec) -> None:
        spec.validate()
        if spec.target.kind == "hf":
            if spec.device != "cpu":
                raise UsageError(
                    f"device {spec.device!r}: HuggingFace architectures are checked on the CPU "
                    "only (their reduced models on a CPU device mesh); leave the device out"
                )
            if spec.fault:
                raise UsageError(
                    f"fault {spec.fault!r}: built-in faults apply to built-in blocks only; "
                    "override a rule of the HuggingFace plan instead (tpcheck hf --rule)"
                )
            from tpcheck.adapters.transformers import prepare_spec

            prepare_spec(spec)
            return
        if spec.target.user:
            if spec.fault:
                raise UsageError(
                    f"fault {spec.fault!r}: built-in faults apply to built-in blocks only; plant "
                    "the bug in your case file instead"
                )
            return
        block = _block(spec.block)
        block.check_config(config_for(spec, block.shards), spec)
        if spec.fault:
            check_applies(spec)

    def build(self, spec: CaseSpec) -> Case:
        if spec.target.kind == "hf":
            from tpcheck.adapters.transformers import hf_case

            return hf_case(spec)
        if spec.target.user:
            from tpcheck.adapters.dtensor import with_dtensor_modules

            return with_dtensor_modules(build_user_case(spec))
        spec = self.prepare(spec)
        block = _block(spec.block)
        case = block.case(spec, config_for(spec, block.shards))
        return apply_fault(case, spec) if spec.fault else case


RESOLVER = DefaultResolver()


def _block(name: str):
    try:
        return BLOCKS[name]
    except KeyError:
        raise UsageError(f"unknown block {name!r}; choose one of {sorted(BLOCKS)}") from None


def feasible(spec: CaseSpec) -> bool:
    """Can this case run at all (e.g. an SP fault needs a sequence that divides the world size)?"""
    try:
        RESOLVER.validate(RESOLVER.prepare(spec))
    except UsageError:
        return False
    return True


def launcher(timeout_s: float = DEFAULT_TIMEOUT_S, stall_s: float | None = None) -> Launcher:
    """A pool launcher that resolves specs with RESOLVER."""
    return Launcher(RESOLVER, timeout_s, stall_s)


def torchrun_launcher(timeout_s: float = DEFAULT_TIMEOUT_S) -> TorchrunLauncher:
    return TorchrunLauncher(RESOLVER, timeout_s)
