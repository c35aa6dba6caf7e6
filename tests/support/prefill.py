"""Making a model too small to call tools call them: the opening of a call in its template's
own format as a prefill, and a grammar that lets it write the arguments and close the call
(`Runtime.prefill`). Shared by the real-server tests and `just bench templates`."""

from __future__ import annotations

import json
from collections.abc import Callable

from loopd.infer import CALL_ID, GEMMA_QUOTE, ChatFormat
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
    end = (call.close + call.block_close).replace(CALL_ID, "call00001")  # an id it may write
    words = '[a-z]{3,12} ( " " [a-z]{2,12} )?'
    paths = f"( {gbnf('today.md')} | {gbnf('notes/today.md')} )"
    p = call.params

    def arguments(find: bool) -> tuple[str, str]:
        """The start of the arguments, and a grammar for their rest and the call's close."""
        if call.notation == "gemma":  # keys bare and in order, strings between <|"|>
            q = GEMMA_QUOTE
            if find:
                return "{query:" + q, f"root ::= {words} {gbnf(q + '}' + end)}"
            return (
                "{arguments:{path:" + q,
                f"root ::= {paths} {gbnf(f'{q}}},name:{q}read_file{q}}}{end}')}",
            )
        if p is None and find:
            return '{"query": "', f"root ::= {words} {gbnf(QUOTE_BRACE + end)}"
        if p is None:
            head = '{"name": "read_file", "arguments": {"path": "'
            return head, f"root ::= {paths} {gbnf(QUOTE_BRACE + '}' + end)}"
        if find:
            return (
                p.key_open + "query" + p.key_end,
                f"root ::= {words} {gbnf(p.end_of('query') + end)}",
            )
        head = p.key_open + "name" + p.key_end + "read_file" + p.end_of("name")
        head += p.key_open + "arguments" + p.key_end
        one, other = (
            gbnf(json.dumps({"path": "today.md"})),
            gbnf(json.dumps({"path": "notes/today.md"})),
        )
        return head, f"root ::= ( {one} | {other} ) {gbnf(p.end_of('arguments') + end)}"

    def prefill(records: list[Record]) -> tuple[str, str]:
        last = records[-1]
        results = sum(isinstance(r, ToolResultRecord) for r in records)
        find = isinstance(last, UserRecord) and results == 0
        read = isinstance(last, ToolResultRecord) and results == 1
        if not (find or read):
            return "", ""
        head, grammar = arguments(find)
        name = "find_tool" if find else "call_tool"
        return close_thinking + call.open + name + call.mid + head, grammar

    return prefill
