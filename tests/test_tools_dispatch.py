"""dispatch: find_tool answered here, call_tool checked before anything goes to the port."""

from __future__ import annotations

import pytest

from loopd.config import Policy
from loopd.tools import Local, Port, Registry, ToolEntry, dispatch

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
