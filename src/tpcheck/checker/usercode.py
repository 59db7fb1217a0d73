"""User code: case files loaded by path, Cases registered in this process, and guards around the
user's callables.

`block` forms a user case can take:
  "file:PATH[:NAME]"         a user's case file (docs/case-files.md): a module-level `Case` object
                             or a function `case`/`case_*` taking the CaseSpec and returning a Case
  "registered:ID"            a Case registered in this process with `register()` before the ranks
                             were forked (the pytest plugin uses it for Cases
                             defined in test modules)

User code runs inside wrappers (`guard_user_case`): an exception in a user callable becomes a
UsageError naming the callable and the user's file and line ("in your build_tp (case.py:42):
ValueError: ..."), not a traceback from our internals.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Callable

from tpcheck.checker.case import FILE_PREFIX, REGISTERED_PREFIX, RUN_FIELDS, Case, CaseSpec
from tpcheck.checker.pool.spawn import interrupt_is_a_signal
from tpcheck.errors import UsageError

# a HuggingFace architecture with transformers' own plan (tpcheck.adapters.transformers)
HF_PREFIX = "hf:"
# what a caller may set of a user case's own run settings: every RunSettings field, nothing else
OVERRIDABLE = RUN_FIELDS
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

_REGISTERED: dict[str, Case] = {}
_MODULES: dict[str, object] = {}  # absolute path -> loaded module (inherited by forked ranks)


def is_user_block(block: str) -> bool:
    return block.startswith((FILE_PREFIX, REGISTERED_PREFIX))


def build_user_case(spec: CaseSpec) -> Case:
    """The user's Case for `spec`, named as the spec, running the spec's settings when it has some
    (else its own)."""
    case = user_case(spec)
    return dataclasses.replace(
        case, name=spec.name, run=spec.run if spec.run is not None else case.run
    )


# ------------------------------------------------------------------------------ registered cases


def register(case: Case) -> str:
    """Keep `case` in this process under a stable id; returns the block name "registered:ID".
    Register before the ranks fork (they inherit the registry); a Case cannot be pickled."""
    if not isinstance(case, Case):
        raise UsageError(f"tpcheck can register a tpcheck.Case, not {type(case).__name__}")
    key = f"{case.name}-{id(case):x}"
    _REGISTERED[key] = case
    return REGISTERED_PREFIX + key


# ------------------------------------------------------------------------------ case files


def parse_target(target: str) -> tuple[str, str | None]:
    """ "path/to/case.py[:NAME]" -> (absolute path, NAME or None)."""
    path, name = target, None
    if ":" in target and not target.endswith(".py"):
        path, name = target.rsplit(":", 1)
    if not path.endswith(".py"):
        raise UsageError(
            f"{target!r} is not a case file: give path/to/case.py or path/to/case.py:NAME"
        )
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise UsageError(f"case file {path} does not exist")
    return path, name or None


def load_module(path: str):
    """Import the case file by path under a unique module name (cached: forked ranks inherit it)."""
    if path in _MODULES:
        return _MODULES[path]
    # the file's own folder and the working directory are importable, as pytest and `python -m` make
    # them: a case file imports the user's package next to it
    for folder in (os.getcwd(), os.path.dirname(path)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    mod_name = "tpcheck_case_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    # a forked rank inherits the module; only the process that reports probes
    if os.getpid() == _PARENT:
        _survives(
            lambda: spec.loader.exec_module(importlib.util.module_from_spec(spec)),
            f"importing your case file {short_path(path)}",
        )
    try:
        with open(path, "rb") as f:
            compile(f.read(), path, "exec")
    except SyntaxError as e:
        raise UsageError(
            f"syntax error in your case file ({short_path(e.filename or path)}:{e.lineno}): {e.msg}"
        ) from None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    # a UsageError at import is the file's too (a Plan refused as it is built): named at its line
    try:
        call_user(
            spec.loader.exec_module,
            module,
            who=f"your case file {short_path(path)}",
            path=path,
            failed="importing your case file failed",
            usage_is_theirs=True,
        )
    except BaseException:
        del sys.modules[mod_name]
        raise
    _MODULES[path] = module
    return module


def available(module) -> dict[str, object]:
    """Module-level Case objects and case functions (`case`, `case_*`) defined in the file."""
    found = {}
    for attr, value in vars(module).items():
        if isinstance(value, Case):
            found[attr] = value
        elif (
            inspect.isfunction(value)
            and value.__module__ == module.__name__
            and (attr == "case" or attr.startswith("case_"))
        ):
            found[attr] = value
    return found


def pick(module, path: str, name: str | None):
    found = available(module)
    if not found:
        raise UsageError(
            f"case file {short_path(path)} defines no tpcheck.Case and no `def case(spec)` "
            "function; see docs/case-files.md"
        )
    if name is None:
        if len(found) > 1:  # expand_target gives each its :NAME first
            raise UsageError(
                f"case file {short_path(path)} defines several cases {sorted(found)}; pick one "
                f"with {short_path(path)}:NAME"
            )
        return next(iter(found.items()))
    for key in (name, f"case_{name}"):
        if key in found:
            return key, found[key]
    raise UsageError(
        f"case file {short_path(path)} has no case {name!r}; available: {sorted(found)}"
    )


def user_case(spec: CaseSpec) -> Case:
    """The user's Case for `spec` (not yet overridden
    by the spec's fields), with guarded callables."""
    if spec.block.startswith(REGISTERED_PREFIX):
        key = spec.block[len(REGISTERED_PREFIX) :]
        if key not in _REGISTERED:
            raise UsageError(
                f"no registered case {key!r} in this process: register() it before the ranks start"
            )
        case = _REGISTERED[key]
        return guard_user_case(case, _defined_in(case.build_tp))
    path, name = parse_target(spec.block[len(FILE_PREFIX) :])
    attr, obj = pick(load_module(path), path, name)
    if not isinstance(obj, Case):
        if os.getpid() == _PARENT:
            _survives(lambda: obj(spec), f"your {attr}(spec) in {short_path(path)}")
        obj = call_user(obj, spec, who=f"your {attr}(spec)", path=path, failed=f"in your {attr}")
        if not isinstance(obj, Case):
            raise UsageError(
                f"your {attr}(spec) in {short_path(path)} returned {type(obj).__name__}, "
                "not a tpcheck.Case"
            )
    return guard_user_case(obj, path)


def expand_target(target: str) -> list[str]:
    """A case file given without :NAME that defines several
    cases stands for all of them, in file order."""
    if target.startswith(REGISTERED_PREFIX):
        return [target]
    path, name = parse_target(target)
    if name is not None:
        return [target]
    found = available(load_module(path))
    return [target] if len(found) <= 1 else [f"{target}:{attr}" for attr in found]


def file_spec(target: str, world_size: int, label: str = "", **given) -> CaseSpec:
    """A CaseSpec for a case file or a registered Case, resolved in this process: loads the file (so
    mistakes in it are reported once, here, before any rank starts); the spec's `run` is the Case's
    own settings with those the caller gave (`given`, None meaning not given)
    replaced: what will run."""
    given = {k: v for k, v in given.items() if v is not None}
    unknown = sorted(set(given) - set(OVERRIDABLE))
    if unknown:
        raise UsageError(
            f"cannot override {unknown} of a case file; overridable: {list(OVERRIDABLE)}"
        )
    block = target if target.startswith(REGISTERED_PREFIX) else FILE_PREFIX + target
    probe = CaseSpec(block=block, world_size=world_size)
    own = user_case(probe)
    run = dataclasses.replace(own.run, **given)
    return dataclasses.replace(
        probe, run=run, label=label or f"{own.name}/tp{world_size}/{run.dtype}"
    )


# ------------------------------------------------------------------------------ guarding user code


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


_TPCHECK_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(importlib.util.find_spec("torch").origin) + os.sep
_PYTHON_DIRS = tuple(
    {sysconfig.get_paths()["stdlib"] + os.sep, os.path.dirname(os.__file__) + os.sep}
)
_INSTALLED = ("site-packages/", "dist-packages/")
_PYTHON_LIB = re.compile(r"/lib/python3[.\d]*/")


def frame_kind(path: str) -> str:
    """Whose code a frame's file is: "user" (the code under test: the user's files and the libraries
    they call, transformers or Megatron-Core), "tpcheck", "torch" or "python" (the standard library,
    frozen and generated code). The one rule for every place that names the user's line: an
    exception's frame (`user_frame`), a rank's traceback (verdict/failures.py), a rank's live stack
    (pool/heartbeat.py). Paths from another host (a rank's traceback under torchrun) are told by
    their installed layout."""
    if not path or path.startswith("<"):
        return "python"
    slashed = path.replace(os.sep, "/")
    for kind, own_dir in (("tpcheck", _TPCHECK_DIR), ("torch", _TORCH_DIR)):
        if path.startswith(own_dir) or any(f"{where}{kind}/" in slashed for where in _INSTALLED):
            return kind
    if any(where in slashed for where in _INSTALLED):
        return "user"
    return "python" if path.startswith(_PYTHON_DIRS) or _PYTHON_LIB.search(slashed) else "user"


def user_frame(exc: BaseException, path: str | None) -> str:
    """ "file.py:LINE" of the deepest traceback frame in the user's file `path` (else in any code
    under test, `frame_kind`)."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if path and os.path.abspath(f.filename) == path]
    if not mine:
        mine = [f for f in frames if frame_kind(os.path.abspath(f.filename)) == "user"]
    if not mine:
        return short_path(path) if path else "?"
    return f"{short_path(mine[-1].filename)}:{mine[-1].lineno}"


def guard_user_case(case: Case, path: str | None) -> Case:
    """Wrap the Case's callables so a user exception names the callable, file and line."""
    wrapped = {
        f: _guard(getattr(case, f), f, path) for f in USER_CALLABLES if getattr(case, f) is not None
    }
    if callable(case.tp_names):  # a function of the dense name (a dict is data)
        wrapped["tp_names"] = _guard(case.tp_names, "tp_names", path)
    if case.inject.tamper is not None:
        inject = dataclasses.replace(case.inject, tamper=_guard(case.inject.tamper, "tamper", path))
        wrapped["inject"] = inject
    return dataclasses.replace(case, **wrapped)


def _guard(fn: Callable, what: str, path: str | None) -> Callable:
    if getattr(fn, "_tpcheck_guarded", False):
        return fn

    def guarded(*args):
        out = call_user(fn, *args, who=f"your {what}", path=path or _defined_in(fn))
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


def require_graph(out, side: str, model) -> None:
    """Before the loss, with autograd on: the `side` module's output must carry a graph (a grad_fn);
    else a UsageError saying which side's forward cut it, and how."""
    import torch

    if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and not out.requires_grad:
        raise UsageError(
            f"the {side} module's output has no grad_fn: its forward ({defined_at(model.forward)}) "
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


def defined_at(fn) -> str:
    """ "file.py:LINE" where the user's callable is defined."""
    target = inspect.unwrap(fn)
    try:
        return (
            f"{short_path(os.path.abspath(inspect.getsourcefile(target)))}:"
            f"{inspect.getsourcelines(target)[1]}"
        )
    except (TypeError, OSError):
        return getattr(target, "__qualname__", repr(target))


# the process that imported tpcheck (the CLI, the API's caller); ranks are forks
_PARENT = os.getpid()


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


def _defined_in(fn) -> str | None:
    try:
        return os.path.abspath(inspect.getsourcefile(inspect.unwrap(fn)))
    except (TypeError, OSError):
        return None


def readable_path(path: str) -> str:
    """A source path as people read it: from the installed package's root
    ('transformers/models/x/modeling_x.py') when it is installed, else `short_path`'s."""
    slashed = path.replace(os.sep, "/")
    for where in _INSTALLED:
        if where in slashed:
            return slashed.split(where, 1)[1]
    return short_path(path)


def short_path(path: str | None) -> str:
    if not path:
        return "?"
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path
