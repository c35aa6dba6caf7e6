"""Making a model too small to call tools call them: the opening of a call in its template's
own format as a prefill, and a grammar that lets it write the arguments and close the call
(`Runtime.prefill`). Shared by the real-server tests and `just bench templates`."""

from __future__ import annotations

from collections.abc import Callable

from loopd.infer import ChatFormat
from loopd.records import Record, ToolResultRecord, UserRecord

QUOTE_BRACE = '"}'


def gbnf(text: str) -> str:
    """A GBNF string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def prefills(fmt: ChatFormat) -> Callable[[list[Record]], tuple[str, str]]:
    """After the user's message, the opening of a find_tool call; after its result, of a
    call_tool call; each with a grammar that lets the model write the arguments and close the
    call as the template does. The text after the second result is the model's own."""
    assert fmt.tool_call is not None
    call = fmt.tool_call
    close_thinking = f"{fmt.think[1]}\n\n" if fmt.think and fmt.thinking_open else ""

    def prefill(records: list[Record]) -> tuple[str, str]:
        last = records[-1]
        results = sum(isinstance(r, ToolResultRecord) for r in records)
        if isinstance(last, UserRecord) and results == 0:
            text = close_thinking + call.open + "find_tool" + call.mid + '{"query": "'
            words = '[a-z]{3,12} ( " " [a-z]{2,12} )?'
            return text, f"root ::= {words} {gbnf(QUOTE_BRACE + call.close)}"
        if isinstance(last, ToolResultRecord) and results == 1:
            text = close_thinking + call.open + "call_tool" + call.mid + '{"name": "read_file", '
            paths = f"( {gbnf('today.md')} | {gbnf('notes/today.md')} )"
            start, end = gbnf('"arguments": {"path": "'), gbnf('"}}' + call.close)
            return text, f"root ::= {start} {paths} {end}"
        return "", ""

    return prefill


def whole_calls(fmt: ChatFormat) -> Callable[[list[Record]], tuple[str, str]]:
    """The same two calls written out whole, for history as messages: llama-server parses a
    call that a trailing assistant message (a prefill) already holds, and takes no grammar
    beside tools."""
    assert fmt.tool_call is not None
    call = fmt.tool_call
    close_thinking = f"{fmt.think[1]}\n\n" if fmt.think and fmt.thinking_open else ""

    def prefill(records: list[Record]) -> tuple[str, str]:
        last = records[-1]
        results = sum(isinstance(r, ToolResultRecord) for r in records)
        if isinstance(last, UserRecord) and results == 0:
            arguments = '{"query": "my notes"}'
            return close_thinking + call.open + "find_tool" + call.mid + arguments + call.close, ""
        if isinstance(last, ToolResultRecord) and results == 1:
            arguments = '{"name": "read_file", "arguments": {"path": "today.md"}}'
            return close_thinking + call.open + "call_tool" + call.mid + arguments + call.close, ""
        return "", ""

    return prefill
