"""User code called under guards: the one way tpcheck calls a user's callable (`call_user`), the
wrappers around a Case's callables (`guard_user_case`) and what each must return.

User code runs inside wrappers (`guard_user_case`): an exception in a user callable becomes a
UsageError naming the callable and the user's file and line ("in your build_tp (case.py:42):
ValueError: ..."), not a traceback from our internals. A case must not end the process: sys.exit,
a stray KeyboardInterrupt and an outright exit (`_survives`) are reported like any mistake.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from tpcheck.checker.case import DEFAULT_INIT, Case, seeded_init
from tpcheck.checker.pool.spawn import interrupt_is_a_signal
from tpcheck.checker.sourcelines import _defined_in, defined_at, user_frame
from tpcheck.errors import UsageError

USER_CALLABLES = (
    "build_dense",
    "build_tp",
    "make_batch",
    "init",
    "load_tp",
    "loss",
    "tp_loss",
    "dense_optimizer",
    "tp_optimizer",
    "tp_clip_grad_norm",
    "setup",
    "decode_inputs",
)


def call_user(
    fn: Callable,
    *args,
    who: str,
    path: str | None,
    failed: str | None = None,
    usage_is_theirs: bool = False,
):
    """The one way tpcheck calls user code (as pytest's `CallInfo.from_call`): `fn(*args)`'s value,
    or a UsageError that names the user's file and line. `who` names the code ("your build_tp",
    "your case file c.py"), `path` the user's file (its frames are preferred), `failed` the words
    before an exception's place (default "in " + who). A case must not end the process: sys.exit is
    reported like any mistake, and KeyboardInterrupt too unless a real Ctrl-C raised it (that one
    stops the run). A UsageError raised inside is tpcheck's own message about the user's input and
    passes as it is, unless `usage_is_theirs` (a case file's import: a Plan it builds is refused at
    the file's line)."""
    try:
        return fn(*args)
    except UsageError as e:
        if not usage_is_theirs:
            raise
        error: BaseException = e
    except SystemExit as e:
        raise UsageError(_exit_message(e, who, path)) from None
    except KeyboardInterrupt as e:
        if interrupt_is_a_signal():
            raise
        raise UsageError(_interrupt_message(e, who, path)) from None
    except Exception as e:  # noqa: BLE001 - the user's bug, reported at the user's line
        error = e
    raise UsageError(
        f"{failed or 'in ' + who} ({user_frame(error, path)}): {type(error).__name__}: {error}"
    ) from None


def guard_user_case(case: Case, path: str | None) -> Case:
    """Wrap the Case's callables so a user exception names the callable, file and line."""
    wrapped = {
        f: _guard(getattr(case, f), f, path) for f in USER_CALLABLES if getattr(case, f) is not None
    }
    if callable(case.tp_names):  # a function of the dense name (a dict is data)
        wrapped["tp_names"] = _guard(case.tp_names, "tp_names", path)
    if callable(case.grad_of):  # an attribute's name is data
        wrapped["grad_of"] = _guard(case.grad_of, "grad_of", path)
    if case.inject.tamper is not None:
        inject = dataclasses.replace(case.inject, tamper=_guard(case.inject.tamper, "tamper", path))
        wrapped["inject"] = inject
    return dataclasses.replace(case, **wrapped)


def _guard(fn: Callable, what: str, path: str | None) -> Callable:
    if getattr(fn, "_tpcheck_guarded", False):
        return fn

    # the default init is tpcheck's own code, running the module's reset_parameters
    who = DEFAULT_INIT if fn is seeded_init else f"your {what}"

    def guarded(*args):
        out = call_user(fn, *args, who=who, path=path or _defined_in(fn))
        problem = _RETURNS[what](out, *args) if what in _RETURNS else None
        if problem:
            raise UsageError(
                f"your {what} ({defined_at(fn)}) returned {_describe(out)}; expected {problem}"
            )
        return out

    guarded._tpcheck_guarded = True
    guarded.__wrapped__ = fn  # inspect.unwrap finds the user's function (its file:line)
    return guarded


def _module(out, *args) -> str | None:
    from torch import nn

    return None if isinstance(out, nn.Module) else "a torch.nn.Module"


def _dense_module(out, dtype=None) -> str | None:
    """build_dense(dtype): a module; asked for float64 (the ground truth), every floating parameter
    in float64 (one in float32 would make the truth no more precise than the side it measures)."""
    import torch

    if (problem := _module(out)) is not None or dtype != torch.float64:
        return problem
    odd = {
        n: p.dtype
        for n, p in out.named_parameters()
        if p.is_floating_point() and p.dtype != torch.float64
    }
    if not odd:
        return None
    other, names = sorted({str(d).removeprefix("torch.") for d in odd.values()}), list(odd)
    return (
        "its floating parameters in float64, the dtype it was asked for (the float64 ground "
        f"truth), but {names[:4]}{' ...' if len(names) > 4 else ''} are {' and '.join(other)}: "
        "build them in the dtype given (nn.Linear(..., dtype=dtype)) or end with .to(dtype)"
    )


def _batch(out, *args) -> str | None:
    ok = (
        isinstance(out, (tuple, list))
        and len(out) == 2
        and isinstance(out[0], dict)
        and all(isinstance(k, str) for k in out[0])
    )
    if not ok:
        return "a pair ({forward argument name: tensor}, target), e.g. ({'x': x}, target)"
    import torch

    odd = {k: type(v).__name__ for k, v in out[0].items() if not isinstance(v, torch.Tensor)}
    return (
        None
        if not odd
        else (
            f"every forward input a tensor; {odd} are not (a constant argument belongs in the "
            "module, or give it as a tensor)"
        )
    )


def _tensor(out, *args) -> str | None:
    import torch

    if not isinstance(out, torch.Tensor):
        return "a loss tensor"
    if out.numel() != 1:
        return (
            f"a loss with one element, not of shape {list(out.shape)}: reduce "
            "it (.mean() or .sum())"
        )
    if torch.is_grad_enabled() and not out.requires_grad:
        return (
            "a loss that requires grad; this one is cut from the output (.detach(), .item(), "
            "torch.no_grad() or a new tensor in the loss), so no gradient could be checked"
        )
    return None


NO_GRAPH = "module's output has no grad_fn"  # read by the parent to go forward only (session.py)


def require_graph(out, side: str, model) -> None:
    """Before the loss, with autograd on: the `side` module's output must carry a graph (a grad_fn);
    else a UsageError saying which side's forward cut it, and how."""
    import torch

    if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and not out.requires_grad:
        raise UsageError(
            f"the {side} {NO_GRAPH}: its forward ({defined_at(model.forward)}) "
            "ran without autograd (torch.no_grad() or torch.inference_mode() inside it, every "
            "parameter with requires_grad=False, or an output detached), so no gradient can be "
            "checked; for inference-only code check the forward alone (RunSettings(train=False), "
            "--forward-only)"
        )


def _tp_name(out, *args) -> str | None:
    return None if isinstance(out, str) else "the TP parameter's name, a str"


# what each user callable must return (docs/case-files.md);
# the problem's words, or None when it fits
_RETURNS = {
    "build_dense": _dense_module,
    "build_tp": _module,
    "make_batch": _batch,
    "loss": _tensor,
    "tp_loss": _tensor,
    "tp_names": _tp_name,
}


def _describe(out) -> str:
    if out is None:
        return "None"
    if isinstance(out, (tuple, list)):
        return (
            f"a {type(out).__name__} of {len(out)}: "
            f"({', '.join(type(v).__name__ for v in out[:4])})"
        )
    kind = type(out)
    # a class of the case file
    if kind.__module__ == "builtins" or kind.__module__.startswith("tpcheck_case_"):
        return f"a {kind.__name__}"
    return f"a {kind.__module__.split('.')[0]}.{kind.__name__}"


def _exit_message(e: SystemExit, who: str, path: str | None) -> str:
    return (
        f"{who} called sys.exit({e.code!r}) ({user_frame(e, path)}): a case file must not exit the "
        "process (tpcheck would report nothing, or a false success); return, or raise an exception"
    )


def _interrupt_message(e: KeyboardInterrupt, who: str, path: str | None) -> str:
    return (
        f"{who} raised KeyboardInterrupt ({user_frame(e, path)}) with no Ctrl-C: a case file must "
        "not interrupt the run; raise an ordinary exception to report a problem"
    )


def _survives(fn: Callable[[], object], who: str) -> None:
    """Run `fn` once in a forked child first: user code that ends the process outright (os._exit, a
    signal) cannot be caught in-process, and would end tpcheck with the user's exit code and no
    report. Exceptions (SystemExit included) are left to the in-process run, which
    names the user's line."""
    if not hasattr(os, "fork"):
        return
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, say that it returned or raised, and leave without cleanup
        os.close(read)
        try:
            # what the user's code prints shows once, in-process
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            try:
                fn()
            except BaseException:  # noqa: BLE001 - reported by the in-process run
                pass
            os.write(write, b"1")
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        finished = pipe.read() == b"1"
    _, status = os.waitpid(pid, 0)
    if finished:
        return
    how = (
        f"exit code {os.waitstatus_to_exitcode(status)}"
        if os.WIFEXITED(status)
        else f"signal {os.WTERMSIG(status)}"
    )
    raise UsageError(
        f"{who} ended the process ({how}) before returning, e.g. with os._exit: a case file must "
        "not end the process (tpcheck would report nothing, or a false success); return, or raise "
        "an exception"
    )
