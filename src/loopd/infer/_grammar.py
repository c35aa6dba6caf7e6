"""A tool call in the template's own syntax as a GBNF grammar, its arguments constrained by the
tools' JSON schemas: what llama-server's chat endpoint sends with a request that offers tools
(a lazy grammar, applied from where a call opens), made for loopd's token-exact requests.

The schema subset is what tool parameters use: objects with properties (the required ones in
order, then the optional ones), strings, numbers, integers, booleans, null, arrays, `enum`,
`const`, `anyOf`/`oneOf` and lists of types; anything else is any JSON value (llama.cpp's
`json_schema_to_grammar` is the reference). Calls written as Gemma's notation, as Python or
as harmony messages get no grammar: llama-server's own chat endpoint is the place for those.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ._format import CALL_ID, PARAM_KEY, SPECIAL, ChatFormat, ToolCallFormat

__all__ = ["CallGrammar", "call_grammar"]

ID_CHARS = r"[a-zA-Z0-9_\-]"
"""A character of a call id, in GBNF and in a regular expression alike."""
PRIMITIVES = {
    "ws": r"[ \t\n]{0,20}",
    "char": r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})',
    "string": r'"\"" char* "\""',
    "number": r'"-"? ([0-9] | [1-9] [0-9]{0,15}) ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,4})?',
    "integer": r'"-"? ([0-9] | [1-9] [0-9]{0,15})',
    "boolean": r'"true" | "false"',
    "null": r'"null"',
    "value": "object | array | string | number | boolean | null",
    "object": r'"{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? ws "}"',
    "array": r'"[" ws ( value ( "," ws value )* )? ws "]"',
    # What a model writes for a call's id or index (Mistral's nine characters, Kimi's `0`).
    "call-id": ID_CHARS + "{1,40}",
}
TYPES = {"string", "number", "integer", "boolean", "null", "object", "array"}


def literal(text: str) -> str:
    """`text` as a GBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


def _delimiter(text: str) -> str:
    """A delimiter as the template writes it, a call id where it has one."""
    parts = [literal(p) for p in text.split(CALL_ID)]
    return " call-id ".join(parts) if len(parts) > 1 else (parts[0] if text else "")


def _excluding(end: str) -> str:
    """Any text that does not contain `end` (a parameter's value written as text)."""
    options = [f"[^{_char_class(end[0])}]"]
    options += [f"{literal(end[:i])} [^{_char_class(end[i])}]" for i in range(1, len(end))]
    return "( " + " | ".join(options) + " )*"


# What a regular expression reads otherwise than as itself, in Python's and in the ECMAScript
# dialect of llama-server's `std::regex` alike.
_REGEX_SPECIAL = re.compile(r"[\\^$.|?*+()\[\]{}]")


def _regex(text: str) -> str:
    """A delimiter as a regular expression that matches it as the template writes it, a call id
    where it has one."""
    escaped = _REGEX_SPECIAL.sub(r"\\\g<0>", text)
    for char, escape in (("\n", r"\n"), ("\t", r"\t"), ("\r", r"\r")):
        escaped = escaped.replace(char, escape)
    return escaped.replace(CALL_ID, ID_CHARS + "{1,40}")


def _char_class(char: str) -> str:
    return "\\" + char if char in "]\\^-" else char.replace("\n", "\\n").replace("\t", "\\t")


@dataclass(frozen=True)
class CallGrammar:
    gbnf: str
    trigger: str
    """A regular expression over the generated text whose match starts the grammar: a call's
    opening whole, then the name of an offered tool. Only a call matches it: the first word of
    an opening alone is often not a call's (muse-glimmer's `to=` opens its reasoning and its
    answer as well, Kimi-K3's `<|close|>` ends its reasoning)."""
    word: str = ""
    """Where the opening's first special token is a call's alone (Qwen's `<tool_call>`), that
    token instead: llama-server watches for it as a token, where it matches a pattern against
    all the text generated so far at every token (about 0.4 ms a token once an answer runs to
    10,000 characters), and from it the grammar keeps the model to the opening whole."""
    preserved: tuple[str, ...] = ()
    """Special tokens the grammar names, which the server must keep as text."""

    def request_fields(self) -> dict[str, Any]:
        """What a `/completion` request carries for it (llama-server's own field names)."""
        # The type of a trigger: 1, a word; 2, a pattern.
        trigger = (
            {"type": 1, "value": self.word} if self.word else {"type": 2, "value": self.trigger}
        )
        return {"grammar": self.gbnf, "grammar_lazy": True, "grammar_triggers": [trigger]}

    @property
    def watched(self) -> str:
        """What llama-server watches for, as a regular expression."""
        return _regex(self.word) if self.word else self.trigger


class _Rules:
    def __init__(self) -> None:
        self.rules: dict[str, str] = dict(PRIMITIVES)

    def add(self, name: str, body: str) -> str:
        name = re.sub(r"[^a-zA-Z0-9-]+", "-", name)
        self.rules[name] = body
        return name

    def schema(self, schema: Any, name: str) -> str:  # noqa: PLR0911 - one per kind
        """The rule for a value of `schema`."""
        if not isinstance(schema, Mapping) or not schema:
            return "value"
        if "const" in schema:
            return self.add(name, literal(json.dumps(schema["const"])))
        if "enum" in schema:
            return self.add(name, " | ".join(literal(json.dumps(v)) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                parts = [self.schema(s, f"{name}-{i}") for i, s in enumerate(schema[key])]
                return self.add(name, " | ".join(parts))
        kind = schema.get("type")
        if isinstance(kind, list):
            parts = [self.schema({**schema, "type": k}, f"{name}-{k}") for k in kind]
            return self.add(name, " | ".join(parts))
        if kind == "object" and schema.get("properties"):
            return self.add(name, self._object(schema, name))
        if kind == "array" and "items" in schema:
            item = self.schema(schema["items"], f"{name}-item")
            return self.add(name, f'"[" ws ( {item} ( "," ws {item} )* )? ws "]"')
        return kind if kind in TYPES else "value"

    def _object(self, schema: Mapping[str, Any], name: str) -> str:
        properties: Mapping[str, Any] = schema["properties"]
        required = [k for k in properties if k in schema.get("required", ())]
        optional = [k for k in properties if k not in required]
        pairs = {
            k: f'{literal(json.dumps(k))} ws ":" ws {self.schema(v, f"{name}-{k}")}'
            for k, v in properties.items()
        }
        body = ' "," ws '.join(pairs[k] for k in required)
        for k in optional:
            body += f' ( "," ws {pairs[k]} )?' if body else f" ( {pairs[k]} )?"
        return f'"{{" ws {body} ws "}}"'

    def text(self) -> str:
        return "\n".join(f"{name} ::= {body}" for name, body in self.rules.items()) + "\n"


def _may_be_text(schema: Any) -> bool:
    if not isinstance(schema, Mapping):
        return False
    kind = schema.get("type")
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _tools(tools: Iterable[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    found = []
    for tool in tools:
        function = tool.get("function", tool)
        found.append((function["name"], function.get("parameters") or {}))
    return found


def call_grammar(fmt: ChatFormat, tools: Iterable[Mapping[str, Any]]) -> CallGrammar | None:
    """The grammar of a call of one of `tools` in the format's syntax; None where loopd makes
    none (no calls, harmony, Gemma's notation, Python)."""
    call, offered = fmt.tool_call, _tools(tools)
    if call is None or fmt.harmony or call.notation != "json" or not offered:
        return None
    rules = _Rules()
    names = []
    for name, params in offered:
        args = (
            _params(rules, call, name, params)
            if call.params
            else _json_args(rules, call, name, params)
        )
        names.append(rules.add(f"tool-{name}", f"{literal(name)} {args}"))
    rules.add("tool", " | ".join(names))
    opening, close = _delimiter(call.open.lstrip()), _delimiter(call.close)
    one = f"{opening} tool {close}".strip()
    if call.block_close:
        again = _delimiter(call.again) if call.again else opening
        root = f"{one} ( {again} tool {close} )* {_delimiter(call.block_close)}"
    else:
        root = f"{one} ( ws {one} )*"
    rules.add("root", root)
    # The grammar applies from where the match starts, the opening, which the match is whole.
    trigger = _regex(call.open.lstrip()) + "(?:" + "|".join(_regex(n) for n, _ in offered) + ")"
    delimiters = [call.open, call.close, call.block_close, call.again, call.mid]
    if call.params:
        delimiters += [call.params.key_open, call.params.key_end, call.params.value_end]
    specials = (m for d in delimiters for m in SPECIAL.findall(d))
    preserved = tuple(dict.fromkeys(specials))
    return CallGrammar(rules.text(), trigger, _call_token(fmt, call), preserved)


def _call_token(fmt: ChatFormat, call: ToolCallFormat) -> str:
    """The special token the opening starts with, where it is named for calls (`tool`,
    `function`) and the format writes it nowhere else (in its generation prompt, reasoning
    tags or content prefixes): that token opens a call. A token of another name may end any
    message too (GigaChat 3's `<|message_sep|>`), which a format learned from renderings does
    not show."""
    first = SPECIAL.match(call.open.lstrip())
    if first is None or not any(w in first.group(0).lower() for w in ("tool", "function")):
        return ""
    elsewhere = [fmt.generation_prompt, *(fmt.think or ()), *fmt.content_prefixes]
    return "" if any(first.group(0) in text for text in elsewhere) else first.group(0)


def _json_args(rules: _Rules, call: ToolCallFormat, name: str, params: Mapping[str, Any]) -> str:
    schema = params if params.get("properties") else {"type": "object"}
    return f"{_delimiter(call.mid)} {rules.schema(schema, f'args-{name}')}".strip()


def _params(rules: _Rules, call: ToolCallFormat, name: str, params: Mapping[str, Any]) -> str:
    """Arguments one by one: each key, then its value as text where the schema allows a
    string, else as JSON of its schema."""
    p = call.params
    assert p is not None  # noqa: S101 - only called for such formats
    properties: Mapping[str, Any] = params.get("properties") or {}
    mid = _delimiter(call.mid)
    if not properties:
        return mid
    pairs = []
    for key, schema in properties.items():
        end = p.value_end.replace(PARAM_KEY, key)
        value = (
            rules.add(f"text-{name}-{key}", _excluding(end))
            if _may_be_text(schema)
            else rules.schema(schema, f"json-{name}-{key}")
        )
        pairs.append(f"{literal(key)} {_delimiter(p.key_end)} {value} {_delimiter(end)}")
    required = [i for i, k in enumerate(properties) if k in params.get("required", ())]
    key_open = _delimiter(p.key_open)
    body = " ".join(f"{key_open} {pairs[i]}" for i in required)
    for i in range(len(pairs)):
        if i not in required:
            body += f" ( {key_open} {pairs[i]} )?"
    return f"{mid} {body}".strip()
