"""The grammar of a call in a template's own syntax, its arguments by the tools' schemas."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopd.infer import PromptRequest
from loopd.infer._format import ChatFormat, ToolCallFormat
from loopd.infer._gbnf import Rules
from loopd.infer._grammar import call_grammar
from loopd.infer._parse import Piece
from loopd.infer._raw import parser_for
from loopd.infer._schema import ArgumentTypes
from loopd.session.baseline import TOOLS
from support.formats import (
    FUNCTIONARY_V32,
    GEMMA_4,
    GPT_OSS,
    KIMI_K3,
    LFM2,
    MUSE_GLIMMER,
    QWEN,
    QWEN_CODER,
    merged,
)
from support.gbnf import Sampler, prefix_allowed


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


# A tool whose parameters take every kind of value a schema names.
EDIT = {
    "type": "function",
    "function": {
        "name": "edit",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "count": {"type": "integer"},
                "scale": {"type": "number"},
                "all": {"type": "boolean"},
                "mode": {"enum": ["fast", "safe"]},
                "tags": {"type": "array", "items": {"type": "string"}},
                "at": {
                    "type": "object",
                    "properties": {
                        "line": {"type": "integer"},
                        "note": {"type": ["string", "null"]},
                    },
                    "required": ["line"],
                },
                "extra": {"anyOf": [{"type": "number"}, {"type": "boolean"}]},
                "nothing": {"type": "null"},
            },
            "required": ["path", "count"],
        },
    },
}
OPTIONAL = {  # no property required: a comma only between those written
    "type": "function",
    "function": {
        "name": "look",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {}},
        },
    },
}
ALL_TOOLS = [*TOOLS, EDIT, OPTIONAL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in ALL_TOOLS}
NOTATIONS = {
    "Gemma 4": GEMMA_4,
    "LFM2": LFM2,
    "gpt-oss": GPT_OSS,
    "Qwen": QWEN,
    "Functionary v3.2": FUNCTIONARY_V32,
    "muse-glimmer": MUSE_GLIMMER,
    "Kimi-K3": KIMI_K3,
}


def _read(fmt: ChatFormat, text: str) -> list[Piece]:
    """The text as loopd's parser reads it, streamed a few characters at a time."""
    parser = parser_for(fmt, ArgumentTypes(ALL_TOOLS))
    pieces = [p for at in range(0, len(text), 3) for p in parser.feed(text[at : at + 3])]
    return merged(pieces + parser.finish())


@pytest.mark.parametrize("fmt", NOTATIONS.values(), ids=NOTATIONS.keys())
@given(rng=st.randoms(use_true_random=False))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_what_the_grammar_allows_reads_as_calls_by_the_tools_schemas(
    fmt: ChatFormat, rng: random.Random
) -> None:
    """The grammar writes only what loopd reads: any text it allows, from where its trigger
    matches, is one call or more, each with arguments its tool's schema accepts."""
    grammar = call_grammar(fmt, ALL_TOOLS)
    assert grammar is not None
    text = Sampler(grammar.gbnf, rng).text()
    assert re.match(grammar.watched, text), text
    assert prefix_allowed(grammar.gbnf, text) == text  # the recognizer reads it as drawn
    pieces = _read(fmt, text)
    assert pieces, text
    assert all(p.kind == "call" for p in pieces), (text, pieces)
    for piece in pieces:
        jsonschema.validate(json.loads(piece.text), SCHEMAS[piece.name])


# What a model writes after the generation prompt, as the template renders it: a reasoning
# block that ends and an answer to the user, a call; the call from its opening to its end.
NOTATION_ANSWERS = {
    "Gemma 4": (
        GEMMA_4,
        "<|channel>thought\nA greeting.<channel|>Hello!<turn|>",
        "<|channel>thought\nNotes.<channel|>",
        '<|tool_call>call:edit{count:2,path:<|"|>a.md<|"|>,tags:[<|"|>x<|"|>]}<tool_call|>',
    ),
    "LFM2": (
        LFM2,
        "<think>A greeting.</think>Hello!<|im_end|>",
        "<think>Notes.</think>",
        (
            "<|tool_call_start|>[edit(path='a.md', count=2, tags=['x']), find_tool(query='a')]"
            "<|tool_call_end|>"
        ),
    ),
    "gpt-oss": (
        GPT_OSS,
        (
            "<|channel|>analysis<|message|>A greeting.<|end|><|start|>assistant<|channel|>final"
            "<|message|>Hello!<|return|>"
        ),
        "<|channel|>analysis<|message|>Notes.<|end|><|start|>assistant ",
        'to=functions.edit<|channel|>commentary json<|message|>{"path": "a.md", "count": 2}',
    ),
    "llm-jp, harmony's header spaced": (
        GPT_OSS,
        "<|channel|>final<|message|>Hello!<|return|>",
        "<|channel|>analysis<|message|>Notes.<|end|><|start|>assistant ",
        (
            "to=functions.edit<|channel|>commentary <|constrain|> json<|message|>"
            '{"path": "a.md", "count": 2}'
        ),
    ),
    # The generation prompt wrote the first call's opening (`>>>`): the grammar applies from
    # the start of the answer, where the call's name is; a later call has its opening.
    "Functionary v3.2, the first call": (
        FUNCTIONARY_V32,
        "all\nHello!<|eot_id|>",
        "",
        'find_tool\n{"query": "weather"}',
    ),
    "Functionary v3.2, a call after content": (
        FUNCTIONARY_V32,
        "all\nHello! find_tool was not needed.<|eot_id|>",
        "all\nLet me look.",
        '>>>edit\n{"path": "a.md", "count": 2}',
    ),
    "gpt-oss, the channel first": (
        GPT_OSS,
        "<|channel|>final<|message|>Hello!<|return|>",
        "<|channel|>commentary ",
        'to=functions.edit <|constrain|>json<|message|>{"path":"a.md","count":2}',
    ),
}


@pytest.mark.parametrize(
    ("fmt", "answer", "before", "call"), NOTATION_ANSWERS.values(), ids=NOTATION_ANSWERS.keys()
)
def test_a_notations_trigger_fires_on_its_call_which_the_grammar_allows(
    fmt: ChatFormat, answer: str, before: str, call: str
) -> None:
    grammar = call_grammar(fmt, ALL_TOOLS)
    assert grammar is not None
    trigger = re.compile(grammar.watched)
    assert trigger.search(answer) is None
    assert trigger.search(before + call[:4]) is None
    found = trigger.search(before + call)
    assert found is not None
    assert found.start() == len(before)  # the grammar applies from the call's opening
    assert prefix_allowed(grammar.gbnf, call) == call
    assert [p.kind for p in _read(fmt, before + call)][-1] == "call"


def test_gemmas_grammar_writes_its_notation() -> None:
    grammar = call_grammar(GEMMA_4, ALL_TOOLS)
    assert grammar is not None
    rules = dict(line.split(" ::= ", 1) for line in grammar.gbnf.splitlines())
    assert (
        rules["root"]
        == '"<|tool_call>call:" tool "<tool_call|>" ( ws "<|tool_call>call:" tool "<tool_call|>" )*'
    )
    assert rules["args-find-tool"] == '"{" "query:" string "}"'
    assert rules["string"] == r'"<|\"|>" text "<|\"|>"'
    assert rules["args-edit-mode"] == r'"<|\"|>fast<|\"|>" | "<|\"|>safe<|\"|>"'
    assert grammar.word == "<|tool_call>"
    assert '<|"|>' in grammar.preserved


def test_pythons_grammar_writes_keyword_arguments() -> None:
    named = {"type": "object", "properties": {"a-b": {"type": "string"}, "ok": {}}}
    tool = {"name": "f", "parameters": named}
    grammar = call_grammar(LFM2, [*ALL_TOOLS, tool])
    assert grammar is not None
    rules = dict(line.split(" ::= ", 1) for line in grammar.gbnf.splitlines())
    assert rules["root"] == ('"<|tool_call_start|>[" tool ( "," ws tool )* "]<|tool_call_end|>"')
    assert rules["args-find-tool"] == '"(" "query=" string ")"'
    assert rules["boolean"] == '"True" | "False"'
    # A property whose name is no identifier cannot be passed by keyword (llama.cpp reads no
    # other): the grammar leaves it out.
    assert rules["args-f"] == '"(" ( "ok=" value )? ")"'
    assert grammar.word == "<|tool_call_start|>"


def test_harmonys_grammar_is_a_message_to_a_tool() -> None:
    grammar = call_grammar(GPT_OSS, ALL_TOOLS)
    assert grammar is not None
    rules = dict(line.split(" ::= ", 1) for line in grammar.gbnf.splitlines())
    assert rules["root"] == '"to=functions." tool'
    assert rules["tool-find-tool"].startswith('"find_tool" "<|channel|>commentary"? ')
    assert rules["tool-find-tool"].endswith('"<|message|>" args-find-tool')
    assert grammar.trigger == r"to=functions\.(?:find_tool|call_tool|edit|look)"
    assert not grammar.word
    assert "<|constrain|>" in grammar.preserved


def test_optional_properties_take_a_comma_only_between_them() -> None:
    grammar = call_grammar(QWEN, [OPTIONAL])
    assert grammar is not None
    for args in ('{"b": "x"}', '{"a": 1, "c": null}', "{}", '{"c": []}'):
        call = f'<tool_call>\n{{"name": "look", "arguments": {args}}}\n</tool_call>'
        assert prefix_allowed(grammar.gbnf, call) == call
    assert (
        prefix_allowed(grammar.gbnf, '<tool_call>\n{"name": "look", "arguments": {, "b": "x"}')
        is None
    )


def test_a_block_s_next_call_opens_as_the_template_opens_it() -> None:
    """muse-glimmer's next call is the next message (`<|eom|><|start|>assistant to=`), Kimi-K3's
    the next `<|open|>call`: the grammar allows a second call written so, which used to end
    the grammar's reach after one."""
    for fmt, second in (
        (
            MUSE_GLIMMER,
            (
                "<|eom|><|start|>assistant to=look<|message|><atem:function_calls>\n"
                '<atem:invoke name="look">\n</atem:invoke>\n</atem:function_calls>'
            ),
        ),
        (KIMI_K3, '<|open|>call tool="look" index="1"<|sep|><|close|>call<|sep|>'),
    ):
        assert fmt.tool_call is not None
        grammar = call_grammar(fmt, ALL_TOOLS)
        assert grammar is not None
        first = Sampler(grammar.gbnf, random.Random(0)).text()
        calls = first + second
        assert prefix_allowed(grammar.gbnf, calls) == calls, calls
        assert [p.kind for p in _read(fmt, calls)].count("call") >= 2


def test_a_parameter_of_listed_strings_is_written_as_one_of_them() -> None:
    """An enum of strings written one by one is text, as the parser reads it (its value with
    quotes around it was the string with the quotes, not one the schema lists)."""
    grammar = call_grammar(QWEN_CODER, ALL_TOOLS)
    assert grammar is not None
    rules = dict(line.split(" ::= ", 1) for line in grammar.gbnf.splitlines())
    assert '"mode" ">\\n" ( "fast" | "safe" ) "\\n</parameter"' in rules["tool-edit"], rules[
        "tool-edit"
    ]
