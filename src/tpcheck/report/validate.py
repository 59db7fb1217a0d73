"""A small JSON Schema checker for the report's own schema (report/schema.json), so that
`tpcheck report` can refuse a malformed file with the first error instead of failing somewhere
inside the renderer.

jsonschema is a test dependency only; this implements the draft 2020-12 keywords schema.json uses
(listed in KEYWORDS, with the same meaning) and refuses a schema that uses any other, so that a new
keyword in schema.json cannot be silently ignored. tests/report/test_report_validation.py checks
that it agrees with jsonschema.
"""

from __future__ import annotations

import json
import math
import re

ANNOTATIONS = {"$schema", "$id", "title", "description", "$defs"}  # no effect on validity
KEYWORDS = {
    "type",
    "const",
    "enum",
    "required",
    "properties",
    "additionalProperties",
    "propertyNames",
    "pattern",
    "minimum",
    "minLength",
    "items",
    "minItems",
    "maxItems",
    "$ref",
    "oneOf",
    "if",
    "then",
    "else",
}
TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, float) and math.isfinite(v) and v.is_integer())
    ),
}


class SchemaError(Exception):
    """One place where a document breaks the schema:
    `path` (keys and indices from the top) and why."""

    def __init__(self, path: tuple, message: str) -> None:
        super().__init__(message)
        self.path, self.message = path, message

    def where(self) -> str:
        """The path as `cases[0].spec.world_size` ('the top level' for the document itself)."""
        out = ""
        for part in self.path:
            out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
        return out or "the top level"

    def __str__(self) -> str:
        return f"{self.where()}: {self.message}"


def first_error(document, schema: dict) -> SchemaError | None:
    """The first error of `document` against `schema` (properties in the schema's order, items in
    order), or None when the document is valid."""
    try:
        _check(document, schema, schema, ())
    except SchemaError as e:
        return e
    return None


def _show(value) -> str:
    """A value as JSON, shortened to one readable line."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _equal(a, b) -> bool:
    """JSON equality: booleans are not numbers (Python has True == 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _resolve(ref: str, root: dict) -> dict:
    if not ref.startswith("#/"):
        raise ValueError(f"only local $refs are supported, got {ref!r}")
    node = root
    for key in ref[2:].split("/"):
        node = node[key]
    return node


def _check(value, schema, root: dict, path: tuple) -> None:
    """Raise SchemaError at the first keyword of `schema` that `value` breaks: its type and value,
    then what it contains (required keys first), then the combinators (oneOf, if/then/else)."""
    if schema is True or schema == {}:
        return
    if schema is False:
        raise SchemaError(path, "no value is allowed here")
    unknown = set(schema) - KEYWORDS - ANNOTATIONS
    if unknown:
        raise ValueError(
            f"schema keyword(s) {sorted(unknown)} are not implemented by tpcheck.report.validate"
        )
    if "$ref" in schema:
        _check(value, _resolve(schema["$ref"], root), root, path)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(TYPES[t](value) for t in types):
            raise SchemaError(path, f"{_show(value)} is not of type {' or '.join(types)}")
    if "const" in schema and not _equal(value, schema["const"]):
        raise SchemaError(path, f"{_show(value)} is not {_show(schema['const'])}")
    if "enum" in schema and not any(_equal(value, e) for e in schema["enum"]):
        raise SchemaError(path, f"{_show(value)} is not one of {_show(schema['enum'])}")
    if isinstance(value, dict):
        _check_object(value, schema, root, path)
    elif isinstance(value, list):
        _check_array(value, schema, root, path)
    elif isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            raise SchemaError(
                path, f"{_show(value)} is shorter than {schema['minLength']} character(s)"
            )
        if "pattern" in schema and not re.search(schema["pattern"], value):
            raise SchemaError(path, f"{_show(value)} does not match {schema['pattern']!r}")
    elif TYPES["number"](value) and "minimum" in schema and value < schema["minimum"]:
        raise SchemaError(path, f"{_show(value)} is less than the minimum of {schema['minimum']}")
    if "oneOf" in schema:
        _check_one_of(value, schema["oneOf"], root, path)
    if "if" in schema:
        branch = "then" if _valid(value, schema["if"], root, path) else "else"
        if branch in schema:
            _check(value, schema[branch], root, path)


def _valid(value, schema, root: dict, path: tuple) -> bool:
    try:
        _check(value, schema, root, path)
    except SchemaError:
        return False
    return True


def _check_one_of(value, options: list, root: dict, path: tuple) -> None:
    """Exactly one option must match; when none does, the error of the option that got furthest."""
    errors = []
    for option in options:
        try:
            _check(value, option, root, path)
        except SchemaError as e:
            errors.append(e)
    matched = len(options) - len(errors)
    if matched == 1:
        return
    if matched > 1:
        raise SchemaError(path, f"{_show(value)} matches more than one of the allowed shapes")
    deepest = max(errors, key=lambda e: (len(e.path), "is not of type" not in e.message))
    raise deepest


def _check_object(value: dict, schema: dict, root: dict, path: tuple) -> None:
    for key in schema.get("required", []):
        if key not in value:
            raise SchemaError(path, f"{key!r} is a required property")
    properties = schema.get("properties", {})
    for key, sub in properties.items():
        if key in value:
            _check(value[key], sub, root, (*path, key))
    for key in value:
        if "propertyNames" in schema:
            try:
                _check(key, schema["propertyNames"], root, path)
            except SchemaError as e:
                raise SchemaError(path, f"property name {e.message}") from None
        if key not in properties and "additionalProperties" in schema:
            extra = schema["additionalProperties"]
            if extra is False:
                raise SchemaError(
                    path, f"{key!r} was unexpected (additional properties are not allowed)"
                )
            _check(value[key], extra, root, (*path, key))


def _check_array(value: list, schema: dict, root: dict, path: tuple) -> None:
    if len(value) < schema.get("minItems", 0):
        raise SchemaError(path, f"{_show(value)} has fewer than {schema['minItems']} item(s)")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        raise SchemaError(path, f"{_show(value)} has more than {schema['maxItems']} item(s)")
    if "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], root, (*path, i))
