"""The grammar of a call in a template's own syntax, its arguments by the tools' schemas."""

from __future__ import annotations

import json
import re

import pytest

from loopd.infer import PromptRequest
from loopd.infer._format import ChatFormat, ToolCallFormat
from loopd.infer._gbnf import Rules
from loopd.infer._grammar import call_grammar
from loopd.session.baseline import TOOLS
from support.formats import KIMI_K3, MUSE_GLIMMER, QWEN, QWEN_CODER


def test_a_json_call_is_the_templates_opening_a_tool_and_its_schema() -> None:
    grammar = call_grammar(QWEN, TOOLS)
    assert grammar is not None
    rules = dict(line.split(" ::= ", 1) for line in grammar.gbnf.splitlines())
    assert rules["root"].startswith(json.dumps('<tool_call>\n{"name": "'))
    assert rules["tool-find-tool"] == '"find_tool" "\\", \\"arguments\\": " args-find-tool'
    assert rules["args-find-tool"] == '"{" ws "\\"query\\"" ws ":" ws string ws "}"'
    assert grammar.trigger == '<tool_call>\\n\\{"name": "(?:find_tool|call_tool)'
    assert grammar.word == "<tool_call>"  # a token Qwen writes for a call alone
    assert "<tool_call>" in grammar.preserved


def test_parameters_are_text_where_a_string_is_allowed_else_json() -> None:
    grammar = call_grammar(QWEN_CODER, TOOLS)
    assert grammar is not None
    rules = dict(line.split(" ::= ", 1) for line in grammar.gbnf.splitlines())
    assert "text-find-tool-query" in rules["tool-find-tool"]
    assert rules["tool-call-tool"].endswith('"arguments" ">\\n" object "\\n</parameter"')
    assert rules["text-find-tool-query"].startswith('( [^\\n] | "\\n" [^<] | ')


# What a model writes after the generation prompt, as the template renders it: a reasoning
# block that ends, an answer to the user, a call. muse-glimmer writes each as a message to a
# recipient (`to=self`, `to=user`, `to=TOOL`); Kimi-K3 ends its reasoning with a `<|close|>`,
# as it opens its calls.
ANSWERS = {
    "muse-glimmer": (
        MUSE_GLIMMER,
        " to=self<|message|>A greeting.<|eom|><|start|>assistant to=user<|message|>Hello!<|eot|>",
        (
            " to=self<|message|>Notes: a tool.<|eom|><|start|>assistant to=find_tool<|message|>"
            '<atem:function_calls>\n<atem:invoke name="find_tool">\n'
            '<atem:parameter name="query">notes</atem:parameter>\n</atem:invoke>\n'
            "</atem:function_calls><|eot|>"
        ),
    ),
    "Kimi-K3": (
        KIMI_K3,
        (
            "A greeting.<|close|>think<|sep|><|open|>response<|sep|>Hello!<|close|>response<|sep|>"
            "<|close|>message<|sep|><|end_of_msg|>"
        ),
        (
            "Notes: a tool.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>"
            '<|open|>tools<|sep|><|open|>call tool="find_tool" index="1"<|sep|>'
            '<|open|>argument key="query" type="string"<|sep|>notes<|close|>argument<|sep|>'
            "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        ),
    ),
}


@pytest.mark.parametrize(("fmt", "answer", "call"), ANSWERS.values(), ids=ANSWERS.keys())
def test_the_trigger_fires_on_a_call_and_on_nothing_else(
    fmt: ChatFormat, answer: str, call: str
) -> None:
    grammar = call_grammar(fmt, TOOLS)
    assert grammar is not None
    assert fmt.tool_call is not None
    assert not grammar.word  # the first token of the opening is not a call's alone
    trigger = re.compile(grammar.watched)
    assert trigger.search(answer) is None
    found = trigger.search(call)
    assert found is not None
    # The grammar applies from there: the call's opening, as the grammar starts.
    assert call[found.start() :].startswith(fmt.tool_call.open.lstrip() + "find_tool")


def test_the_trigger_reads_a_delimiter_as_itself() -> None:
    """Characters a regular expression reads otherwise are escaped, a call id is any id."""
    call = ToolCallFormat(
        open='[TOOL_CALLS]{"id": "\x00id\x00", "name": "', mid='", "args": ', close="}"
    )
    grammar = call_grammar(ChatFormat("", None, False, (), call), TOOLS)
    assert grammar is not None
    trigger = re.compile(grammar.trigger)
    assert trigger.match('[TOOL_CALLS]{"id": "a1B2c3D4e", "name": "call_tool"')
    assert not trigger.match('T{"id": "a1B2c3D4e", "name": "call_tool"')
    assert not trigger.match('[TOOL_CALLS]{"id": "a b", "name": "call_tool"')


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
    rules = Rules()
    name = rules.schema(schema, "x")
    assert rules.rules.get(name, name) == body


def test_no_grammar_without_calls_or_tools() -> None:
    assert call_grammar(ChatFormat("", None, False, (), None), TOOLS) is None
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
