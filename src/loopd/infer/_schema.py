"""Parameter values typed by the tools' JSON schemas, as llama.cpp types them.

Templates that write arguments one by one (`<parameter=count>\n42\n</parameter>`) write every
value as text. llama.cpp reads such a value by the parameter's schema: as JSON where the schema
allows no string (`42` is 42 for an integer; `null`, `true`, `[1, 2]`), as text where it allows
only strings, and where it allows both, as JSON when the text is a value of one of the other
types, else as text (`parsers/qwen3-coder.cpp`, `value_types` in `common/json-schema.cpp`). A
parameter of no known tool, or a value that is not JSON where JSON is due, is kept as loopd kept
it before: an object or a list when it is one in JSON, else the text.

Where the schema asks for an object or a list and the text is no JSON, a Python literal is
read (`{'path': 'a.md'}`: ByteDance Seed-OSS's template writes such values with `| string`).

MiniMax-M3 writes an object or a list as nested tags (`<real>1.5</real>`, `<item>a</item>`):
read as such where the schema allows no string, each leaf typed by its part of the schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ._notation import python_literal

__all__ = ["ArgumentTypes", "read_tagged", "value_types"]


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, dict):
        return "object"
    return "array" if isinstance(value, list) else "string"


def value_types(
    schema: Any, defs: Mapping[str, Any], seen: frozenset[str] = frozenset()
) -> set[str]:
    """The JSON types a value of `schema` may have; empty for any (a cycle of references
    counts as any)."""
    if not isinstance(schema, Mapping):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str | list):
        kinds = {kind} if isinstance(kind, str) else set(kind)
        return {"number" if k == "integer" else k for k in kinds}
    if "const" in schema:
        return {_json_type(schema["const"])}
    if "enum" in schema:
        return {_json_type(v) for v in schema["enum"]}
    if isinstance(ref := schema.get("$ref"), str):
        name = ref.rpartition("/")[2]
        return set() if name in seen else value_types(defs.get(name), defs, seen | {name})
    parts = [*schema.get("anyOf", ()), *schema.get("oneOf", ()), *schema.get("allOf", ())]
    found = [value_types(part, defs, seen) for part in parts]
    return set() if not found or not all(found) else set().union(*found)


def _untyped(text: str) -> object:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
        return text
    return value if isinstance(value, dict | list) else text


Tagged = str | list["Tagged"] | dict[str, "Tagged"]
"""A value written as nested tags (MiniMax-M3's `<real>1.5</real>`, `<item>a</item>`), its
leaves still text."""


def _leaf(text: str, types: set[str] | None) -> object:
    if types is None:
        return _untyped(text)
    if types == {"string"}:
        return text
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
        return _literal(text, types)
    # A value that may be a string is JSON only where it is one of its other types.
    fits = not types or "string" not in types or _json_type(value) in types
    return value if fits else text


def _literal(text: str, types: set[str]) -> object:
    """A list or an object the schema asks for, written as a Python literal (as a template's
    `| string` writes one); else the text."""
    if not types & {"object", "array"} or "string" in types:
        return text
    try:
        value = python_literal(text.strip())
    except (ValueError, RecursionError):
        return text
    return value if _json_type(value) in types else text


def _branch(schema: Any, kind: str, defs: Mapping[str, Any]) -> Any:
    """The part of `schema` for a value of JSON type `kind` (an `anyOf` or `oneOf` branch)."""
    if not isinstance(schema, Mapping):
        return None
    for key in ("anyOf", "oneOf"):
        for part in schema.get(key, ()):
            if kind in value_types(part, defs):
                return part
    return schema


class ArgumentTypes:
    """For each tool, the schema of each of its parameters, to type what the model wrote."""

    def __init__(self, tools: Iterable[Mapping[str, Any]] = ()) -> None:
        self._schemas: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
        for tool in tools:
            function = tool.get("function", tool)
            params = function.get("parameters") or {}
            defs = {**params.get("definitions", {}), **params.get("$defs", {})}
            self._schemas[function["name"]] = (dict(params.get("properties") or {}), defs)

    def value(self, tool: str, key: str, text: str, *, tags: str = "") -> object:
        """The value of `key` in a call of `tool`, written as `text`; with `tags`, the prefix of
        the tags an object or a list is written in, read where the schema allows no string
        (where it does, the tags are the string, as llama.cpp reads them)."""
        properties, defs = self._schemas.get(tool, ({}, {}))
        schema = properties.get(key)
        written: Tagged = text
        tagged = tags and text.lstrip().startswith(tags + "<")
        if tagged and (schema is None or "string" not in value_types(schema, defs)):
            written = read_tagged(text, tags)
        return self._typed(written, schema, defs)

    def _typed(self, written: Tagged, schema: Any, defs: Mapping[str, Any]) -> object:
        if isinstance(written, str):
            return _leaf(written, None if schema is None else value_types(schema, defs))
        if isinstance(written, list):
            part = _branch(schema, "array", defs)
            items = part.get("items") if isinstance(part, Mapping) else None
            return [self._typed(item, items, defs) for item in written]
        part = _branch(schema, "object", defs)
        properties = part.get("properties", {}) if isinstance(part, Mapping) else {}
        return {k: self._typed(v, properties.get(k), defs) for k, v in written.items()}


def read_tagged(text: str, prefix: str) -> Tagged:
    """A value written as nested tags, each `prefix<name>...prefix</name>`: a list where every
    name is `item`, else an object; text without tags is a leaf."""
    opening = re.compile(rf"\s*{re.escape(prefix)}<([\w.\-]+)>")
    entries: list[tuple[str, Tagged]] = []
    at = 0
    while (tag := opening.match(text, at)) is not None:
        name = tag.group(1)
        end = _closing(text, tag.end(), prefix, name)
        if end < 0:
            return text
        entries.append((name, read_tagged(text[tag.end() : end], prefix)))
        at = end + len(f"{prefix}</{name}>")
    if not entries or text[at:].strip():
        return text
    if all(name == "item" for name, _ in entries):
        return [value for _, value in entries]
    return dict(entries)


def _closing(text: str, at: int, prefix: str, name: str) -> int:
    """Where the tag `name` opened before `at` closes, tags of the same name nested inside."""
    opened, closed, depth = f"{prefix}<{name}>", f"{prefix}</{name}>", 1
    while True:
        end = text.find(closed, at)
        if end < 0:
            return -1
        depth += text.count(opened, at, end) - 1
        if depth == 0:
            return end
        at = end + len(closed)
