"""The model's raw text, as `/completion` streams it, told apart into reasoning, content and
tool calls by the delimiters of its template (`ChatFormat`). Sans-IO.

Text that might be the start of a delimiter is held back until the next piece says what it is,
so a tag split over two tokens never leaks into what a client sees. A tool call whose
arguments are not a JSON object stays content: the model then reads its own words back, and
the user sees what it wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from ._format import CALL_ID, ChatFormat, delimiter_pattern

__all__ = ["OutputParser", "Piece"]

# How far past the head of a tool call's opening ("<tool_call>") the rest of it must appear
# before the text is taken for content after all.
OPEN_WINDOW = 200


@dataclass(frozen=True)
class Piece:
    kind: Literal["reasoning", "content", "call"]
    text: str
    """Reasoning or content text; for a call, its JSON arguments exactly as written."""
    name: str = ""


def _held(text: str, delimiter: str) -> int:
    """How many characters at the end of `text` could begin `delimiter`."""
    for size in range(min(len(text), len(delimiter)), 0, -1):
        if delimiter.startswith(text[-size:]):
            return size
    return 0


class OutputParser:
    def __init__(self, fmt: ChatFormat) -> None:
        self.fmt = fmt
        self._state: Literal["start", "reasoning", "content", "call"] = (
            "reasoning" if fmt.thinking_open else "start"
        )
        self._buffer = ""
        self._content_started = False
        call = fmt.tool_call
        self._open = delimiter_pattern(call.open) if call else None
        self._open_head = call.open.split()[0].split(CALL_ID)[0] if call else ""
        self._opened = ""
        self._wrote_content = False
        self._mid = delimiter_pattern(call.mid) if call and call.mid.strip() else None
        self._close = delimiter_pattern(call.close) if call and call.close.strip() else None

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[Piece]:
        return self._run(final=True)

    def _run(self, *, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            before = (self._state, len(self._buffer))
            step = {
                "start": self._start,
                "reasoning": self._reasoning,
                "content": self._content,
                "call": self._call,
            }[self._state]
            step(out, final)
            if (self._state, len(self._buffer)) == before:
                return out

    def _start(self, _out: list[Piece], final: bool) -> None:
        think = self.fmt.think
        head = self._buffer.lstrip()
        if think and head.startswith(think[0]):
            self._buffer = head[len(think[0]) :]
            self._state = "reasoning"
        elif think and think[0].startswith(head) and not final:
            return  # could still be the start tag
        else:
            self._state = "content"

    def _reasoning(self, out: list[Piece], final: bool) -> None:
        assert self.fmt.think is not None  # noqa: S101 - only entered with tags
        end = self.fmt.think[1]
        at = self._buffer.find(end)
        if at >= 0:
            if at:
                out.append(Piece("reasoning", self._buffer[:at]))
            self._buffer = self._buffer[at + len(end) :]
            self._state = "content"
            return
        keep = 0 if final else _held(self._buffer, end)
        if len(self._buffer) > keep:
            out.append(Piece("reasoning", self._buffer[: len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep :]

    def _content(self, out: list[Piece], final: bool) -> None:
        if not self._content_started:
            head = self._buffer.lstrip()
            for prefix in self.fmt.content_prefixes:
                if head.startswith(prefix):
                    head = head[len(prefix) :].lstrip()
                elif prefix.startswith(head) and not final:
                    return
            if not head and not final:
                self._buffer = ""
                return
            self._buffer, self._content_started = head, True
        at = self._buffer.find(self._open_head) if self._open else -1
        if at >= 0:
            opened = self._open.match(self._buffer, at)  # type: ignore[union-attr]
            if opened is None and not final and len(self._buffer) - at < OPEN_WINDOW:
                self._emit_content(out, at)  # the head of a call, or not: the next piece says
                return
            if opened is not None:
                self._emit_content(out, at)
                self._opened = opened.group(0)
                self._buffer = self._buffer[opened.end() - at :]
                self._state = "call"
                return
            at = -1
        keep = 0 if final or not self._open else _held(self._buffer, self._open_head)
        self._emit_content(out, len(self._buffer) - keep)

    def _emit_content(self, out: list[Piece], end: int) -> None:
        if end > 0:
            if self._buffer[:end].strip() or self._wrote_content:
                out.append(Piece("content", self._buffer[:end]))
                self._wrote_content = True
            self._buffer = self._buffer[end:]

    def _call(self, out: list[Piece], final: bool) -> None:
        parsed = self._parse_call(final)
        if parsed is None:
            if final:  # never closed: what the model wrote stays visible as content
                out.append(Piece("content", self._opened + self._buffer))
                self._buffer, self._state = "", "content"
            return
        name, arguments, rest = parsed
        out.append(Piece("call", arguments, name))
        self._buffer, self._state = rest.lstrip(), "content"

    def _parse_call(self, final: bool) -> tuple[str, str, str] | None:  # noqa: PLR0911 - one per way a call can be unfinished
        text = self._buffer
        if self._mid is None:
            return None
        mid = self._mid.search(text)
        if mid is None:
            return None
        name = text[: mid.start()].strip().strip('"')
        args_at = text.find("{", mid.start())
        if args_at < 0 or not name or text[mid.end() : args_at].strip():
            return None
        try:
            value, args_end = json.JSONDecoder().raw_decode(text, args_at)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict):
            return None
        rest = text[args_end:]
        if self._close is not None:
            close = self._close.match(rest.lstrip())
            if close is not None:
                rest = rest.lstrip()[close.end() :]
            elif final and self.fmt.tool_call.close.strip().startswith(rest.strip()):  # type: ignore[union-attr]
                rest = ""  # the model stopped before its closing tag: the call is whole
            else:
                return None
        return name, text[args_at:args_end], rest
