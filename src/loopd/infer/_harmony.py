"""gpt-oss's harmony format, read as the messages it is, not as a pair of tags. Sans-IO.

An answer is one or more messages. Each has a header, then `<|message|>`, then a body that ends
at `<|end|>`, `<|call|>`, `<|return|>` or the next message's `<|start|>`. The first header
follows the generation prompt (`<|start|>assistant`); later ones open with `<|start|>assistant`.
A header names a channel (`<|channel|>analysis`, `commentary`, `final`; a model may put a space
before the name or name two, the last counts) and may name a recipient (`to=functions.NAME`,
before or after the channel) and a constraint (`<|constrain|>json`). As llama.cpp reads it:

- a body for `functions.NAME` is that tool's call, its JSON arguments, whatever the channel;
- a body for another recipient (`container.exec`, `python`, a built-in tool loopd does not
  have) is neither content nor a call, and is dropped; `to=assistant` is no recipient;
- otherwise `analysis` is reasoning, any other channel content.

Text before any header (a model that writes no harmony at all) is content.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from ._format import ChatFormat
from ._parse import Piece, _held

__all__ = ["HarmonyParser"]

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
# What a header may open with; text that cannot begin any of these is plain content.
HEADER_STARTS = ("<|channel|>", "<|start|>", "<|constrain|>", "<|end|>", "to=")
# A header longer than this without `<|message|>` is not one: the text is content.
HEADER_WINDOW = 400

CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
RECIPIENT = re.compile(r"to=([^\s<]+)")

Kind = Literal["reasoning", "content", "call", "drop"]


def _kind(header: str) -> tuple[Kind, str]:
    """What a message's body is, from its header, and the tool's name for a call."""
    recipient = next((r for r in RECIPIENT.findall(header) if r != "assistant"), None)
    if recipient is not None:
        if recipient.startswith("functions."):
            return "call", recipient.removeprefix("functions.")
        return "drop", ""
    channels = CHANNEL.findall(header)
    return ("reasoning" if channels and channels[-1] == "analysis" else "content"), ""


class HarmonyParser:
    def __init__(self, fmt: ChatFormat) -> None:
        self.fmt = fmt
        self._buffer = ""
        self._state: Literal["header", "body"] = "header"
        self._kind: Kind = "content"
        self._name = ""
        self._call = ""
        self._body_started = False

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[Piece]:
        return self._run(final=True)

    def pending(self) -> str:
        """The text read and not yet passed on (a call's body too), as the model wrote it."""
        return self._call + self._buffer

    def _run(self, *, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            before = (self._state, len(self._buffer))
            if self._state == "header":
                self._header(out)
            else:
                self._body(out, final)
            if (self._state, len(self._buffer)) == before:
                return out

    def _header(self, out: list[Piece]) -> None:
        head = self._buffer.lstrip()
        at = head.find(MESSAGE)
        if at >= 0:
            self._open(head[:at])
            self._buffer = head[at + len(MESSAGE) :]
            return
        if not head:
            return
        # No harmony here: the text is content. (A header never finished is dropped, as
        # llama.cpp drops it.)
        could_be_header = any(head.startswith(s) or s.startswith(head) for s in HEADER_STARTS)
        if not could_be_header or len(head) > HEADER_WINDOW:
            self._state, self._kind, self._body_started = "body", "content", True
            if head.startswith("<|start|>"):  # content here, not the end of the body it opens
                out.append(Piece("content", "<|start|>"))
                self._buffer = head.removeprefix("<|start|>")

    def _open(self, header: str) -> None:
        self._kind, self._name = _kind(header)
        self._state, self._call, self._body_started = "body", "", False

    def _body(self, out: list[Piece], final: bool) -> None:
        if not self._body_started:  # the space a model writes after `<|message|>`
            self._buffer = self._buffer.lstrip()
            if not self._buffer and not final:
                return
            self._body_started = True
        ends = [(at, m) for m in ENDS if (at := self._buffer.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            self._emit(out, self._buffer[:at])
            self._close(out)
            # The next message's `<|start|>` opens its header; the other ends are dropped.
            skip = 0 if marker == "<|start|>" else len(marker)
            self._buffer, self._state = self._buffer[at + skip :], "header"
            return
        keep = 0 if final else max(_held(self._buffer, end) for end in ENDS)
        self._emit(out, self._buffer[: len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep :]
        if final:
            self._close(out)
            self._state = "header"

    def _emit(self, out: list[Piece], text: str) -> None:
        if not text:
            return
        if self._kind == "call":
            self._call += text
        elif self._kind in ("reasoning", "content"):
            out.append(Piece(self._kind, text))

    def _close(self, out: list[Piece]) -> None:
        """A call's body is whole: its arguments, when they are a JSON object; else what the
        model wrote stays visible, as content."""
        if self._kind != "call":
            return
        arguments = self._call.strip()
        try:
            ok = isinstance(json.loads(arguments), dict)
        except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
            ok = False
        if ok:
            out.append(Piece("call", arguments, self._name))
        elif arguments:
            out.append(Piece("content", arguments))
        self._kind, self._call = "drop", ""
