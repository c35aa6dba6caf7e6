"""The grammar of a call in a template's own syntax, its arguments by the tools' schemas."""

from __future__ import annotations

import json

import pytest

from loopd.infer import PromptRequest
from loopd.infer._format import ChatFormat, ToolCallFormat
from loopd.infer._grammar import _Rules, call_grammar
from loopd.session.baseline import TOOLS
from support.formats import QWEN, QWEN_CODER


def test_a_json_call_is_the_templates_opening_a_tool_and_its_schema() -> None:
    grammar = call_grammar(QWEN, TOOLS)
    assert grammar is not None
    rules = dict(line.split(" ::= ", 1) for line in grammar.gbnf.splitlines())
    assert rules["root"].startswith(json.dumps('<tool_call>\n{"name": "'))
    assert rules["tool-find-tool"] == '"find_tool" "\\", \\"arguments\\": " args-find-tool'
    assert rules["args-find-tool"] == '"{" ws "\\"query\\"" ws ":" ws string ws "}"'
    assert grammar.trigger == "<tool_call>"
    assert "<tool_call>" in grammar.preserved


def test_parameters_are_text_where_a_string_is_allowed_else_json() -> None:
    grammar = call_grammar(QWEN_CODER, TOOLS)
    assert grammar is not None
    rules = dict(line.split(" ::= ", 1) for line in grammar.gbnf.splitlines())
    assert "text-find-tool-query" in rules["tool-find-tool"]
    assert rules["tool-call-tool"].endswith('"arguments" ">\\n" object "\\n</parameter"')
    assert rules["text-find-tool-query"].startswith('( [^\\n] | "\\n" [^<] | ')


@pytest.mark.parametrize(
    ("schema", "body"),
    [
        ({"type": "integer"}, '"-"? ([0-9] | [1-9] [0-9]{0,15})'),
        ({"enum": ["a", 1]}, '"\\"a\\"" | "1"'),
        ({"type": ["string", "null"]}, "string | null"),
        ({"anyOf": [{"type": "number"}, {"type": "boolean"}]}, "number | boolean"),
        (
            {"type": "array", "items": {"type": "string"}},
            '"[" ws ( string ( "," ws string )* )? ws "]"',
        ),
        (
            {"type": "object", "properties": {"a": {"type": "null"}, "b": {}}, "required": ["b"]},
            '"{" ws "\\"b\\"" ws ":" ws value ( "," ws "\\"a\\"" ws ":" ws null )? ws "}"',
        ),
    ],
)
def test_a_schema_becomes_rules(schema: dict[str, object], body: str) -> None:
    rules = _Rules()
    name = rules.schema(schema, "x")
    assert rules.rules.get(name, name) == body


def test_formats_loopd_makes_no_grammar_for() -> None:
    assert call_grammar(ChatFormat("", None, False, (), None), TOOLS) is None
    gemma = ToolCallFormat(open="<|tool_call>call:", mid="", close="<tool_call|>", notation="gemma")
    assert call_grammar(ChatFormat("", None, False, (), gemma), TOOLS) is None
    assert call_grammar(QWEN, ()) is None


def test_a_token_exact_request_carries_the_lazy_grammar_of_its_tools() -> None:
    body = json.loads(PromptRequest(prompt=["Hi"], format=QWEN, tools=TOOLS).body())
    assert body["grammar_lazy"] is True
    assert body["grammar_triggers"] == [{"type": 1, "value": "<tool_call>"}]
    assert "tool-call-tool" in body["grammar"]
    assert "<tool_call>" in body["preserved_tokens"]


def test_a_grammar_of_its_own_replaces_the_calls_grammar() -> None:
    body = json.loads(
        PromptRequest(prompt=["Hi"], format=QWEN, tools=TOOLS, grammar="root ::= [a-z]").body()
    )
    assert body["grammar"] == "root ::= [a-z]"
    assert "grammar_lazy" not in body
