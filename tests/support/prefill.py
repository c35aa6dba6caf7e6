"""Making a model too small to call tools call them: the opening of a call in its template's
own format as a prefill, and a grammar that lets it write the arguments and close the call
(`Runtime.prefill`). Shared by the real-server tests and `just bench templates`."""

from __future__ import annotations

import json
from collections.abc import Callable

from loopd.infer import CALL_ID, GEMMA_QUOTE, ChatFormat, ToolCallFormat
from loopd.session.records import Record, ToolResultRecord, UserRecord

WORDS = '[a-z]{3,12} ( " " [a-z]{2,12} )?'
QUOTE_BRACE = '"}'


def gbnf(text: str) -> str:
    """A GBNF string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


PATHS = gbnf("today.md")
"""The note's path under the conversation's one root (tests/support/conversation.py)."""

Arguments = Callable[[ToolCallFormat, bool, str], tuple[str, str]]
"""For a call (find_tool, else call_tool) and what closes it: the start of its arguments, and a
grammar for their rest and the close."""


def _json(_call: ToolCallFormat, find: bool, end: str) -> tuple[str, str]:
    if find:
        return '{"query": "', f"root ::= {WORDS} {gbnf(QUOTE_BRACE + end)}"
    head = '{"name": "read_file", "arguments": {"path": "'
    return head, f"root ::= {PATHS} {gbnf(QUOTE_BRACE + '}' + end)}"


def _gemma(_call: ToolCallFormat, find: bool, end: str) -> tuple[str, str]:
    """Keys bare and in order, strings between <|"|>."""
    q = GEMMA_QUOTE
    if find:
        return "{query:" + q, f"root ::= {WORDS} {gbnf(q + '}' + end)}"
    return "{arguments:{path:" + q, f"root ::= {PATHS} {gbnf(f'{q}}},name:{q}read_file{q}}}{end}')}"


def _python(_call: ToolCallFormat, find: bool, end: str) -> tuple[str, str]:
    """Keyword arguments, an object as JSON."""
    if find:
        return "(query='", f"root ::= {WORDS} {gbnf(chr(39) + ')' + end)}"
    head = "(name='read_file', arguments=" + '{"path": "'
    return head, f"root ::= {PATHS} {gbnf(QUOTE_BRACE + ')' + end)}"


def _params(call: ToolCallFormat, find: bool, end: str) -> tuple[str, str]:
    """Arguments one by one, an object's value as JSON."""
    p = call.params
    assert p is not None
    if find:
        head = p.key_open + "query" + p.key_end
        return head, f"root ::= {WORDS} {gbnf(p.end_of('query') + end)}"
    head = p.key_open + "name" + p.key_end + "read_file" + p.end_of("name")
    head += p.key_open + "arguments" + p.key_end
    path = gbnf(json.dumps({"path": "today.md"}))
    return head, f"root ::= {path} {gbnf(p.end_of('arguments') + end)}"


def prefills(fmt: ChatFormat) -> Callable[[list[Record]], tuple[str, str]]:
    """After the user's message, the opening of a find_tool call; after its result, of a
    call_tool call; each with a grammar that lets the model write the arguments and close the
    call as the template does. The text after the second result is the model's own."""
    call = fmt.tool_call
    assert call is not None
    close_thinking = f"{fmt.think[1]}\n\n" if fmt.think and fmt.thinking_open else ""
    end = (call.close + call.block_close).replace(CALL_ID, "call00001")  # an id it may write
    arguments: Arguments = (
        _params if call.params else {"gemma": _gemma, "python": _python}.get(call.notation, _json)
    )

    def prefill(records: list[Record]) -> tuple[str, str]:
        last = records[-1]
        results = sum(isinstance(r, ToolResultRecord) for r in records)
        find = isinstance(last, UserRecord) and results == 0
        read = isinstance(last, ToolResultRecord) and results == 1
        if not (find or read):
            return "", ""
        head, grammar = arguments(call, find, end)
        name = "find_tool" if find else "call_tool"
        opening = close_thinking + call.open + name + call.mid + head
        return opening.replace(CALL_ID, "call00001"), grammar

    return prefill
