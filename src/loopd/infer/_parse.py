"""The model's raw text, as `/completion` streams it, told apart into reasoning, content and
tool calls by the delimiters of its template (`ChatFormat`). Sans-IO.

Text that might be the start of a delimiter is held back until the next piece says what it is,
so a tag split over two tokens never leaks into what a client sees. A tool call whose
arguments are not a JSON object stays content: the model then reads its own words back, and
the user sees what it wrote.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

from ._format import CALL_ID, PARAM_KEY, SPECIAL, ChatFormat, ToolCallFormat, delimiter_pattern
from ._notation import OPENING, decode_arguments
from ._schema import ArgumentTypes

__all__ = ["OutputParser", "Piece"]

# A run of special tokens at the end of an answer (`<|END_TEXT|>`, `<|eot|>`, Gemma's
# `<channel|>`), each maybe with a name and a closing token (Kimi-K3's
# `<|close|>response<|sep|>`, Gemma's empty `<|channel>thought\n<channel|>`): the model's end of
# message, which llama.cpp leaves out of content. On a real server most end generation and
# never reach the parser; those that do not are dropped here.
_TAG = r"<[|\uff5c][^<>]{1,60}?>|<[A-Za-z_]\w{0,40}\|>"
_MARKER = rf"\s*(?:{_TAG})(?:\w{{1,20}}\s*(?:{_TAG}))?"
END_MARKERS = re.compile(rf"(?:{_MARKER})+\s*$")
# While the answer goes on: what may still turn out to be such a run, held back until the next
# piece says (whitespace, tokens, a token and the start of its name, the start of a token).
_MAYBE_RUN = rf"(?:{_MARKER})*\s*(?:(?:{_TAG})\w{{0,20}}\s*)?"
MAYBE_END = re.compile(rf"{_MAYBE_RUN}(?:<[|\uff5c]?[^<>\s]{{0,60}})?$")
# Where each piece is whole tokens (llama-server's stream), a special token's text comes in one
# piece: the start of a tag is text the model writes (Gemma 3's `<`, `|`, `im`, ...), not one.
MAYBE_END_OF_TOKENS = re.compile(rf"{_MAYBE_RUN}$")

# A value between these is text, whatever it holds (a closing tag too).
CDATA = ("<![CDATA[", "]]>")

# How far past the head of a tool call's opening ("<tool_call>") the rest of it must appear
# before the text is taken for content after all.
OPEN_WINDOW = 200


# What no tool's name holds: a name with one of these runs across other text (another call's
# opening, a message's markup), and the call is not one.
NOT_IN_A_NAME = re.compile(r"[\s<>{}\[\]()\"'`]")


class _NotACall(Exception):
    """The text after a call's opening cannot be a call, whatever follows: the opening is
    content, and the text after it is read again as content, where the next call may open."""


@dataclass(frozen=True)
class Piece:
    kind: Literal["reasoning", "content", "call"]
    text: str
    """Reasoning or content text; for a call, its JSON arguments exactly as written (in JSON,
    when the template has its own notation)."""
    name: str = ""


def _spaced_pattern(delimiter: str) -> re.Pattern[str]:
    return delimiter_pattern(delimiter, spaced=True)


class _ParamPatterns:
    """The delimiters of arguments written one by one, each allowing whitespace before it."""

    def __init__(self, call: ToolCallFormat, tail: str) -> None:
        params = call.params
        assert params is not None  # noqa: S101 - built only for such formats
        self.first_key = _spaced_pattern(call.mid + params.key_open)
        self.key_open = _spaced_pattern(params.key_open)
        self.key_end = _spaced_pattern(params.key_end)
        self.tags = params.value_end.split("</")[0] if PARAM_KEY in params.value_end else ""
        """The prefix of the tags an object or a list is written in, where each value is closed
        by its own key (MiniMax-M3's `]<]minimax[>[`)."""
        self.value_start = params.key_end[len(params.key_end.rstrip()) :]
        """What the template writes between a key's end and its value (Qwen3-Coder's `\n`)."""
        self._params = params
        self._value_ends: dict[str, re.Pattern[str]] = {}
        self.close = _spaced_pattern(call.close.rstrip().removesuffix(tail))

    def value_end(self, key: str) -> re.Pattern[str]:
        """What ends the value of `key` (the key itself, in templates that repeat it); built
        once per key, as the call is parsed again at each piece."""
        if PARAM_KEY not in self._params.value_end:
            key = ""
        if key not in self._value_ends:
            self._value_ends[key] = _spaced_pattern(self._params.end_of(key))
        return self._value_ends[key]

    def kept_of(self, value_end: re.Match[str]) -> int:
        """How much of the whitespace a value's end matched belongs to the value: all but what
        the template itself writes there (`#include\n` in `#include\n\n</parameter>`)."""
        matched = value_end.group(0)
        spaces = len(matched) - len(matched.lstrip())
        own = self._params.value_end
        return max(0, spaces - (len(own) - len(own.lstrip())))


def _opener(delimiter: str) -> tuple[str, re.Pattern[str]]:
    """What a call opens with: the text to look for first (its first special token, else its
    first word), and the whole."""
    first = SPECIAL.match(delimiter)
    head = first.group(0) if first else delimiter.split(maxsplit=1)[0]
    return head.split(CALL_ID, maxsplit=1)[0], delimiter_pattern(delimiter)


def _openings(opening: str) -> list[str]:
    """A call's opening and the variants models write of it: without the tag that opens a
    block of calls (`_short_open`), without the word before a colon that follows the opening
    tag (Gemma 4's `<|tool_call>:name{...}` for `<|tool_call>call:name{...}`)."""
    found = [opening, _short_open(opening)]
    first = SPECIAL.match(opening)
    if first and (word := re.match(r"[A-Za-z_]+:", opening[first.end() :])):
        found.append(first.group(0) + opening[first.end() + word.end() - 1 :])
    return [o for o in found if o]


def _block_tail(opening: str, close: str) -> str:
    """The tag that closes a block of calls at the end of a call's close, where the opening
    starts with the tag that opens that block (Qwen3-Coder's `</tool_call>`): a model that
    leaves out the one leaves out the other too, so it is optional after a call."""
    first = SPECIAL.match(opening)
    if not _short_open(opening) or first is None:
        return ""
    tail = "</" + first.group(0)[1:]
    return tail if close.rstrip().endswith(tail) else ""


def _short_open(opening: str) -> str:
    """A call's opening without the tag that opens a block of calls, which models leave out
    (Qwen3-Coder's `<function=` without `<tool_call>`, Kimi's `<|tool_call_begin|>` without
    `<|tool_calls_section_begin|>`); "" where nothing tag-like is left."""
    first = SPECIAL.match(opening)
    rest = opening[first.end() :].lstrip() if first else ""
    return rest if rest.startswith("<") else ""


def _loose_prefix(text: str, marker: str) -> int | None:
    """Where `marker` ends at the start of `text`, whitespace anywhere aside (Command R+'s
    `]```` written `]\n````), a call id in it as any the model wrote; -1 while `text` could
    still become it; None where it cannot."""
    target, at_target = "".join(marker.split()), 0
    for at, char in enumerate(text):
        if target.startswith(CALL_ID, at_target):
            after = target[at_target + len(CALL_ID) : at_target + len(CALL_ID) + 1]
            if not (char.isspace() or char in ('"', after)):
                continue  # the id goes on
            at_target += len(CALL_ID)
        if char.isspace():
            continue
        if char != target[at_target : at_target + 1]:
            return None
        at_target += 1
        if at_target == len(target):
            return at + 1
    return -1


def _held(text: str, delimiter: str) -> int:
    """How many characters at the end of `text` could begin `delimiter`."""
    for size in range(min(len(text), len(delimiter)), 0, -1):
        if delimiter.startswith(text[-size:]):
            return size
    return 0


class OutputParser:
    def __init__(
        self, fmt: ChatFormat, types: ArgumentTypes | None = None, *, tokens: bool = False
    ) -> None:
        self.fmt = fmt
        self._tokens = tokens
        """Each piece is whole tokens: a special token's text is never split over two."""
        self._types = types or ArgumentTypes()
        self._state: Literal["start", "reasoning", "content", "call"] = (
            "reasoning" if fmt.thinking_open else "start"
        )
        self._buffer = ""
        self._content_started = False
        call = fmt.tool_call
        self._openers = [_opener(o) for o in _openings(call.open)] if call else []
        self._tail = _block_tail(call.open, call.close) if call else ""
        """What may close a call's block after its close, or not (`_block_tail`)."""
        self._opened = ""
        self._wrote_content = False
        self._params = _ParamPatterns(call, self._tail) if call and call.params else None
        self._in_block = False
        self._mid = delimiter_pattern(call.mid) if call and call.mid.strip() else None
        close = call.close.rstrip().removesuffix(self._tail) if call else ""
        self._close = delimiter_pattern(close) if close.strip() else None
        self._opening_in_prompt = call.open if call and fmt.prompt_opens_call else ""
        """The call's opening where the generation prompt ends with it (Functionary v3.2's
        `>>>`): an answer without a content prefix is a call."""

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[Piece]:
        return self._run(final=True)

    def pending(self) -> str:
        """The text read and not yet passed on (a call's opening too), as the model wrote it."""
        return (self._opened if self._state == "call" else "") + self._buffer

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
        """Reasoning runs to its end tag. A call that opens inside it is held: as llama.cpp
        reads it, the call stays reasoning when the end tag comes after it, and ends the
        reasoning when the answer ends with the reasoning never closed."""
        assert self.fmt.think is not None  # noqa: S101 - only entered with tags
        end = self.fmt.think[1]
        at = self._buffer.find(end)
        # Content that starts without the end tag ends reasoning too (Kimi-K3's
        # `<|open|>response<|sep|>` right after a generation prompt that opened reasoning).
        starts = [(i, p) for p in self.fmt.content_prefixes if (i := self._buffer.find(p)) >= 0]
        if starts and (at < 0 or min(starts)[0] < at):
            at, end = min(starts)[0], ""
        if at >= 0:
            if at:
                out.append(Piece("reasoning", self._buffer[:at]))
            self._buffer = self._buffer[at + len(end) :]
            self._state = "content"
            return
        if (call_at := self._next_open(final)[0]) >= 0:
            if call_at:
                out.append(Piece("reasoning", self._buffer[:call_at]))
                self._buffer = self._buffer[call_at:]
            if final:
                self._state, self._content_started = "content", True
            return
        held = [_held(self._buffer, t) for t in (end, *self.fmt.content_prefixes)]
        keep = 0 if final else max([*held, *self._held_openers()])
        if len(self._buffer) > keep:
            out.append(Piece("reasoning", self._buffer[: len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep :]

    def _content_begins(self, final: bool) -> bool:
        """Content starts after whitespace and the template's content prefix (harmony's final
        channel header); False while that is still to come, or where the answer is a call
        whose opening the generation prompt wrote."""
        if self._content_started:
            return True
        read = self._answer_head(final)
        if read is None:
            return False
        head, prefixed = read
        if not head and not final:
            self._buffer = ""
            return False
        opening = "" if prefixed else self._opening_in_prompt
        if opening and opening.startswith(head) and not final:
            return False  # the opening written again, or a name that starts like it
        self._buffer, self._content_started = head, True
        if opening and head and not head.startswith(opening):
            self._state, self._opened = "call", ""
            return False
        return True

    def _answer_head(self, final: bool) -> tuple[str, bool] | None:
        """The answer after whitespace, markers of the generation prompt and content prefixes,
        and whether a prefix was there; None while those may still come."""
        head = self._buffer.lstrip()
        # A marker of the generation prompt written again (Command R+'s `<|CHATBOT_TOKEN|>`),
        # where it does not begin the content prefix (Kimi-K3's `<|open|>response<|sep|>`).
        prefixes = self.fmt.content_prefixes
        for marker in SPECIAL.findall(self.fmt.generation_prompt):
            if any(p.startswith(marker) for p in prefixes):
                continue
            if head.startswith(marker):
                head = head[len(marker) :].lstrip()
            elif marker.startswith(head) and not final and not self._tokens:
                return None
        prefixed = False
        for prefix in prefixes:
            if head.startswith(prefix):
                head, prefixed = head[len(prefix) :].lstrip(), True
            elif prefix.startswith(head) and not final:
                return None
        return head, prefixed

    def _block(self, final: bool) -> bool:
        """After a call: another call of the same block, the block's end, or what follows.
        False while the text could still be either."""
        call, head = self.fmt.tool_call, self._buffer.lstrip()
        # What follows a call starts after its whitespace, in whichever piece that comes.
        self._buffer = head
        if not head and not final:
            return False
        if call is None or not (call.again or call.block_close or self._tail):
            self._in_block = False
            return True
        for marker, state in (
            (call.again, "call"),
            (call.block_close, "content"),
            (self._tail, "content"),
        ):
            end = _loose_prefix(head, marker) if marker else None
            if end is not None and end >= 0:
                self._buffer, self._state = head[end:], state  # type: ignore[assignment]
                self._opened = head[:end]
                self._in_block = state == "call"
                return True
            if end is not None and not final:
                return False
        self._in_block = False
        return True

    def _content(self, out: list[Piece], final: bool) -> None:
        if self._in_block and not self._block(final):
            return
        if self._state != "content" or not self._content_begins(final):
            return
        at, opened = self._next_open(final)
        if at >= 0:
            self._emit_content(out, at)
            if opened is not None:  # else the head of a call, or not: the next piece says
                self._opened = opened.group(0)
                self._buffer = self._buffer[opened.end() - at :]
                self._state = "call"
            return
        if final:
            ending = END_MARKERS.search(self._buffer)
            self._emit_content(out, ending.start() if ending else len(self._buffer))
            self._buffer = ""
            return
        maybe = (MAYBE_END_OF_TOKENS if self._tokens else MAYBE_END).search(self._buffer)
        ending_at = maybe.start() if maybe else len(self._buffer)
        keep = max([len(self._buffer) - ending_at, *self._held_openers()])
        self._emit_content(out, len(self._buffer) - keep)

    def _next_open(self, final: bool) -> tuple[int, re.Match[str] | None]:
        """Where the first call opens in the buffer, and its opening; the opening is None while
        the text there could still become one. (-1, None) where no call opens."""
        found: tuple[int, re.Match[str] | None] = (-1, None)
        for head, pattern in self._openers:
            at = self._buffer.find(head)
            while at >= 0 and (found[0] < 0 or at < found[0]):
                if opened := pattern.match(self._buffer, at):
                    found = (at, opened)
                    break
                if not final and len(self._buffer) - at < OPEN_WINDOW:
                    found = (at, None)
                    break
                at = self._buffer.find(head, at + 1)
        return found

    def _next_call_opens(self, rest: str) -> bool:
        """The next call of a block opens right away: this one's close was left out, as
        llama.cpp reads it (Kimi's `{...}<|tool_call_begin|>`)."""
        call, head = self.fmt.tool_call, rest.lstrip()
        again = call.again if call else ""
        opens_again = bool(again) and (_loose_prefix(head, again) or 0) > 0
        return bool(head) and (opens_again or any(head.startswith(h) for h, _ in self._openers))

    def _held_openers(self) -> list[int]:
        return [_held(self._buffer, head) for head, _ in self._openers]

    def _emit_content(self, out: list[Piece], end: int) -> None:
        if end > 0:
            if self._buffer[:end].strip() or self._wrote_content:
                out.append(Piece("content", self._buffer[:end]))
                self._wrote_content = True
            self._buffer = self._buffer[end:]

    def _call(self, out: list[Piece], final: bool) -> None:
        try:
            parsed = self._parse_call(final)
        except _NotACall:
            self._not_a_call(out)
            return
        if parsed is None:
            if final:  # never closed: what the model wrote stays visible as content
                out.append(Piece("content", self._opened + self._buffer))
                self._buffer, self._state = "", "content"
            return
        name, arguments, rest = parsed
        out.append(Piece("call", arguments, name))
        rest = rest.lstrip()
        self._buffer, self._state, self._in_block = rest, "content", True

    def _not_a_call(self, out: list[Piece]) -> None:
        """The call's opening is content; the text after it is read again as content, where
        the next call may open."""
        if self._opened:
            out.append(Piece("content", self._opened))
        self._state, self._wrote_content = "content", True

    def _name(self, written: str, *, whole: bool = False) -> str:
        """A call's name as written before its arguments; raises `_NotACall` where it runs
        across text no name holds (a call whose arguments never opened, and the next call),
        or where it is empty and `whole` (no more of it is to come)."""
        name = written.strip().strip('"')
        if NOT_IN_A_NAME.search(name) is None and (name or not whole):
            return name
        raise _NotACall

    def _parse_params(self) -> tuple[str, str, str] | None:
        """`name`, then `key_open key key_end value value_end` for each argument, then the
        close; None while any of it is still to come."""
        p, text = self._params, self._buffer
        assert p is not None  # noqa: S101 - only called with parameters
        first, closed = p.first_key.search(text), p.close.search(text)
        # A call with no arguments closes where the first key would open (MiniMax-M3's
        # `">NS</invoke>` against `">NS<key>`).
        if first is None or (closed is not None and closed.start() < first.end()):
            if closed is None:
                return None
            named = text[: closed.start()]  # up to what the call opens with after its name
            if self._mid is not None and (mid := self._mid.search(named)):
                named = named[: mid.start()]  # (muse-glimmer's `<atem:invoke name="NAME"`)
            return self._name(named, whole=True), "{}", text[closed.end() :]
        name, arguments, at = self._name(text[: first.start()], whole=True), {}, first.end()
        while True:
            key_end = p.key_end.search(text, at)
            if not key_end:
                return None
            key = text[at : key_end.start()].strip().strip('"')
            start = key_end.end()
            start += len(p.value_start) if text.startswith(p.value_start, start) else 0
            cdata = text.startswith(CDATA[0], start)  # MiniCPM5: a value that holds anything
            stop = text.find(CDATA[1], start) if cdata else start
            value_end = p.value_end(key).search(text, stop) if stop >= 0 else None
            if not value_end:
                return None
            value = text[start : value_end.start() + p.kept_of(value_end)]
            if cdata:
                value = value.strip().removeprefix(CDATA[0]).removesuffix(CDATA[1])
            arguments[key] = self._types.value(name, key, value, tags=p.tags)
            at = value_end.end()
            # The close first: it may begin like another argument (MiniMax-M3's
            # `>]<]minimax[>[</invoke>` against `>]<]minimax[>[<key`).
            if closed := p.close.match(text, at):
                return name, json.dumps(arguments), text[closed.end() :]
            if more := p.key_open.match(text, at):
                at = more.end()
            else:
                return None

    def _parse_call(self, final: bool) -> tuple[str, str, str] | None:
        if self._params is not None:
            return self._parse_params()
        call, text = self.fmt.tool_call, self._buffer
        assert call is not None  # noqa: S101 - only called in a call
        opening = OPENING[call.notation]
        if self._mid is not None:
            mid = self._mid.search(text)
            if mid is None:
                return None
            name, args_from = text[: mid.start()], mid.end()
        else:  # the arguments follow the name directly (Gemma 4's `call:name{...}`)
            args_from = max(text.find(opening), 0)
            name = text[:args_from]
        args_at = text.find(opening, args_from)
        if args_at < 0 or not (name := self._name(name)) or text[args_from:args_at].strip():
            return None
        try:
            value, args_end = decode_arguments(call.notation, text, args_at)
        except ValueError:
            # Not whole yet; unless the call closed and the next one opened before its
            # arguments did (Gemma 4's string never ended): up to that close it is content.
            closed = self._close.search(text, args_at) if self._close else None
            if closed and self._next_call_opens(text[closed.end() :]):
                raise _NotACall from None
            return None
        rest = self._after_close(text[args_end:], final)
        if rest is None:
            return None
        written = text[args_at:args_end] if call.notation == "json" else json.dumps(value)
        return name, written, rest

    def _after_close(self, rest: str, final: bool) -> str | None:
        """What follows a call's close, after its arguments; None while the close is still to
        come."""
        call = self.fmt.tool_call
        if self._close is None or call is None:
            return rest
        if close := self._close.match(rest.lstrip()):
            return rest.lstrip()[close.end() :]
        if final and call.close.strip().startswith(rest.strip()):
            return ""  # the model stopped before its closing tag: the call is whole
        return rest if self._next_call_opens(rest) else None
