"""The module outputs of a case as its report records them (`cases[].activations`, written by
checker/rank/discover.py `Discovery.record`): which placements the case wrote, which tpcheck
inferred where the case was silent, which outputs were not checked and which are no placement of
the dense output -- as code, for `verify --print-plan` and the HTML page."""

from __future__ import annotations


def module_outputs_code(record: dict) -> str:
    """`activations={...}` with each entry marked `# written` or `# inferred`, then a comment line
    per output not checked (and why) and per output that is no placement of the dense one."""
    lines = [f"    {name!r}: {p},  # written" for name, p in record.get("written", {}).items()]
    lines += [f"    {name!r}: {p},  # inferred" for name, p in record.get("inferred", {}).items()]
    text = "activations={\n" + "".join(line + "\n" for line in lines) + "}"
    text += "".join(
        f"\n# not checked: {name}: {why}" for name, why in record.get("not_checked", {}).items()
    )
    text += "".join(
        f"\n# failed: {name}: {why}" for name, why in record.get("no_placement", {}).items()
    )
    return text


def counts(record: dict) -> str:
    """'2 written, 9 inferred, 1 not checked' (and 'N no placement' where there are any)."""
    parts = [
        f"{len(record.get('written', {}))} written",
        f"{len(record.get('inferred', {}))} inferred",
        f"{len(record.get('not_checked', {}))} not checked",
    ]
    if record.get("no_placement"):
        parts.append(f"{len(record['no_placement'])} no placement of the dense output")
    return ", ".join(parts)
