"""Parameter values typed by the tools' JSON schemas, as llama.cpp types them.

Templates that write arguments one by one (`<parameter=count>\n42\n</parameter>`) write every
value as text. llama.cpp reads such a value by the parameter's schema: as JSON where the schema
allows no string (`42` is 42 for an integer; `null`, `true`, `[1, 2]`), as text where it allows
only strings, and where it allows both, as JSON when the text is a value of one of the other
types, else as text (`parsers/qwen3-coder.cpp`, `value_types` in `common/json-schema.cpp`). A
parameter of no known tool, or a value that is not JSON where JSON is due, is kept as loopd kept
it before: an object or a list when it is one in JSON, else the text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ArgumentTypes"]


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


def _types(schema: Any, defs: Mapping[str, Any], seen: frozenset[str] = frozenset()) -> set[str]:
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
        return set() if name in seen else _types(defs.get(name), defs, seen | {name})
    parts = [*schema.get("anyOf", ()), *schema.get("oneOf", ()), *schema.get("allOf", ())]
    found = [_types(part, defs, seen) for part in parts]
    return set() if not found or not all(found) else set().union(*found)


def _untyped(text: str) -> object:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict | list) else text


class ArgumentTypes:
    """For each tool, the JSON types each of its parameters may have."""

    def __init__(self, tools: Iterable[Mapping[str, Any]] = ()) -> None:
        self._types: dict[str, dict[str, set[str]]] = {}
        for tool in tools:
            function = tool.get("function", tool)
            params = function.get("parameters") or {}
            defs = {**params.get("definitions", {}), **params.get("$defs", {})}
            self._types[function["name"]] = {
                key: _types(schema, defs)
                for key, schema in (params.get("properties") or {}).items()
            }

    def value(self, tool: str, key: str, text: str) -> object:
        """The value of `key` in a call of `tool`, written as `text`."""
        types = self._types.get(tool, {}).get(key)
        if types is None:
            return _untyped(text)
        if types == {"string"}:
            return text
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text
        # A value that may be a string is JSON only where it is one of its other types.
        fits = not types or "string" not in types or _json_type(value) in types
        return value if fits else text
