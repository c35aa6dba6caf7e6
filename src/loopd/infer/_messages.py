"""An answer written as messages, read as the messages it is, not as a pair of tags. Sans-IO.

An answer is one or more messages. Each has a header, then `<|message|>`, then a body that ends
at an end marker or at the next message's `<|start|>`. The first header follows the generation
prompt (`<|start|>assistant`); later ones open with `<|start|>assistant`. What a body is (
reasoning, content, a call, or nothing loopd shows) its header says, in the family's own way:

gpt-oss's harmony (`Harmony`): a header names a channel (`<|channel|>analysis`, `commentary`,
`final`; a model may put a space before the name or name two, the last counts) and may name a
recipient (`to=functions.NAME`, before or after the channel) and a constraint
(`<|constrain|>json`). Bodies end at `<|end|>`, `<|call|>` or `<|return|>`. As llama.cpp reads
it:

- a body for `functions.NAME` is that tool's call, its JSON arguments, whatever the channel;
- a body for another recipient (`container.exec`, `python`, a built-in tool loopd does not
  have) is neither content nor a call, and is dropped; `to=assistant` is no recipient;
- otherwise `analysis` is reasoning, any other channel content.

muse-glimmer (`Atem`): a header names a recipient alone. Bodies end at `<|eom|>` (more
messages follow) or `<|eot|>`. As llama.cpp reads it:

- `to=self` is reasoning; `to=user`, or no recipient, is content;
- any other recipient is a tool: its body is the call, `<atem:function_calls>` with the
  arguments one by one, as the learned call syntax reads it.

Text before any header (a model that writes no messages at all) is content. A call's body that
is not a call stays visible, as content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from ._format import ChatFormat
from ._parse import OutputParser, Piece, _held
from ._schema import ArgumentTypes

__all__ = ["MessageParser"]

MESSAGE = "<|message|>"
# A header longer than this without `<|message|>` is not one: the text is content.
HEADER_WINDOW = 400

CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
RECIPIENT = re.compile(r"to=([^\s<]+)")

Kind = Literal["reasoning", "content", "call", "drop"]


def _recipient(header: str, *, ignore: str = "") -> str | None:
    return next((r for r in RECIPIENT.findall(header) if r != ignore), None)


@dataclass(frozen=True)
class Harmony:
    """gpt-oss's messages: a channel and maybe a recipient; a call's body is JSON."""

    ends: ClassVar[tuple[str, ...]] = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
    header_starts: ClassVar[tuple[str, ...]] = (
        "<|channel|>",
        "<|start|>",
        "<|constrain|>",
        "<|end|>",
        "to=",
    )
    """What a header may open with; text that cannot begin any of these is plain content."""

    def kind(self, header: str) -> tuple[Kind, str]:
        """What a message's body is, from its header, and the tool's name for a call."""
        recipient = _recipient(header, ignore="assistant")
        if recipient is not None:
            if recipient.startswith("functions."):
                return "call", recipient.removeprefix("functions.")
            return "drop", ""
        channels = CHANNEL.findall(header)
        return ("reasoning" if channels and channels[-1] == "analysis" else "content"), ""

    def call(self, name: str, body: str) -> list[Piece] | None:
        """The call a whole body makes: its JSON arguments, when they are an object."""
        arguments = body.strip()
        try:
            ok = isinstance(json.loads(arguments), dict)
        except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
            ok = False
        return [Piece("call", arguments, name)] if ok else None


@dataclass(frozen=True)
class Atem:
    """muse-glimmer's messages: a recipient alone; a call's body is `<atem:function_calls>`."""

    fmt: ChatFormat
    types: ArgumentTypes | None = None
    ends: ClassVar[tuple[str, ...]] = ("<|eom|>", "<|eot|>", "<|start|>")
    header_starts: ClassVar[tuple[str, ...]] = ("<|start|>", "to=")

    def kind(self, header: str) -> tuple[Kind, str]:
        recipient = _recipient(header)
        if recipient == "self":
            return "reasoning", ""
        if recipient in (None, "user"):
            return "content", ""
        return "call", recipient

    def call(self, name: str, body: str) -> list[Piece] | None:
        """The call a whole body makes, read by the call syntax learned from the template,
        which starts at the recipient (`to=NAME<|message|><atem:function_calls>...`)."""
        parser = OutputParser(replace(self.fmt, think=None, content_prefixes=()), self.types)
        pieces = parser.feed(f"to={name}{MESSAGE}{body.strip()}") + parser.finish()
        calls = [p for p in pieces if p.kind == "call"]
        return calls if calls and len(calls) == len(pieces) else None


Syntax = Harmony | Atem


class MessageParser:
    def __init__(self, fmt: ChatFormat, types: ArgumentTypes | None = None) -> None:
        self.fmt = fmt
        self._syntax: Syntax = Harmony() if fmt.harmony else Atem(fmt, types)
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
        starts = (*self._syntax.header_starts, MESSAGE)  # an empty header is one too
        if any(head.startswith(s) or s.startswith(head) for s in starts):
            # Only within the window, so that the text reads the same in pieces as whole.
            at = head.find(MESSAGE, 0, HEADER_WINDOW)
            if at >= 0:
                self._open(head[:at])
                self._buffer = head[at + len(MESSAGE) :]
            if at >= 0 or len(head) < HEADER_WINDOW:
                return
        # No message here: the text is content. (A header never finished is dropped, as
        # llama.cpp drops it.)
        self._state, self._kind, self._body_started = "body", "content", True
        if head.startswith("<|start|>"):  # content here, not the end of the body it opens
            out.append(Piece("content", "<|start|>"))
            self._buffer = head.removeprefix("<|start|>")

    def _open(self, header: str) -> None:
        self._kind, self._name = self._syntax.kind(header)
        self._state, self._call, self._body_started = "body", "", False

    def _body(self, out: list[Piece], final: bool) -> None:
        if not self._body_started:  # the space a model writes after `<|message|>`
            self._buffer = self._buffer.lstrip()
            if not self._buffer and not final:
                return
            self._body_started = True
        ends = [(at, m) for m in self._syntax.ends if (at := self._buffer.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            self._emit(out, self._buffer[:at])
            self._close(out)
            # The next message's `<|start|>` opens its header; the other ends are dropped.
            skip = 0 if marker == "<|start|>" else len(marker)
            self._buffer, self._state = self._buffer[at + skip :], "header"
            return
        keep = 0 if final else max(_held(self._buffer, end) for end in self._syntax.ends)
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
        """A call's body is whole: the call it makes; else what the model wrote stays
        visible, as content."""
        if self._kind != "call":
            return
        if (calls := self._syntax.call(self._name, self._call)) is not None:
            out += calls
        elif self._call.strip():
            out.append(Piece("content", self._call.strip()))
        self._kind, self._call = "drop", ""
