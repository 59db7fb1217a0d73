"""docs/case-files.md is the reference of the case-file API, held to the code; every link into docs/
resolves.

(a) Fields. Each documented dataclass (`Case`, `RunSettings`, `Plan`, `CaseSpec`, `Injection`,
`TPGroup`) has a section of docs/case-files.md whose heading is its name in backticks
(`## `Case``) holding a table `| field | type | default | meaning |`, one row per field, the field's
name in backticks in the first cell. The rows are exactly the fields `dataclasses.fields` gives, in
their order. The default cell is `required` for a field with no default, else a Python expression in
backticks that evaluates, in the namespace of the class's module, to the default (`"float32"`,
`RunSettings()`, `{}` for `default_factory=dict`, `seeded_init`). Type and meaning are not empty.
The placements (every `Placement` subclass `tpcheck` exports) are the rows of the table under
`## Placements`, each named by its constructor in the first cell
(`Fused(dim, units, unit_size=())`): the arguments are the fields, in order, `name=default` where
there is a default.

(b) Links. In README.md, docs/, src/, tests/, examples/ and benchmarks/: every `docs/<path>.md`
names a file, and a `docs/<path>.md#<anchor>` a heading of it; in the Markdown files, every
relative link target `[text](target)` exists (relative to the file), and its `#anchor` is a heading
of the page it names. Anchors follow GitHub's rule: the heading's text lowercased, every character
but letters, digits, spaces, '-' and '_' dropped, spaces turned into '-', and `-1`, `-2`, ... after
a repeated one.

The functions take the text or the root they read, so the tests at the end can show that a missing
field, an extra field, a wrong default and a broken link are each reported.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path

import pytest

from paths import REPO

REFERENCE = REPO / "docs" / "case-files.md"
HEADER = ["field", "type", "default", "meaning"]
SCANNED = {
    "README.md": (),
    "docs": (".md",),
    "src": (".py", ".json", ".md"),
    "tests": (".py",),
    "examples": (".py",),
    "benchmarks": (".py", ".sh"),
}
SKIPPED_PARTS = {"__pycache__", ".pytest_cache"}
DOC_PATH = re.compile(r"(?<![\w/.-])docs/((?:[\w-]+/)*[\w-]+\.md)(?:#([\w-]+))?")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


def documented_classes() -> dict[str, type]:
    import tpcheck

    return {
        name: getattr(tpcheck, name)
        for name in ("Case", "RunSettings", "Plan", "CaseSpec", "Injection", "TPGroup")
    }


def exported_placements() -> dict[str, type]:
    import tpcheck

    return {
        name: obj
        for name in tpcheck.__all__
        if isinstance(obj := getattr(tpcheck, name), type)
        and issubclass(obj, tpcheck.Placement)
        and obj is not tpcheck.Placement
    }


# ------------------------------------------------------------------------------- Markdown reading


def outside_fences(text: str) -> list[str]:
    """The lines of `text` not inside a fenced code block (those inside become empty)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return out


def headings(text: str) -> list[str]:
    return [
        m.group(2).strip() for line in outside_fences(text) if (m := re.match(r"(#+) (.*)", line))
    ]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in headings(text):
        base = slug(h)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(the heading above it, its header cells, its rows' cells) for each table of `text`."""
    out, heading, table = [], "", None
    for line in outside_fences(text) + [""]:
        if line.startswith("|"):
            if table is None:
                table = (heading, cells(line), [])
                out.append(table)
            elif not re.fullmatch(r"[\s|:-]+", line):
                table[2].append(cells(line))
            continue
        table = None
        if m := re.match(r"#+ (.*)", line):
            heading = m.group(1).strip()
    return out


# ------------------------------------------------------------------------------------- (a) fields


def default_of(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def default_problem(owner: str, cell: str, default, namespace: dict) -> str | None:
    """Why the default `cell` does not say `default` (None when it does)."""
    if default is dataclasses.MISSING:
        return (
            None if cell == "required" else f"{owner}: no default in the code, {cell!r} in the doc"
        )
    m = re.fullmatch(r"`([^`]+)`", cell)
    if not m:
        return f"{owner}: the default {default!r} is written {cell!r}, not as `expression`"
    try:
        value = eval(m.group(1), dict(namespace))  # the doc's own expression, in the code's names
    except Exception as e:  # any failure is the doc's to fix, and said as such
        return f"{owner}: the default {m.group(1)!r} does not evaluate ({type(e).__name__}: {e})"
    if value != default:
        return f"{owner}: the doc's default {m.group(1)} is {value!r}, the code's {default!r}"
    return None


def field_problems(doc: str, name: str, cls: type) -> list[str]:
    """What the reference `doc` gets wrong about the fields of dataclass `cls` (documented as
    `name`)."""
    found = [t for t in tables(doc) if t[0] == f"`{name}`" and t[1] == HEADER]
    if len(found) != 1:
        return [f"{name}: {len(found)} tables `{' | '.join(HEADER)}` under a heading `{name}`"]
    rows = found[0][2]
    problems, documented = [], []
    for row in rows:
        m = re.fullmatch(r"`(\w+)`", row[0])
        if len(row) != len(HEADER) or not m:
            problems.append(f"{name}: a row that is no `field` row: {' | '.join(row)}")
            continue
        documented.append((m.group(1), row))
    code = {f.name: f for f in dataclasses.fields(cls)}
    names = [n for n, _ in documented]
    problems += [f"{name}.{n}: in the code, not documented" for n in code if n not in names]
    problems += [f"{name}.{n}: documented, not in the code" for n in names if n not in code]
    problems += [
        f"{name}.{n}: documented twice" for n in sorted({n for n in names if names.count(n) > 1})
    ]
    common = [n for n in names if n in code]
    if common != [n for n in code if n in names]:
        problems.append(f"{name}: the rows are not in the code's order {list(code)}")
    namespace = vars(sys.modules[cls.__module__])
    for n, row in documented:
        if n not in code:
            continue
        _, type_, default, meaning = row
        if not type_ or not meaning:
            problems.append(f"{name}.{n}: no type or no meaning")
        if why := default_problem(f"{name}.{n}", default, default_of(code[n]), namespace):
            problems.append(why)
    return problems


def placement_problems(doc: str, placements: dict[str, type]) -> list[str]:
    """What the `## Placements` table of `doc` gets wrong about the exported placements."""
    found = [t for t in tables(doc) if t[0] == "Placements" and t[1][:1] == ["placement"]]
    if len(found) != 1:
        return [f"{len(found)} tables `| placement | ...` under a heading `Placements`"]
    problems, seen = [], set()
    for row in found[0][2]:
        m = re.fullmatch(r"`(\w+)\((.*)\)`", row[0])
        try:
            signature = ast.parse(f"def f({m.group(2)}): pass").body[0].args if m else None
        except SyntaxError:
            signature = None
        if signature is None:
            problems.append(f"a placement row that is no `Name(fields)`: {row[0]}")
            continue
        name = m.group(1)
        seen.add(name)
        if name not in placements:
            problems.append(f"{name}: documented, not a placement tpcheck exports")
            continue
        if len(row) < 2 or not row[-1]:
            problems.append(f"{name}: no meaning")
        code = {f.name: f for f in dataclasses.fields(placements[name])}
        written = [a.arg for a in signature.args]
        if written != list(code):
            problems.append(f"{name}: documented with fields {written}, the code has {list(code)}")
            continue
        defaults = [None] * (len(written) - len(signature.defaults)) + signature.defaults
        namespace = vars(sys.modules[placements[name].__module__])
        for field_name, value in zip(written, defaults):
            cell = f"`{ast.unparse(value)}`" if value is not None else "required"
            default = default_of(code[field_name])
            if why := default_problem(f"{name}.{field_name}", cell, default, namespace):
                problems.append(why)
    problems += [f"{n}: exported, not documented" for n in placements if n not in seen]
    return problems


@pytest.mark.parametrize(
    "name", ["Case", "RunSettings", "Plan", "CaseSpec", "Injection", "TPGroup"]
)
def test_the_reference_documents_every_field(name):
    problems = field_problems(REFERENCE.read_text(), name, documented_classes()[name])
    assert not problems, "docs/case-files.md vs the code:\n" + "\n".join(problems)


def test_the_reference_documents_every_placement():
    problems = placement_problems(REFERENCE.read_text(), exported_placements())
    assert not problems, "docs/case-files.md vs the code:\n" + "\n".join(problems)


@dataclasses.dataclass
class Fake:
    a: int
    b: str = "x"
    c: dict = dataclasses.field(default_factory=dict)


FAKE_DOC = """## `Fake`

| field | type | default | meaning |
|---|---|---|---|
| `a` | int | required | the first |
| `b` | str | `"x"` | the second |
| `c` | dict | `{}` | the third |
"""


def test_a_faithful_fake_reference_has_no_problem():
    assert field_problems(FAKE_DOC, "Fake", Fake) == []


@pytest.mark.parametrize(
    "change, said",
    [
        (('| `b` | str | `"x"` | the second |\n', ""), "Fake.b: in the code, not documented"),
        (("| `c` |", "| `d` | int | `0` | more |\n| `c` |"), "Fake.d: documented, not in the code"),
        (('`"x"`', '`"y"`'), "Fake.b: the doc's default \"y\" is 'y', the code's 'x'"),
        (("| `a` | int | required |", "| `a` | int | `0` |"), "Fake.a: no default in the code"),
        (("`{}`", "{}"), "Fake.c: the default {} is written '{}'"),
        (("| `a` | int | required | the first |\n", ""), "Fake.a: in the code, not documented"),
        (("`Fake`", "Fake"), "Fake: 0 tables"),
    ],
    ids=[
        "missing",
        "extra",
        "wrong default",
        "default of a required",
        "unquoted",
        "first",
        "no heading",
    ],
)
def test_a_mutated_fake_reference_is_reported(change, said):
    old, new = change
    assert old in FAKE_DOC
    problems = field_problems(FAKE_DOC.replace(old, new, 1), "Fake", Fake)
    assert any(p.startswith(said) for p in problems), problems


def test_rows_out_of_order_are_reported():
    a, b = "| `a` | int | required | the first |\n", '| `b` | str | `"x"` | the second |\n'
    problems = field_problems(FAKE_DOC.replace(a + b, b + a), "Fake", Fake)
    assert problems == ["Fake: the rows are not in the code's order ['a', 'b', 'c']"], problems


def test_a_mutated_placement_table_is_reported():
    table = next(t for t in tables(REFERENCE.read_text()) if t[0] == "Placements")
    rows = "\n".join("| " + " | ".join(r) + " |" for r in table[2])
    doc = "## Placements\n\n| placement | fields | meaning |\n|---|---|---|\n" + rows + "\n"
    assert placement_problems(doc, exported_placements()) == []
    dropped = "\n".join(line for line in doc.splitlines() if not line.startswith("| `OnRank("))
    assert placement_problems(dropped, exported_placements()) == [
        "OnRank: exported, not documented"
    ]
    extra = doc.replace("`Shard(dim)`", "`Shard(dim, size)`")
    assert placement_problems(extra, exported_placements()) == [
        "Shard: documented with fields ['dim', 'size'], the code has ['dim']"
    ]
    wrong = doc.replace("`OnRank(rank=0)`", "`OnRank(rank=1)`")
    assert placement_problems(wrong, exported_placements()) == [
        "OnRank.rank: the doc's default 1 is 1, the code's 0"
    ]


# -------------------------------------------------------------------------------------- (b) links


def scanned_files(root: Path) -> list[Path]:
    out = []
    for top, suffixes in SCANNED.items():
        path = root / top
        if path.is_file():
            out.append(path)
        elif path.is_dir():
            out += [
                p
                for p in sorted(path.rglob("*"))
                if p.is_file()
                and p.suffix in suffixes
                and not SKIPPED_PARTS & set(p.parts)
                and not any(part.endswith(".egg-info") for part in p.parts)
            ]
    return out


def link_problems(root: Path) -> list[str]:
    """Every broken link into docs/ under `root`, as `file:line: what`."""
    problems, anchor_cache = [], {}

    def anchor_of(page: Path) -> set[str]:
        if page not in anchor_cache:
            anchor_cache[page] = anchors(page.read_text())
        return anchor_cache[page]

    def check(where: str, target: Path, anchor: str | None, written: str) -> None:
        if not target.exists():
            problems.append(f"{where}: {written} names no file")
        elif anchor and target.suffix == ".md" and anchor not in anchor_of(target):
            problems.append(
                f"{where}: {written}: no heading of {target.name} has the anchor #{anchor}"
            )

    for path in scanned_files(root):
        text = path.read_text(errors="replace")
        lines = outside_fences(text) if path.suffix == ".md" else text.splitlines()
        for number, line in enumerate(text.splitlines(), 1):
            where = f"{path.relative_to(root)}:{number}"
            for m in DOC_PATH.finditer(line):
                check(where, root / "docs" / m.group(1), m.group(2), m.group(0))
            if path.suffix != ".md" or not lines[number - 1]:
                continue
            for m in MD_LINK.finditer(lines[number - 1]):
                target = m.group(1)
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                page = (path.parent / file_part) if file_part else path
                check(where, page, anchor or None, target)
    return problems


def test_every_link_into_docs_resolves():
    problems = link_problems(REPO)
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("`Case`", "case"),
        ("Discrete decisions (top-k routing)", "discrete-decisions-top-k-routing"),
        ("What a written plan's silence means", "what-a-written-plans-silence-means"),
        ("On GPUs (`--device cuda`)", "on-gpus---device-cuda"),
        (
            "Gradient hooks and your own plan (`plan_rules`)",
            "gradient-hooks-and-your-own-plan-plan_rules",
        ),
        (
            "(e) One Llama-3-8B-shaped layer (`bench_llama_layer.py`)",
            "e-one-llama-3-8b-shaped-layer-bench_llama_layerpy",
        ),
    ],
)
def test_anchors_follow_githubs_rule(heading, anchor):
    assert slug(heading) == anchor


def test_a_repeated_heading_gets_a_numbered_anchor():
    assert anchors("# A\n## Notes\n## Notes\n```\n# not a heading\n```\n") == {
        "a",
        "notes",
        "notes-1",
    }


def test_broken_links_are_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\n## Some heading (`x`)\n\n"
        "[here](#some-heading-x) [there](#nowhere) [a](other.md)\n"
    )
    page = "docs" + "/page.md"  # written in two parts: this file is scanned too
    (tmp_path / "README.md").write_text(
        f"{page}#some-heading-x is fine; {page}#gone is not; " + "docs" + "/absent.md neither\n"
    )
    assert sorted(link_problems(tmp_path)) == sorted(
        [
            f"README.md:1: {page}#gone: no heading of page.md has the anchor #gone",
            "README.md:1: " + "docs" + "/absent.md names no file",
            f"{page}:5: #nowhere: no heading of page.md has the anchor #nowhere",
            f"{page}:5: other.md names no file",
        ]
    )
