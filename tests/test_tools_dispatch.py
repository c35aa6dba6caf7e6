"""dispatch: find_tool answered here, call_tool checked before anything goes to the port."""

from __future__ import annotations

import json

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from loopd.config import Policy
from loopd.tools import (
    MAX_ARGUMENT_BYTES,
    Answered,
    CallOrigin,
    Local,
    ModelAnswer,
    OnAsking,
    OnDecided,
    Port,
    Registry,
    Result,
    Runner,
    ToolEntry,
    ToolRequest,
    answer_call,
    call_key,
    dispatch,
)
from support.ports import never_asked

SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string"}, "start_line": {"type": "integer", "minimum": 1}},
    "required": ["path"],
    "additionalProperties": False,
}
REGISTRY = Registry(
    [ToolEntry("read_file", "Read a text file.", "Read a text file.", SCHEMA, "builtin", Policy())]
)


def local_text(name: str, arguments: str) -> str:
    outcome = dispatch(REGISTRY, name, arguments)
    assert isinstance(outcome, Local)
    return outcome.text


def test_find_tool_is_answered_locally_with_matches() -> None:
    assert local_text("find_tool", '{"query": "read a file"}').startswith(
        "Tools for 'read a file', best first:\n1. read_file"
    )


def test_find_tool_without_a_query_says_what_it_needs() -> None:
    assert local_text("find_tool", "{}") == 'find_tool needs {"query": "<what you want to do>"}.'


def test_call_tool_with_good_arguments_goes_to_the_port() -> None:
    outcome = dispatch(
        REGISTRY, "call_tool", '{"name": "read_file", "arguments": {"path": "a.txt"}}'
    )
    assert outcome == Port("read_file", {"path": "a.txt"})


def test_arguments_given_as_a_json_string_are_accepted() -> None:
    outcome = dispatch(
        REGISTRY, "call_tool", '{"name": "read_file", "arguments": "{\\"path\\": \\"a\\"}"}'
    )
    assert outcome == Port("read_file", {"path": "a"})


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("call_tool", '{"name": "read_file", "arguments": {"path": "a', "are not valid JSON"),
        ("find_tool", "[1, 2]", "must be a JSON object, not list"),
        ("call_tool", '{"arguments": {}}', 'call_tool needs "name"'),
        ("call_tool", '{"name": "read_file", "arguments": [1]}', 'needs "arguments" as a JSON'),
        (
            "call_tool",
            '{"name": "read_fil", "arguments": {}}',
            "There is no tool named 'read_fil'. Did you mean read_file?",
        ),
        (
            "call_tool",
            '{"name": "read_file", "arguments": {}}',
            "do not fit its schema: (top): 'path' is a required property",
        ),
        (
            "call_tool",
            '{"name": "read_file", "arguments": {"path": "a", "start_line": 0}}',
            "start_line: 0 is less than the minimum of 1",
        ),
        (
            "call_tool",
            '{"name": "read_file", "arguments": {"path": "a", "mode": "w"}}',
            "Additional properties are not allowed",
        ),
        (
            "read_file",
            '{"path": "a"}',
            """There is no tool 'read_file' to call directly. To run it: call_tool {"name": "rea""",
        ),
        ("rm_rf", "{}", "There is no tool 'rm_rf' to call directly."),
    ],
)
def test_bad_calls_are_answered_locally_saying_what_was_wrong(
    name: str, arguments: str, expected: str
) -> None:
    assert expected in local_text(name, arguments)


def test_a_schema_failure_shows_the_schema() -> None:
    assert '"required":["path"]' in local_text("call_tool", '{"name": "read_file"}')


def test_a_schema_with_a_reference_that_leads_nowhere_does_not_stop_the_call() -> None:
    schema = {"type": "object", "properties": {"path": {"$ref": "#/$defs/missing"}}}
    broken = Registry(
        [ToolEntry("read_file", "Read a file.", "Read a file.", schema, "mcp:x", Policy())]
    )
    outcome = dispatch(broken, "call_tool", '{"name": "read_file", "arguments": {"path": "a"}}')
    assert outcome == Port("read_file", {"path": "a"})  # the tool's own server will say


@pytest.mark.parametrize(
    ("arguments", "why"),
    [
        ("[" * 65 + "]" * 65, "nest objects or lists more than 64 deep"),
        ("[" * 100_000 + "]" * 100_000, "nest objects or lists more than 64 deep"),
        ('{"name": "read_file", "arguments": ' + "[" * 70 + "]" * 70 + "}", "more than 64 deep"),
        (" " * (MAX_ARGUMENT_BYTES + 1), f"bytes; at most {MAX_ARGUMENT_BYTES} are read"),
    ],
)
def test_arguments_too_deep_or_too_big_are_refused_unread(arguments: str, why: str) -> None:
    assert why in local_text("call_tool", arguments)


def test_nesting_up_to_the_limit_is_read() -> None:
    nested = "[" * 62 + "]" * 62  # with the two objects around it: 64 deep
    text = local_text("call_tool", '{"name": "read_file", "arguments": {"path": ' + nested + "}}")
    assert "do not fit its schema" in text


def test_calls_are_the_same_whatever_their_spacing_and_key_order() -> None:
    a = call_key("call_tool", '{"name": "read_file", "arguments": {"path": "a", "start_line": 2}}')
    b = call_key("call_tool", '{"arguments":{"start_line":2,"path":"a"},  "name":"read_file"}')
    c = call_key(
        "call_tool",
        '{"name": "read_file", "arguments": "{\\"path\\": \\"a\\", \\"start_line\\": 2}"}',
    )
    assert a == b == c
    assert call_key("call_tool", '{"name": "read_file", "arguments": {"path": "b"}}') != a
    assert call_key("call_tool", "not json") == ("call_tool", "not json")


# Schemas as an MCP server might send them: any keywords, broken references, bad patterns.
schema_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8)
    | st.sampled_from(["object", "string", "#/$defs/x", "#", "(", "[a-", "http://x/y.json"]),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(
        st.sampled_from(
            ["type", "properties", "items", "$ref", "$defs", "required", "pattern", "enum",
             "minimum", "anyOf", "format", "$schema", "$id", "additionalProperties", "x"]
        ),
        inner,
        max_size=4,
    ),
    max_leaves=12,
)  # fmt: skip


class Answers:
    async def call(
        self,
        request: ToolRequest,
        _: OnAsking,
        __: Runner | None = None,
        ___: OnDecided | None = None,
    ) -> Answered:
        return Answered(Result(f"ran {request.tool}", "public", False))


@settings(max_examples=300, deadline=None)
@given(
    schema=st.dictionaries(st.text(max_size=5), schema_values) | schema_values,
    arguments=st.text(max_size=30) | schema_values.map(json.dumps),
)
def test_any_schema_and_arguments_give_the_model_a_text(schema: object, arguments: str) -> None:
    entry = ToolEntry("t", "T.", "T.", schema, "mcp:x", Policy())  # type: ignore[arg-type]
    call = json.dumps({"name": "t", "arguments": "ARGS"}).replace('"ARGS"', arguments or "0")

    async def answer() -> ModelAnswer:
        return await answer_call(
            Registry([entry]),
            Answers(),
            "call_tool",
            call,
            CallOrigin("s", 1),
            find_limit=5,
            on_asking=never_asked,
        )

    assert trio.run(answer).text  # a result, or what was wrong: never an exception
