"""The user's case, found and loaded: case files loaded by path, Cases registered in this process,
and the specs of both.

`block` forms a user case can take:
  "file:PATH[:NAME]"         a user's case file (docs/case-files.md): a module-level `Case` object
                             or a function `case`/`case_*` taking the CaseSpec and returning a Case
  "registered:ID"            a Case registered in this process with `register()` before the ranks
                             were forked (the pytest plugin uses it for Cases
                             defined in test modules)

The Case found has its callables guarded (`usercode.guard_user_case`); the case file's import and a
case function run through `usercode.call_user`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import os
import sys

from tpcheck.checker.case import RUN_FIELDS, Case, CaseSpec, Target
from tpcheck.checker.sourcelines import _defined_in, short_path
from tpcheck.checker.usercode import _survives, call_user, guard_user_case
from tpcheck.errors import UsageError

# what a caller may set of a user case's own run settings: every RunSettings field, nothing else
OVERRIDABLE = RUN_FIELDS

_REGISTERED: dict[str, Case] = {}
_MODULES: dict[str, object] = {}  # absolute path -> loaded module (inherited by forked ranks)
# the process that imported tpcheck (the CLI, the API's caller); ranks are forks
_PARENT = os.getpid()


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
    return str(Target("registered", key))


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
    # the name every report calls it by: a Case's own `name`
    named = [(attr, v) for attr, v in found.items() if isinstance(v, Case) and v.name == name]
    if len(named) == 1:
        return named[0]
    if named:
        raise UsageError(
            f"case file {short_path(path)} has several cases named {name!r} (variables "
            f"{[attr for attr, _ in named]}); pick one by its variable, {short_path(path)}:VARIABLE"
        )
    raise UsageError(
        f"case file {short_path(path)} has no case {name!r}; available: {_listing(found)}"
    )


def _listing(found: dict[str, object]) -> str:
    """The names a case can be picked by: each variable, with its Case's own name where that
    differs ("case (Case name 'my_gpt')")."""
    return ", ".join(
        f"{attr!r} (Case name {v.name!r})"
        if isinstance(v, Case) and v.name and v.name != attr
        else repr(attr)
        for attr, v in sorted(found.items())
    )


def user_case(spec: CaseSpec) -> Case:
    """The user's Case for `spec` (not yet overridden
    by the spec's fields), with guarded callables."""
    target = spec.target
    if target.kind == "registered":
        key = target.name
        if key not in _REGISTERED:
            raise UsageError(
                f"no registered case {key!r} in this process: register() it before the ranks start"
            )
        case = _REGISTERED[key]
        return guard_user_case(case, _defined_in(case.build_tp))
    path, name = parse_target(target.name)
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
    if Target.parse(target).kind == "registered":
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
    given_as = Target.parse(target)
    block = target if given_as.kind == "registered" else str(Target("file", target))
    probe = CaseSpec(block=block, world_size=world_size)
    own = user_case(probe)
    run = dataclasses.replace(own.run, **given)
    return dataclasses.replace(
        probe, run=run, label=label or f"{own.name}/tp{world_size}/{run.dtype}"
    )
