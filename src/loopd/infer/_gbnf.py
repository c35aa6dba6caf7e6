"""A JSON schema as GBNF rules, in each notation loopd reads a call's arguments in: JSON,
Gemma 4's own (`{path:<|"|>a.md<|"|>,depth:2}`) and Python's keyword arguments
(`(path='a.md', depth=2)`, as LFM2 writes them). Each writes only what `_notation` reads.

The schema subset is what tool parameters use: objects with properties (the required ones in
order, then the optional ones), strings, numbers, integers, booleans, null, arrays, `enum`,
`const`, `anyOf`/`oneOf` and lists of types; anything else is any value (llama.cpp's
`json_schema_to_grammar` is the reference).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._notation import GEMMA_QUOTE, Notation

__all__ = ["ID_CHARS", "SYNTAX", "Rules", "Syntax", "excluding", "literal"]

ID_CHARS = r"[a-zA-Z0-9_\-]"
"""A character of a call id, in GBNF and in a regular expression alike."""
COMMON = {
    "ws": r"[ \t\n]{0,20}",
    # What a model writes for a call's id or index (Mistral's nine characters, Kimi's `0`).
    "call-id": ID_CHARS + "{1,40}",
}
NUMBERS = {
    "number": r'"-"? ([0-9] | [1-9] [0-9]{0,15}) ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,4})?',
    "integer": r'"-"? ([0-9] | [1-9] [0-9]{0,15})',
}
TYPES = {"string", "number", "integer", "boolean", "null", "object", "array"}
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_BARE_KEY = re.compile(r"[\w.\-]+")


def literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


def excluding(end: str) -> str:
    """Any text that does not contain `end` (a value written as text, up to its end)."""
    options = [f"[^{_char_class(end[0])}]"]
    options += [f"{literal(end[:i])} [^{_char_class(end[i])}]" for i in range(1, len(end))]
    return "( " + " | ".join(options) + " )*"


def _char_class(char: str) -> str:
    return "\\" + char if char in "]\\^-" else char.replace("\n", "\\n").replace("\t", "\\t")


@dataclass(frozen=True)
class Frame:
    """How an object is written: what opens it, each key (as GBNF, up to its value; None for a
    key the notation cannot write) and what closes it."""

    open: str
    key: Callable[[str], str | None]
    close: str
    sorted: bool = False
    """The keys in the order of their names, as Gemma 4's template writes them; else the
    required ones first, in the schema's order, then the optional ones."""


@dataclass(frozen=True)
class Syntax:
    """How a notation writes values."""

    rules: Mapping[str, str]
    """Its rules for the types of `TYPES`, `value`, and what they use."""
    encode: Callable[[Any], str]
    """A constant's text (`const`, `enum`)."""
    comma: str
    object: Frame
    array: tuple[str, str]
    arguments: Frame
    """How a call's arguments are written."""
    any_arguments: str
    """The rule for arguments of a tool whose schema names no properties."""


def _json_key(key: str) -> str:
    return f'{literal(json.dumps(key))} ws ":" ws'


JSON = Syntax(
    rules={
        **NUMBERS,
        "char": r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})',
        "string": r'"\"" char* "\""',
        "boolean": r'"true" | "false"',
        "null": r'"null"',
        "value": "object | array | string | number | boolean | null",
        "object": r'"{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? ws "}"',
        "array": r'"[" ws ( value ( "," ws value )* )? ws "]"',
    },
    encode=json.dumps,
    comma='"," ws',
    object=Frame('"{" ws', _json_key, 'ws "}"'),
    array=('"[" ws', 'ws "]"'),
    arguments=Frame('"{" ws', _json_key, 'ws "}"'),
    any_arguments="object",
)


def _gemma(value: Any) -> str:
    """A value as Gemma 4's template writes it."""
    if isinstance(value, str):
        return GEMMA_QUOTE + value + GEMMA_QUOTE
    if isinstance(value, list):
        return "[" + ",".join(_gemma(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_gemma_key(k)}:{_gemma(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _gemma_key(key: str) -> str:
    """A key bare, as the template writes it, or quoted where it would not read back bare."""
    return key if _BARE_KEY.fullmatch(key) else GEMMA_QUOTE + key + GEMMA_QUOTE


def _gemma_frame_key(key: str) -> str | None:
    return None if GEMMA_QUOTE in key else literal(_gemma_key(key) + ":")


_GEMMA_OBJECT = Frame('"{"', _gemma_frame_key, '"}"', sorted=True)
GEMMA = Syntax(
    rules={
        **NUMBERS,
        "text": excluding(GEMMA_QUOTE),
        "string": f"{literal(GEMMA_QUOTE)} text {literal(GEMMA_QUOTE)}",
        "boolean": r'"true" | "false"',
        "null": r'"null"',
        "value": "object | array | string | number | boolean | null",
        # Keys bare, as the template writes them (the parser reads no empty one).
        "key": r"[a-zA-Z0-9_.\-]{1,64}",
        "object": r'"{" ( key ":" value ( "," key ":" value )* )? "}"',
        "array": r'"[" ( value ( "," value )* )? "]"',
    },
    encode=_gemma,
    comma='","',
    object=_GEMMA_OBJECT,
    array=('"["', '"]"'),
    arguments=_GEMMA_OBJECT,
    any_arguments="object",
)


def _python(value: Any) -> str:
    """A value as a Python literal, strings in single quotes as LFM2's template writes them."""
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, list):
        return "[" + ", ".join(_python(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_python(k)}: {_python(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, bool):
        return repr(value)
    return json.dumps(value)


def _keyword(key: str) -> str | None:
    """A keyword argument's name: llama.cpp reads keyword arguments alone, so a property
    whose name is no identifier cannot be passed."""
    return literal(key + "=") if _IDENTIFIER.fullmatch(key) else None


PYTHON = Syntax(
    rules={
        **NUMBERS,
        "escape": '"\\\\" (["\\\\/bfnrt\'] | "u" [0-9a-fA-F]{4})',
        # Newlines as they are, as LFM2 writes a here-document.
        "string": '"\'" ( [^\'\\\\] | escape )* "\'"',
        "boolean": r'"True" | "False"',
        "null": r'"None"',
        "value": "object | array | string | number | boolean | null",
        "object": r'"{" ws ( string ws ":" ws value ( "," ws string ws ":" ws value )* )? ws "}"',
        "array": r'"[" ws ( value ( "," ws value )* )? ws "]"',
        "kwarg": r'[A-Za-z_] [A-Za-z0-9_]{0,63} "=" value',
        "kwargs": r'"(" ( kwarg ( "," ws kwarg )* )? ")"',
    },
    encode=_python,
    comma='"," ws',
    object=Frame('"{" ws', lambda key: f'{literal(_python(key))} ws ":" ws', 'ws "}"'),
    array=('"[" ws', 'ws "]"'),
    arguments=Frame('"("', _keyword, '")"'),
    any_arguments="kwargs",
)

SYNTAX: dict[Notation, Syntax] = {"json": JSON, "gemma": GEMMA, "python": PYTHON}


class Rules:
    """GBNF rules, made one by one, of values in one notation."""

    def __init__(self, syntax: Syntax = JSON) -> None:
        self.syntax = syntax
        self.rules: dict[str, str] = {**COMMON, **syntax.rules}

    def add(self, name: str, body: str) -> str:
        name = re.sub(r"[^a-zA-Z0-9-]+", "-", name)
        self.rules[name] = body
        return name

    def arguments(self, params: Mapping[str, Any], name: str) -> str:
        """The rule for a call's arguments, `params` its tool's parameters."""
        if not params.get("properties"):
            return self.syntax.any_arguments
        return self.add(name, self._object(params, name, self.syntax.arguments))

    def schema(self, schema: Any, name: str) -> str:  # noqa: PLR0911 - one per kind
        """The rule for a value of `schema`."""
        if not isinstance(schema, Mapping) or not schema:
            return "value"
        encode = self.syntax.encode
        if "const" in schema:
            return self.add(name, literal(encode(schema["const"])))
        if "enum" in schema:
            return self.add(name, " | ".join(literal(encode(v)) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                parts = [self.schema(s, f"{name}-{i}") for i, s in enumerate(schema[key])]
                return self.add(name, " | ".join(parts))
        kind = schema.get("type")
        if isinstance(kind, list):
            parts = [self.schema({**schema, "type": k}, f"{name}-{k}") for k in kind]
            return self.add(name, " | ".join(parts))
        if kind == "object" and schema.get("properties"):
            return self.add(name, self._object(schema, name, self.syntax.object))
        if kind == "array" and "items" in schema:
            item = self.schema(schema["items"], f"{name}-item")
            (start, end), comma = self.syntax.array, self.syntax.comma
            return self.add(name, f"{start} ( {item} ( {comma} {item} )* )? {end}")
        return kind if kind in TYPES else "value"

    def _object(self, schema: Mapping[str, Any], name: str, frame: Frame) -> str:
        properties: Mapping[str, Any] = schema["properties"]
        keys = {k: key for k in properties if (key := frame.key(k)) is not None}
        required = set(schema.get("required", ()))
        order = sorted(keys) if frame.sorted else sorted(keys, key=lambda k: k not in required)
        pairs = [
            (f"{keys[k]} {self.schema(properties[k], f'{name}-{k}')}", k in required) for k in order
        ]
        return f"{frame.open} {self._members(pairs)} {frame.close}".replace("  ", " ")

    def _members(self, pairs: list[tuple[str, bool]]) -> str:
        """Key-value pairs in order, each required or not, a comma between those written."""
        comma = self.syntax.comma

        def after(i: int) -> str:  # once one is written
            return " ".join(f"{comma} {p}" if req else f"( {comma} {p} )?" for p, req in pairs[i:])

        # Which one is written first: the first required one, or an optional one before it.
        firsts = []
        for i, (pair, req) in enumerate(pairs):
            firsts.append(f"{pair} {after(i + 1)}".strip())
            if req:
                break
        else:
            return f"( {' | '.join(firsts)} )?" if firsts else ""
        return firsts[0] if len(firsts) == 1 else f"( {' | '.join(firsts)} )"

    def text(self) -> str:
        return "\n".join(f"{name} ::= {body}" for name, body in self.rules.items()) + "\n"
