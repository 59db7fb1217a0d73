"""Forwards run before any rank does: whether a model runs from one of its input sets, on the meta
device or else on the CPU (`_runs`, `_running`), the shape of its output, and the modules that run
only in float32 and so stay float32 in the float64 truth (`_probe`, `_float32_pinned`); a failed
forward names the innermost module running when it raised (`_Failed`).
"""

from __future__ import annotations

import torch
from torch import nn

from tpcheck.adapters.transformers.build import build_lm, model_class, wrap
from tpcheck.adapters.transformers.common import HIDDEN, MAX_PARAMS, Skip, _first_line
from tpcheck.adapters.transformers.inputs import IDS, _input_sets, fixed


def _runs(model_type: str, cfg) -> bool:
    """Whether the model of `cfg` is within the size cap and its float32 forward runs (of one of
    its input sets: `_input_sets`): on the meta device, else on the CPU (a model that reads
    values)."""
    meta = build_lm(model_type, cfg, torch.float32, device="meta")
    if sum(p.numel() for p in meta.parameters()) > MAX_PARAMS:
        return False
    try:
        _running(model_type, cfg, meta)
    except _Failed:
        return False
    return True


def _running(model_type: str, cfg, meta: nn.Module) -> tuple:
    """(device, model, inputs, output shape) of the first of the architecture's input sets whose
    float32 forward runs: each on the meta device, else on the CPU with real weights (built once,
    only when a meta forward fails). Token ids alone come first, so a model that runs from them is
    run once. Raises the first set's _Failed when none runs."""
    kind = _kind(model_type)
    cpu, first = None, None
    for inputs in _input_sets(model_class(model_type).cls, cfg):
        try:
            return "meta", meta, inputs, _forward(meta, kind, "meta", inputs)
        except _Failed:
            pass
        cpu = cpu or build_lm(model_type, cfg, torch.float32)
        try:
            return "cpu", cpu, inputs, _forward(cpu, kind, "cpu", inputs)
        except _Failed as e:
            first = first or e
    raise first


def _kind(model_type: str) -> str:
    return model_class(model_type).kind


class _Failed(Exception):
    """A forward that raised: the message and the innermost running module holding parameters."""

    def __init__(self, message: str, module: str | None) -> None:
        super().__init__(message)
        self.message, self.module = message, module


def _forward(model: nn.Module, kind: str, device: str, inputs: tuple = ()) -> torch.Size:
    """The output's shape of one no-grad forward of `inputs`' shapes (zeros; token ids when
    empty); raises _Failed naming the
    innermost module holding parameters that was running when it raised (forward pre-hooks push,
    forward hooks pop)."""
    stack: list[str] = []
    handles = []
    for name, module in model.named_modules():
        if name and any(True for _ in module.parameters()):
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: _push(stack, n)))
            handles.append(module.register_forward_hook(lambda m, a, o: _pop(stack)))
    try:
        with torch.no_grad():
            out = wrap(model, kind)(**_zeros(inputs or IDS, model, device))
        return out.shape
    except Exception as e:  # noqa: BLE001
        raise _Failed(f"{type(e).__name__}: {_first_line(e)}", stack[-1] if stack else None) from e
    finally:
        for h in handles:
            h.remove()


def _zeros(inputs: tuple, model: nn.Module, device: str) -> dict:
    """The probe's inputs: zeros of each input's shape; a metadata input's own values (a grid the
    forward reads: zeros would describe no patch)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {
        name: fixed(shape, k, device)
        if isinstance(k, tuple)
        else torch.zeros(shape, dtype=torch.long if k == "ids" else dtype, device=device)
        for name, shape, k in inputs
    }


def _push(stack: list[str], name: str) -> None:
    stack.append(name)  # a hook returning a value would replace the module's input or output


def _pop(stack: list[str]) -> None:
    stack.pop()


def _probe(model_type: str, cfg, meta: nn.Module, kind: str) -> tuple[tuple, tuple, tuple]:
    """(the output's shape, the modules pinned to float32, the inputs) from a forward in float32
    then in float64: on the meta device (shapes and dtypes, no arithmetic, no weights), or on the
    CPU with real weights for a model whose meta forward fails (it reads values: `.item()`); of
    the first input set that runs (`_input_sets`). Raises Skip when the float32 forward of a base
    model fails (it needs more than its inputs made here)."""
    try:
        device, model, inputs, shape = _running(model_type, cfg, meta)
    except _Failed as e:
        if kind == HIDDEN:
            raise Skip(
                f"its model {model_class(model_type).cls.__name__} does not run from the inputs "
                f"made here ({_input_names(model_type, cfg)}): {e.message}"
            ) from None
        return (), (), IDS  # a causal LM that fails is run anyway: its error is the verdict
    return tuple(shape), _float32_pinned(model, kind, device, inputs), inputs


def _input_names(model_type: str, cfg) -> str:
    sets = _input_sets(model_class(model_type).cls, cfg)
    return " or ".join("+".join(name for name, _, _ in inputs) for inputs in sets)


def _float32_pinned(
    model: nn.Module, kind: str, device: str, inputs: tuple = ()
) -> tuple[str, ...]:
    """The modules to keep in float32 so that the model runs with the rest in float64 (the ground
    truth): a module that casts its input to float32 (a router, say) runs in no other dtype. Found
    by running: while the float64 forward fails, the innermost module running when it raised is
    pinned; raises Skip when pinning does not make it run."""
    pinned: list[str] = []
    try:
        while True:
            model.to(torch.float64)
            for name in pinned:
                model.get_submodule(name).float()
            try:
                _forward(model, kind, device, inputs)
            except _Failed as e:
                if e.module is None or e.module in pinned or len(pinned) >= 16:
                    raise Skip(
                        "it does not run in float64, the ground truth tpcheck bounds errors "
                        f"with: {e.message}"
                    ) from None
                pinned.append(e.module)
                continue
            return _outermost(pinned)
    finally:
        model.to(torch.float32)


def _outermost(names: list[str]) -> tuple[str, ...]:
    """`names` without those inside another of them, sorted."""
    return tuple(
        sorted(n for n in names if not any(n.startswith(m + ".") for m in names if m != n))
    )
