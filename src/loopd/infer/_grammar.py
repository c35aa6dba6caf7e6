"""A tool call in the template's own syntax as a GBNF grammar, its arguments constrained by the
tools' JSON schemas (`_gbnf`): what llama-server's chat endpoint sends with a request that offers
tools (a lazy grammar, applied from where a call opens), made for loopd's token-exact requests.

Arguments are written in the template's notation: JSON, Gemma 4's own, or Python's keyword
arguments (LFM2); gpt-oss's harmony calls are a message to `functions.NAME` whose body is JSON.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ._format import CALL_ID, PARAM_KEY, SPECIAL, ChatFormat, ToolCallFormat
from ._gbnf import ID_CHARS, JSON, SYNTAX, Rules, excluding, literal
from ._notation import GEMMA_QUOTE
from ._schema import value_types

__all__ = ["CallGrammar", "call_grammar", "structural_tag"]


def _delimiter(text: str) -> str:
    """A delimiter as the template writes it, a call id where it has one."""
    parts = [literal(p) for p in text.split(CALL_ID)]
    return " call-id ".join(parts) if len(parts) > 1 else (parts[0] if text else "")


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


@dataclass(frozen=True)
class CallGrammar:
    gbnf: str
    trigger: str
    """A regular expression over the generated text whose match starts the grammar: a call's
    opening whole (harmony's: a message's recipient, `to=functions.`), then the name of an
    offered tool. Only a call matches it: the first word of
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


def _param_value(rules: Rules, name: str, schema: Any, defs: Mapping[str, Any], end: str) -> str:
    """A parameter written as text, as the parser types it (`_schema`): any text up to its
    end where the schema allows a string (only the strings it lists, where it lists only
    strings: an enum), else JSON of its schema."""
    if "string" not in value_types(schema, defs):
        return rules.schema(schema, f"json-{name}")
    listed = [schema["const"]] if "const" in schema else schema.get("enum") or []
    if listed and all(isinstance(v, str) for v in listed):
        return "( " + " | ".join(literal(v) for v in listed) + " )"
    return rules.add(f"text-{name}", excluding(end))


def _tools(tools: Iterable[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    found = []
    for tool in tools:
        function = tool.get("function", tool)
        found.append((function["name"], function.get("parameters") or {}))
    return found


def call_grammar(fmt: ChatFormat, tools: Iterable[Mapping[str, Any]]) -> CallGrammar | None:
    """The grammar of a call of one of `tools` in the format's syntax; None where the format
    has no calls or no tool is offered."""
    call, offered = fmt.tool_call, _tools(tools)
    if call is None or not offered:
        return None
    if fmt.harmony:
        return _harmony(offered)
    rules = Rules(SYNTAX[call.notation])
    names = []
    for name, params in offered:
        args = (
            _params(rules, call, name, params)
            if call.params
            else f"{_delimiter(call.mid)} {rules.arguments(params, f'args-{name}')}".strip()
        )
        names.append(rules.add(f"tool-{name}", f"{literal(name)} {args}"))
    rules.add("tool", " | ".join(names))
    opening, close = _delimiter(call.open.lstrip()), _delimiter(call.close)
    one = _sequence(opening, "tool", close)
    # The grammar applies from where the trigger's match starts: the opening, which the match
    # is whole; where the generation prompt wrote the first call's opening (Functionary v3.2's
    # `>>>`), also the name of a call at the start of the answer.
    trigger = _regex(call.open.lstrip())
    first = one
    if fmt.prompt_opens_call:
        trigger, first = f"(?:^|{trigger})", _sequence(f"( {opening} )?", "tool", close)
    trigger += _names(offered)
    if call.block_close or call.again:
        # A block's next call opens otherwise than its first (muse-glimmer's next message,
        # Kimi-K3's next `<|open|>call`), and the block may have a close of its own.
        again = _delimiter(call.again) if call.again else opening
        if call.notation == "python":  # LFM2 writes `, ` between the calls of its list
            again += " ws"
        more = _sequence(again, "tool", close)
        root = _sequence(first, f"( {more} )*", _delimiter(call.block_close))
    else:
        root = f"{first} ( ws {one} )*"
    rules.add("root", root)
    delimiters = [call.open, call.close, call.block_close, call.again, call.mid]
    if call.params:
        delimiters += [call.params.key_open, call.params.key_end, call.params.value_end]
    if call.notation == "gemma":
        delimiters.append(GEMMA_QUOTE)
    return CallGrammar(rules.text(), trigger, _call_token(fmt, call), _specials(delimiters))


def structural_tag(fmt: ChatFormat, tools: Iterable[Mapping[str, Any]]) -> str | None:
    """The same lazy constraint for vLLM, in xgrammar's terms (`structured_outputs.structural_tag`,
    a JSON string): once the model writes a call's opening, the rest of a call of an offered
    tool, its arguments by the tool's schema. Only for a call that is one JSON object between
    fixed texts; None for the others (parameters one by one, Gemma's or Python's notation,
    harmony's messages, blocks of calls), which vLLM then leaves unconstrained."""
    call, offered = fmt.tool_call, _tools(tools)
    if call is None or not offered or fmt.messages:
        return None
    if call.params is not None or call.notation != "json" or call.block_close or call.again:
        return None
    tags = [
        {
            "begin": call.open + name + call.mid,
            "content": {"type": "json_schema", "json_schema": dict(params) or {"type": "object"}},
            "end": call.close,
        }
        for name, params in offered
    ]
    triggered = {"type": "triggered_tags", "triggers": [call.open], "tags": tags}
    return json.dumps({"type": "structural_tag", "format": triggered})


def _sequence(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _names(offered: list[tuple[str, Mapping[str, Any]]]) -> str:
    return "(?:" + "|".join(_regex(n) for n, _ in offered) + ")"


def _specials(delimiters: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(m for d in delimiters for m in SPECIAL.findall(d)))


# A harmony call's header after the tool's name: gpt-oss's template writes
# `<|channel|>commentary json<|message|>`, llm-jp's `<|channel|>commentary <|constrain|> json`;
# gpt-oss names the channel first (`<|channel|>commentary to=functions.NAME
# <|constrain|>json<|message|>`). The parser reads any header with that recipient (`_messages`).
HARMONY_RECIPIENT = "to=functions."
HARMONY_HEADER = '"<|channel|>commentary"? ( " " ( "<|constrain|>" " "? )? "json" )? "<|message|>"'


def _harmony(offered: list[tuple[str, Mapping[str, Any]]]) -> CallGrammar:
    """A message to one of the tools, its body JSON arguments. Its recipient alone starts it:
    harmony writes reasoning and answers as messages too, on other channels, to no one."""
    rules = Rules(JSON)
    names = [
        rules.add(
            f"tool-{name}",
            f"{literal(name)} {HARMONY_HEADER} {rules.arguments(params, f'args-{name}')}",
        )
        for name, params in offered
    ]
    rules.add("tool", " | ".join(names))
    rules.add("root", f"{literal(HARMONY_RECIPIENT)} tool")
    trigger = _regex(HARMONY_RECIPIENT) + _names(offered)
    preserved = _specials([HARMONY_HEADER])
    return CallGrammar(rules.text(), trigger, preserved=preserved)


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


def _params(rules: Rules, call: ToolCallFormat, name: str, params: Mapping[str, Any]) -> str:
    """Arguments one by one: each key, then its value as text where the schema allows a
    string, else as JSON of its schema."""
    p = call.params
    assert p is not None  # noqa: S101 - only called for such formats
    properties: Mapping[str, Any] = params.get("properties") or {}
    mid = _delimiter(call.mid)
    if not properties:
        return mid
    defs = {**params.get("definitions", {}), **params.get("$defs", {})}
    pairs = []
    for key, schema in properties.items():
        end = p.value_end.replace(PARAM_KEY, key)
        value = _param_value(rules, f"{name}-{key}", schema, defs, end)
        pairs.append(f"{literal(key)} {_delimiter(p.key_end)} {value} {_delimiter(end)}")
    required = [i for i, k in enumerate(properties) if k in params.get("required", ())]
    key_open = _delimiter(p.key_open)
    body = " ".join(f"{key_open} {pairs[i]}" for i in required)
    for i in range(len(pairs)):
        if i not in required:
            body += f" ( {key_open} {pairs[i]} )?"
    return f"{mid} {body}".strip()
