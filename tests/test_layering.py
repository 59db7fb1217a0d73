"""The layering of the `tpcheck` package, read from source with `ast` (nothing is imported).

The reader (`read_imports`) takes every `import` / `from ... import` statement anywhere in a module:
module level, function- and class-local, under `try`/`with`/`if`, the body of `if TYPE_CHECKING:`
included (an import for annotations only is still a dependency a reader follows: a circle hidden
there is a circle); it resolves relative imports. An edge
goes to the module an import names: `from a.b import c` goes to `a.b.c` when that is a module of the
package, else to `a.b`. The parent packages a runtime import also initialises (`import a.b.c` runs
`a/__init__` and `a/b/__init__`) are not edges: every module would otherwise be in a cycle with its
own package `__init__`.

Rules on the real package:
1. the library half (`tpcheck.parallel.*`, `tpcheck.plan`, `tpcheck.models.*`) imports only itself
   and `tpcheck.errors`;
2. `tpcheck.checker.*` imports none of the layers above it (blocks, faults, resolve, cli,
   seed_compat, adapters, report, pytest_plugin);
2b. the checker's three rooms (`tpcheck.checker.pool`, `.rank`, `.verdict`): `rank` (one case on one
   rank) imports neither `pool` nor `verdict`; `verdict` (payloads to a result, in the parent)
   imports no `pool`; `pool` (processes) imports no comparison module: of `rank`, only its entry
   point (`engine.run_case_on_rank`) and the collective tap (`ledger`);
3. collapsed to sub-packages (`tpcheck.checker`, ...; a top-level module is its own node; `tpcheck`
   is the package `__init__`), the import graph is acyclic;
4. module by module, the import graph is acyclic;
5. no module of `tpcheck.checker.rank` but the engine imports the engine (`checker/rank/engine.py`
   is the step loop over stages; a stage receives the case's `Sides`, never the engine).
The tests below those check the reader and the cycle finder on fake packages written to tmp_path.
"""

from __future__ import annotations

import ast
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
PACKAGE = "tpcheck"

LIBRARY = {"tpcheck.parallel", "tpcheck.plan", "tpcheck.models"}
LIBRARY_MAY_IMPORT = LIBRARY | {"tpcheck.errors"}
CHECK_MUST_NOT_IMPORT = {
    "tpcheck.blocks",
    "tpcheck.faults",
    "tpcheck.resolve",
    "tpcheck.cli",
    "tpcheck.seed_compat",
    "tpcheck.adapters",
    "tpcheck.report",
    "tpcheck.pytest_plugin",
}


# ------------------------------------------------------------------------------------ the reader


@dataclass(frozen=True, order=True)
class Import:
    """Module `src` imports module `dst` at `file`:`line`."""

    src: str
    dst: str
    file: str
    line: int

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def package_modules(src_root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} of every module of `package` under `src_root`."""
    out = {}
    for path in sorted((src_root / package).rglob("*.py")):
        parts = list(path.relative_to(src_root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


class _Collector(ast.NodeVisitor):
    def __init__(self) -> None:
        # (line, level, module, names)
        self.found: list[tuple[int, int, str | None, list[str]]] = []

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((node.lineno, 0, alias.name, []))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node.lineno, node.level, node.module, [a.name for a in node.names]))


def read_imports(src_root: Path, package: str, rel_to: Path | None = None) -> list[Import]:
    """Every import of a module of `package` by a module of `package`, sorted. File paths in the
    result are relative to `rel_to` (default: `src_root`'s parent)."""
    modules = package_modules(src_root, package)
    rel_to = rel_to if rel_to is not None else src_root.parent
    edges: set[Import] = set()
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        collector = _Collector()
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        file = str(path.relative_to(rel_to)) if path.is_relative_to(rel_to) else str(path)
        for line, level, target, names in collector.found:
            if level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                if level - 1 >= len(base):
                    raise ValueError(f"{file}:{line}: relative import beyond the top-level package")
                base = base[: len(base) - (level - 1)]
                target = ".".join(base + ([target] if target else []))
            if not (target == package or target.startswith(package + ".")):
                continue
            dsts = set()
            for name in names:  # `from X import name`: the submodule X.name if there is one, else X
                dsts.add(f"{target}.{name}" if f"{target}.{name}" in modules else target)
            for dst in dsts or {target}:
                edges.add(Import(mod, dst, file, line))
    return sorted(edges)


def node_of(module: str) -> str:
    """A module's sub-package (`tpcheck.checker.rank.compare` -> `tpcheck.checker`); a top-level
    module is its own node, and the package `__init__` is `tpcheck`."""
    return ".".join(module.split(".")[:2])


def collapse(edges: list[Import]) -> list[Import]:
    """The same imports between sub-package nodes; imports within one node are dropped."""
    return [
        Import(node_of(e.src), node_of(e.dst), e.file, e.line)
        for e in edges
        if node_of(e.src) != node_of(e.dst)
    ]


@dataclass(frozen=True)
class Cycle:
    """A strongly connected component of more than one node (`nodes`), and one shortest cycle
    through its first node, as its edges (one witnessing import each)."""

    nodes: tuple[str, ...]
    edges: tuple[Import, ...]


def find_cycles(edges: list[Import]) -> list[Cycle]:
    """One `Cycle` per strongly connected component of more than one node; self-imports are ignored.
    Empty iff the graph is acyclic."""
    graph: dict[str, dict[str, Import]] = defaultdict(dict)
    for e in sorted(edges):
        if e.src != e.dst:
            graph[e.src].setdefault(e.dst, e)  # one witness per edge: the first by file, line
    nodes = sorted(set(graph) | {d for ds in graph.values() for d in ds})

    # Tarjan's strongly connected components (recursion depth = longest path: small graphs only).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in nodes:
        if v not in index:
            strongconnect(v)

    cycles = []
    for comp in sorted(sccs):
        members, start = set(comp), comp[0]
        # Shortest path start -> ... -> start inside the component (BFS).
        prev: dict[str, str] = {}
        frontier, seen, closing = [start], {start}, None
        while frontier and closing is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph.get(v, {})):
                    if w == start:
                        closing = v
                        break
                    if w in members and w not in seen:
                        seen.add(w)
                        prev[w] = v
                        nxt.append(w)
                if closing is not None:
                    break
            frontier = nxt
        path = [closing]
        while path[-1] != start:
            path.append(prev[path[-1]])
        path.reverse()  # start, ..., closing
        path.append(start)
        cycles.append(Cycle(tuple(comp), tuple(graph[a][b] for a, b in zip(path, path[1:]))))
    return cycles


def format_cycle(cycle: Cycle) -> str:
    path = [cycle.edges[0].src] + [e.dst for e in cycle.edges]
    lines = [f"  {' -> '.join(path)}"]
    lines += [f"    {e.src} -> {e.dst}  ({e.where()})" for e in cycle.edges]
    if len(cycle.nodes) > len(cycle.edges):
        lines.append(
            f"    (one cycle of the tangle {', '.join(cycle.nodes)}: break it "
            "and rerun for the next)"
        )
    return "\n".join(lines)


def forbidden_imports(
    edges: list[Import],
    src_nodes: set[str],
    *,
    deny: set[str] | None = None,
    allow: set[str] | None = None,
) -> list[Import]:
    """Imports from a module in `src_nodes` to another node that is in `deny` / not in `allow`."""
    bad = []
    for e in edges:
        s, d = node_of(e.src), node_of(e.dst)
        if s not in src_nodes or d == s:
            continue
        if (deny is not None and d in deny) or (allow is not None and d not in allow):
            bad.append(e)
    return bad


def room_of(module: str, checker: str) -> str | None:
    """The room of a module of the checker package `checker` (`pool`, `rank`, `verdict`), None for
    the checker's own top-level modules (case, usercode, payload, devices, sync) and for
    modules outside it."""
    if not module.startswith(checker + "."):
        return None
    rest = module[len(checker) + 1 :].split(".")
    return rest[0] if len(rest) > 1 and rest[0] in ROOMS else None


ROOMS = ("pool", "rank", "verdict")
# the modules of `rank` that `pool` may import: the entry
# point of a case on a rank, and the collective tap
POOL_MAY_IMPORT_OF_RANK = {"engine", "ledger"}


def room_violations(edges: list[Import], checker: str) -> list[tuple[Import, str]]:
    """Imports that break the rooms' rules: rank -> pool | verdict, verdict -> pool, pool -> a
    comparison module of rank (anything but its entry point and tap)."""
    bad = []
    for e in edges:
        src, dst = room_of(e.src, checker), room_of(e.dst, checker)
        if src is None or dst is None or src == dst:
            continue
        if src == "rank" and dst in ("pool", "verdict"):
            bad.append((e, f"rank/ runs one case on one rank and imports no {dst}/"))
        elif src == "verdict" and dst == "pool":
            bad.append((e, "verdict/ reads payloads and imports no pool/"))
        elif (
            src == "pool" and dst == "rank" and e.dst.split(".")[-1] not in POOL_MAY_IMPORT_OF_RANK
        ):
            bad.append(
                (
                    e,
                    (
                        f"pool/ imports of rank/ only {sorted(POOL_MAY_IMPORT_OF_RANK)}, "
                        "no comparison module"
                    ),
                )
            )
    return bad


ENGINE = "engine"


def engine_importers(edges: list[Import], checker: str) -> list[Import]:
    """Imports of the rank room's engine by any other module of the rank room."""
    engine = f"{checker}.rank.{ENGINE}"
    return [
        e
        for e in edges
        if e.dst == engine and e.src != engine and room_of(e.src, checker) == "rank"
    ]


def format_imports(edges: list[Import]) -> str:
    return "\n".join(f"  {e.where()}: {e.src} imports {e.dst}" for e in edges)


# --------------------------------------------------------------------------------- the real package


def _real_edges() -> list[Import]:
    return read_imports(SRC, PACKAGE, rel_to=REPO)


def test_the_real_package_is_read():
    modules = package_modules(SRC, PACKAGE)
    edges = _real_edges()
    assert {"tpcheck", "tpcheck.parallel.collectives", "tpcheck.parallel.group"} <= set(modules)
    assert any(
        e.src == "tpcheck.parallel.collectives" and e.dst == "tpcheck.parallel.group" for e in edges
    )


def test_library_imports_only_itself_and_errors():
    bad = forbidden_imports(_real_edges(), LIBRARY, allow=LIBRARY_MAY_IMPORT)
    assert not bad, (
        f"the library half ({', '.join(sorted(LIBRARY))}) may import only itself and "
        f"tpcheck.errors; {len(bad)} import(s) reach further:\n{format_imports(bad)}"
    )


def test_checker_imports_no_layer_above_it():
    bad = forbidden_imports(_real_edges(), {"tpcheck.checker"}, deny=CHECK_MUST_NOT_IMPORT)
    assert not bad, (
        f"tpcheck.checker must not import {', '.join(sorted(CHECK_MUST_NOT_IMPORT))}; "
        f"{len(bad)} import(s) do:\n{format_imports(bad)}"
    )


def test_checker_rooms_import_as_the_rules_say():
    bad = room_violations(_real_edges(), "tpcheck.checker")
    assert not bad, "the checker's rooms import across their rules:\n" + "\n".join(
        f"  {e.where()}: {e.src} imports {e.dst} ({why})" for e, why in bad
    )


def test_no_stage_imports_the_engine():
    bad = engine_importers(_real_edges(), "tpcheck.checker")
    assert not bad, (
        "a stage of checker/rank receives the case's Sides (sides.py), never the engine; "
        f"{len(bad)} import(s) of the engine:\n{format_imports(bad)}"
    )


def test_no_cycle_between_subpackages():
    cycles = find_cycles(collapse(_real_edges()))
    assert not cycles, "import cycle(s) between sub-packages:\n" + "\n".join(
        map(format_cycle, cycles)
    )


def test_no_cycle_between_modules():
    cycles = find_cycles(_real_edges())
    assert not cycles, "import cycle(s) between modules:\n" + "\n".join(map(format_cycle, cycles))


# ----------------------------------------------------------------------------- the reader, on fakes


def _write_package(root: Path, files: dict[str, str]) -> Path:
    """Write {relative path: source} under root/src; returns root/src."""
    src = root / "src"
    for rel, text in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))
    return src


FAKE = {
    "fake/__init__.py": """
        from .core import thing
        __version__ = "0"
    """,
    "fake/core.py": """
        import os
        from typing import TYPE_CHECKING
        import typing

        if TYPE_CHECKING:
            from fake.hinted import Hint
        else:
            from fake.other import Other

        if typing.TYPE_CHECKING:
            import fake.hinted2

        thing = 1

        def f():
            from .util import helper
            return helper

        class K:
            import fake.classlocal

        try:
            import fake.opt.mod as m
        except ImportError:
            pass
    """,
    "fake/util.py": "helper = 1\n",
    "fake/other.py": "Other = 1\n",
    "fake/hinted.py": "Hint = 1\n",
    "fake/hinted2.py": "",
    "fake/classlocal.py": "",
    "fake/opt/__init__.py": "",
    "fake/opt/mod.py": "",
    "fake/sub/__init__.py": """
        from . import leaf
        from .leaf import name_in_leaf
    """,
    "fake/sub/leaf.py": """
        from .. import __version__
        from ..util import helper
        from fake import util, other
        from fake.sub import *

        def g():
            def h():
                import fake.core
            return h
    """,
}


def _pairs(edges):
    return {(e.src, e.dst) for e in edges}


def test_reader_finds_function_local_relative_and_conditional_imports(tmp_path):
    src = _write_package(tmp_path, FAKE)
    edges = read_imports(src, "fake")
    assert _pairs(edges) == {
        ("fake", "fake.core"),  # relative import in a package __init__
        ("fake.core", "fake.other"),  # the else branch of `if TYPE_CHECKING:`
        ("fake.core", "fake.hinted"),  # the body of `if TYPE_CHECKING:`: an edge too
        ("fake.core", "fake.hinted2"),  # ... under `typing.TYPE_CHECKING` as well
        ("fake.core", "fake.util"),  # function-local relative import
        ("fake.core", "fake.classlocal"),  # class-body import
        ("fake.core", "fake.opt.mod"),  # under try, `import ... as`
        (
            "fake.sub",
            "fake.sub.leaf",
        ),  # `from . import leaf` (a submodule) and `from .leaf import name`
        ("fake.sub.leaf", "fake"),  # `from .. import __version__`: a name of the package __init__
        ("fake.sub.leaf", "fake.util"),  # `from ..util import helper` and `from fake import util`
        ("fake.sub.leaf", "fake.other"),  # `from fake import util, other`: two submodules
        ("fake.sub.leaf", "fake.sub"),  # `from fake.sub import *`
        ("fake.sub.leaf", "fake.core"),  # absolute import in a nested function
    }
    # outside imports (os, typing) are not edges
    assert not {d for _, d in _pairs(edges)} & {"os", "typing"}
    # Each edge carries the file and line of the import statement.
    (local,) = [e for e in edges if (e.src, e.dst) == ("fake.core", "fake.util")]
    assert (src / "fake/core.py").read_text().splitlines()[
        local.line - 1
    ].strip() == "from .util import helper"
    assert local.where() == "src/fake/core.py:16"


def test_reader_rejects_a_relative_import_above_the_package(tmp_path):
    src = _write_package(
        tmp_path, {"fake/__init__.py": "", "fake/a.py": "def f():\n    from .. import x\n"}
    )
    try:
        read_imports(src, "fake")
    except ValueError as e:
        assert "src/fake/a.py:2" in str(e)
    else:
        raise AssertionError("a relative import beyond the top-level package was not reported")


def test_cycle_finder_reports_a_function_local_cycle_with_file_and_line(tmp_path):
    src = _write_package(
        tmp_path,
        {
            "cyc/__init__.py": "",
            "cyc/a.py": "from cyc import b\n",
            "cyc/b.py": "import cyc.c\n",
            # closes the cycle, function-locally
            "cyc/c.py": "import os\n\ndef late():\n    from .a import x\n",
            "cyc/d.py": "from cyc import a\n",  # hangs off the cycle, is not in it
        },
    )
    cycles = find_cycles(read_imports(src, "cyc"))
    assert len(cycles) == 1
    (cycle,) = cycles
    assert cycle.nodes == ("cyc.a", "cyc.b", "cyc.c")
    assert [e.src for e in cycle.edges] == ["cyc.a", "cyc.b", "cyc.c"]
    assert [e.dst for e in cycle.edges] == ["cyc.b", "cyc.c", "cyc.a"]
    text = format_cycle(cycle)
    assert "cyc.a -> cyc.b -> cyc.c -> cyc.a" in text
    assert "src/cyc/a.py:1" in text and "src/cyc/b.py:1" in text and "src/cyc/c.py:4" in text


def test_cycle_finder_reports_a_type_checking_back_edge(tmp_path):
    """Mutant of the old reader, which dropped annotation-only imports: the circle a -> b -> a
    closed under `if TYPE_CHECKING:` is reported, at the line of the hidden import."""
    src = _write_package(
        tmp_path,
        {
            "acyc/__init__.py": "",
            "acyc/a.py": "from acyc import b\n",
            "acyc/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from acyc.a import A\n"
            ),
        },
    )
    (cycle,) = find_cycles(read_imports(src, "acyc"))
    assert cycle.nodes == ("acyc.a", "acyc.b")
    assert "src/acyc/b.py:3" in format_cycle(cycle)


def test_a_stage_importing_the_engine_is_reported_even_for_annotations(tmp_path):
    """Rule 5 on a fake checker: a stage that imports the engine (at run time, or only for its
    annotations, under TYPE_CHECKING) is reported; the engine importing its stages, a stage
    importing another stage, and a module outside the rank room importing the engine are not."""
    src = _write_package(
        tmp_path,
        {
            "fk/__init__.py": "",
            "fk/checker/__init__.py": "",
            "fk/checker/api.py": "from fk.checker.rank.engine import run\n",
            "fk/checker/rank/__init__.py": "",
            "fk/checker/rank/engine.py": "from fk.checker.rank import stage, hinted, sides\n",
            "fk/checker/rank/sides.py": "",
            "fk/checker/rank/stage.py": "from fk.checker.rank.sides import Sides\n",
            "fk/checker/rank/hinted.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from fk.checker.rank.engine import Engine\n"
            ),
            "fk/checker/rank/direct.py": "def f(e):\n    from fk.checker.rank import engine\n",
        },
    )
    bad = engine_importers(read_imports(src, "fk"), "fk.checker")
    assert [(e.src, e.where()) for e in bad] == [
        ("fk.checker.rank.direct", "src/fk/checker/rank/direct.py:2"),
        ("fk.checker.rank.hinted", "src/fk/checker/rank/hinted.py:3"),
    ]


def test_cycle_finder_reports_each_strongly_connected_component(tmp_path):
    src = _write_package(
        tmp_path,
        {
            "two/__init__.py": "",
            "two/a.py": "from two import b\n",
            "two/b.py": "from two import a\n",
            "two/c.py": "from two import d\nfrom two import a\n",
            "two/d.py": "from two import e\n",
            "two/e.py": "from two import c\n",
        },
    )
    cycles = find_cycles(read_imports(src, "two"))
    assert [c.nodes for c in cycles] == [("two.a", "two.b"), ("two.c", "two.d", "two.e")]
    assert [[e.src for e in c.edges] for c in cycles] == [
        ["two.a", "two.b"],
        ["two.c", "two.d", "two.e"],
    ]


def test_collapsing_finds_a_cycle_between_subpackages_that_modules_do_not_have(tmp_path):
    src = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.x import m1\n",  # the top node may import anything
            "pkg/x/__init__.py": "",
            "pkg/x/m1.py": "from pkg.y.m2 import f\n",
            "pkg/x/m4.py": "",
            "pkg/y/__init__.py": "",
            "pkg/y/m2.py": "f = 1\n",
            "pkg/y/m3.py": "def g():\n    from pkg.x import m4\n",
            "pkg/top.py": "from pkg.y import m3\n",
        },
    )
    edges = read_imports(src, "pkg")
    assert find_cycles(edges) == []
    (cycle,) = find_cycles(collapse(edges))
    assert cycle.nodes == ("pkg.x", "pkg.y")
    assert {e.where() for e in cycle.edges} == {"src/pkg/x/m1.py:1", "src/pkg/y/m3.py:2"}


def test_a_subpackage_importing_the_package_init_is_a_cycle_only_if_init_reaches_it(tmp_path):
    files = {
        "top/__init__.py": "from top.lib.core import f\n__version__ = '0'\n",
        "top/lib/__init__.py": "",
        "top/lib/core.py": "def f(): ...\n",
        "top/tool/__init__.py": "",
        "top/tool/run.py": "from top import __version__\n",  # top does not import tool: fine
    }
    src = _write_package(tmp_path / "ok", files)
    assert find_cycles(collapse(read_imports(src, "top"))) == []
    # top imports lib: a cycle
    files["top/lib/core.py"] = "from top import __version__\ndef f(): ...\n"
    src = _write_package(tmp_path / "bad", files)
    (cycle,) = find_cycles(collapse(read_imports(src, "top")))
    assert cycle.nodes == ("top", "top.lib")


def test_forbidden_imports_flags_the_offending_import(tmp_path):
    src = _write_package(
        tmp_path,
        {
            "p/__init__.py": "",
            "p/errors.py": "",
            "p/lib/__init__.py": "",
            "p/lib/a.py": (
                "from p.errors import E\nfrom p.lib import b\n\ndef f():\n    from "
                "p.app.run import go\n"
            ),
            "p/lib/b.py": "",
            "p/app/__init__.py": "",
            "p/app/run.py": "from p.lib.a import f\n",
        },
    )
    edges = read_imports(src, "p")
    bad = forbidden_imports(edges, {"p.lib"}, allow={"p.lib", "p.errors"})
    assert [(e.src, e.dst, e.where()) for e in bad] == [
        ("p.lib.a", "p.app.run", "src/p/lib/a.py:5")
    ]
    assert forbidden_imports(edges, {"p.lib"}, deny={"p.app"}) == bad
    assert forbidden_imports(edges, {"p.app"}, deny={"p.errors"}) == []


def test_room_rules_catch_each_crossing_on_a_fake_checker(tmp_path):
    """Mutants of a checker package: each forbidden crossing is reported with its file and line, and
    the allowed ones (pool -> rank's entry point and tap, verdict -> rank, anyone -> the checker's
    top level) are not."""
    src = _write_package(
        tmp_path,
        {
            "fk/__init__.py": "",
            "fk/checker/__init__.py": "",
            "fk/checker/payload.py": "",
            "fk/checker/pool/__init__.py": "",
            "fk/checker/pool/launch.py": (
                "from fk.checker.rank import engine, ledger\nfrom fk.checker import payload\n"
            ),
            "fk/checker/pool/worker.py": "def f():\n    from fk.checker.rank.compare import x\n",
            "fk/checker/rank/__init__.py": "",
            "fk/checker/rank/engine.py": (
                "from fk.checker.payload import y\nfrom fk.checker.verdict import result\n"
            ),
            "fk/checker/rank/ledger.py": "import fk.checker.pool.launch\n",
            "fk/checker/rank/compare.py": "",
            "fk/checker/verdict/__init__.py": "",
            "fk/checker/verdict/result.py": (
                "from fk.checker.rank import compare\nfrom fk.checker.pool import worker\n"
            ),
        },
    )
    bad = room_violations(read_imports(src, "fk"), "fk.checker")
    assert sorted((e.src, e.dst, e.where()) for e, _ in bad) == [
        ("fk.checker.pool.worker", "fk.checker.rank.compare", "src/fk/checker/pool/worker.py:2"),
        ("fk.checker.rank.engine", "fk.checker.verdict.result", "src/fk/checker/rank/engine.py:2"),
        ("fk.checker.rank.ledger", "fk.checker.pool.launch", "src/fk/checker/rank/ledger.py:1"),
        (
            "fk.checker.verdict.result",
            "fk.checker.pool.worker",
            "src/fk/checker/verdict/result.py:2",
        ),
    ]
