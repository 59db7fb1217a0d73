"""docs/index.md lists every page of docs/ (the findings included) under one of its four groups, and
the README stays a short entry point that links to it."""

import re

from paths import REPO

DOCS = REPO / "docs"
GROUPS = ["Start here", "Reference", "How it works", "Findings"]
README_MAX_LINES = 120


def listed(index: str) -> dict[str, list[str]]:
    """{group heading: the pages its list links to}."""
    out: dict[str, list[str]] = {}
    group = None
    for line in index.splitlines():
        if line.startswith("## "):
            group = line[3:].strip()
            out[group] = []
        elif group and (m := re.match(r"- \[[^\]]*\]\(([^)#]+\.md)\) — \S", line)):
            out[group].append(m.group(1))
    return out


def test_the_index_lists_every_page_once_in_its_groups():
    groups = listed((DOCS / "index.md").read_text())
    assert list(groups) == GROUPS
    pages = [p for pages in groups.values() for p in pages]
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if p.name != "index.md")
    assert sorted(pages) == on_disk, "docs/index.md: each page once, as `- [page](page) — what`"


def test_the_readme_is_short_and_points_to_the_index():
    readme = (REPO / "README.md").read_text()
    lines = readme.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the details go in docs/"
    assert "(docs/index.md)" in readme
