"""Learning a template's `ChatFormat` from the template itself.

A token-exact prompt is sent to llama-server's `/completion`, which returns the model's raw
text: reasoning, content and tool calls are not told apart for us. Rather than a parser per
model family, loopd asks the server's own template (`/apply-template`) to render a few small
conversations with marked values, and reads the delimiters off the result: the generation
prompt, the thinking tags, what precedes content, and how a tool call wraps its name and its
arguments (an object in JSON, Gemma's notation or Python, or parameters one by one). A template
whose tool calls follow none of these shapes cannot be read, and loopd says so.

Sans-IO: `learn_format(render)` takes the render function as an argument.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Protocol, get_args

from ._format import (
    CALL_ID,
    PARAM_KEY,
    SPECIAL,
    ChatFormat,
    FormatError,
    ParamFormat,
    ToolCallFormat,
)
from ._notation import OPENING, Notation, decode_arguments

__all__ = ["Render", "learn_format"]


class Render(Protocol):
    """Render messages with the server's chat template, as `/apply-template` does."""

    async def __call__(
        self, conversation: list[dict[str, Any]], *, generation_prompt: bool
    ) -> str: ...


# Marked values: unlikely in any template, plain ASCII so no tokenizer or filter touches them.
REASONING = "Rz7Reasoning"
CONTENT = "Cz7Content"
NAME = "Nz7name"
NAME_2 = "Nz7other"
KEY = "Kz7key"
VALUE = "Vz7value"
KEY_2 = "Kz7other"
VALUE_2 = "Vz7second"
RESULT = "Rz7Result"
HELLO, NEXT = "Hello.", "Next."
"""The user's message before the probed answer, and after it."""

# Thinking tags of the families llama.cpp knows; a template that renders reasoning teaches its
# own tags, these serve the templates that never render past reasoning (QwQ, DeepSeek R1).
KNOWN_THINK_TAGS = (
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("◁think▷", "◁/think▷"),
    ("<|channel|>analysis<|message|>", "<|end|>"),
    ("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
    # muse-glimmer: a message to itself. Its template writes no content beside calls, so the
    # probe, whose message has both, never shows what follows the reasoning.
    ("to=self<|message|>", "<|eom|>"),
)


# Call syntaxes of the families whose templates never render a past call (so it cannot be read
# off a rendering), each known by what its template's source says, as llama.cpp knows them
# (`common_chat_templates_apply` in its common/chat.cpp).
KNOWN_CALLS = (
    (  # LFM2 and LFM2.5: a Python list of calls
        "List of tools",
        ToolCallFormat(
            open="<|tool_call_start|>[",
            mid="",
            close="",
            block_close="]<|tool_call_end|>",
            again=",",
            notation="python",
            rendered=False,
        ),
    ),
    (  # Granite 3.3: its tool section says "<|tool_call|> followed by a JSON list"
        "<|tool_call|> followed by a JSON list",
        ToolCallFormat(
            open='<|tool_call|>[{"name": "',
            mid='", "arguments": ',
            close="}",
            block_close="]",
            again=', {"name": "',
            rendered=False,
        ),
    ),
    (  # DeepSeek R1: each call's JSON arguments in a fenced block
        "tool\u2581calls\u2581begin",
        ToolCallFormat(
            open="<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>"
            "function<\uff5ctool\u2581sep\uff5c>",
            mid="\n```json\n",
            close="\n```<\uff5ctool\u2581call\u2581end\uff5c>",
            block_close="<\uff5ctool\u2581calls\u2581end\uff5c>",
            again="<\uff5ctool\u2581call\u2581begin\uff5c>function<\uff5ctool\u2581sep\uff5c>",
            rendered=False,
        ),
    ),
)


def _known_calls(source: str) -> ToolCallFormat | None:
    return next((fmt for marker, fmt in KNOWN_CALLS if marker in source), None)


def _common_prefix(texts: list[str]) -> str:
    """The longest string all of `texts` start with (character by character, unlike paths)."""
    first, last = min(texts), max(texts)
    size = next((i for i, (a, b) in enumerate(zip(first, last, strict=False)) if a != b), None)
    return first if size is None else first[:size]


async def learn_format(render: Render, system: str, source: str = "") -> ChatFormat:
    """Read the delimiters off renderings of small conversations with marked values.

    An assistant message is never rendered last: llama-server takes a trailing assistant
    message for a prefill and leaves it open. A user message or tool results follow it."""
    probe = await _Probe.start(render, system)
    gen, plain = probe.gen, probe.plain
    header = _clean(_common_prefix([gen, plain]))
    prefix = plain[len(header) : plain.index(CONTENT)].strip()
    think = await _think_tags(probe, source)
    if think and prefix.startswith(think[1]) and prefix[len(think[1]) :].strip():
        prefix = prefix[len(think[1]) :].strip()  # Kimi-K3's think close, then its own prefix
    tool_call = await _tool_call_format(probe, header) or _known_calls(source)
    if tool_call is None and "tools" in source:
        raise FormatError(
            "the template offers tools but writes no past call, and its call syntax is of no "
            "family loopd knows: loopd could not tell the model's calls from content"
        )
    if tool_call and think:
        tool_call = _without_empty_thinking(tool_call, think)
    return ChatFormat(
        generation_prompt=gen,
        think=think,
        thinking_open=think is not None and gen.rstrip().endswith(think[0]),
        content_prefixes=(prefix,) if prefix else (),
        tool_call=tool_call,
    )


def _without_empty_thinking(call: ToolCallFormat, think: tuple[str, str]) -> ToolCallFormat:
    """A call's opening without the empty reasoning block that the template writes before a
    call without reasoning (Command R7B): that block is reasoning, parsed as such."""
    start, end = think
    rest = call.open[len(start) :].lstrip() if call.open.startswith(start) else ""
    if not rest.startswith(end):
        return call
    return replace(call, open=rest[len(end) :].lstrip())


@dataclass(frozen=True)
class _Probe:
    """Renders an assistant message after a short conversation (`base`), and finds where it
    starts."""

    render: Render
    base: list[dict[str, Any]]
    without: str
    """`base` as rendered."""
    gen: str
    """The generation prompt after it."""
    plain: str = ""
    """An answer of plain content after it, and what follows."""

    @classmethod
    async def start(cls, render: Render, system: str) -> _Probe:
        base: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": HELLO},
        ]
        with_prompt = await render(base, generation_prompt=True)
        without = _without_ending(await render(base, generation_prompt=False), with_prompt)
        probe = cls(render, base, without, with_prompt[len(without) :])
        return replace(probe, plain=await probe.assistant({"content": CONTENT}))

    def message_end(self) -> list[str]:
        """The special tokens between a message's content and the next message's
        (`<|im_end|>`, `<|im_start|>`)."""
        after = self.plain[self.plain.index(CONTENT) + len(CONTENT) :]
        return SPECIAL.findall(after[: after.find(NEXT)])

    async def assistant(self, message: dict[str, Any]) -> str:
        """The text one assistant message and what follows it add after `base`. (Many
        templates leave content out of a message with tool calls.)"""
        calls = message.get("tool_calls", [])
        after = _results(calls) if calls else [{"role": "user", "content": NEXT}]
        full = await self.render(
            [*self.base, {"role": "assistant", **message}, *after], generation_prompt=False
        )
        start = len(self.without) if full.startswith(self.without) else self._after_user(full)
        if start is None or (not calls and CONTENT not in full[start:]):
            raise FormatError("the template does not render an assistant message after the history")
        return full[start:]

    async def tool_calls(self, calls: list[dict[str, Any]]) -> str | None:
        try:
            return await self.assistant({"content": CONTENT, "tool_calls": calls})
        except FormatError:
            return None

    def _after_user(self, full: str) -> int | None:
        """Where the assistant starts when the template rewrote what came before: right after
        the user message and its end marker. Mistral moves the tools to the last user message;
        Command R+ writes an instruction after the whole history, a turn of its own (it opens
        as the generation prompt does) that the longer conversation has at its end instead."""
        user, without = HELLO, self.without
        if user not in without or user not in full:
            return None
        end_of_user = without[without.rindex(user) + len(user) :]
        start = full.index(user) + len(user)
        if full.startswith(end_of_user, start):
            return start + len(end_of_user)
        turn = SPECIAL.match(self.gen)
        trailer_at = end_of_user.find(turn.group(0)) if turn else -1
        if trailer_at < 0 or not full.startswith(end_of_user[:trailer_at], start):
            return None
        return start + trailer_at if full.endswith(end_of_user[trailer_at:]) else None


def _without_ending(without: str, with_prompt: str) -> str:
    """The conversation as rendered, less an end-of-text token that a template writes only
    when no answer is asked for (Phi-3.5 writes its eos there, where the generation prompt
    goes otherwise): the generation prompt must extend what is left."""
    if with_prompt.startswith(without):
        return without
    shared = _clean(_common_prefix([without, with_prompt]))
    if not SPECIAL.fullmatch(without[len(shared) :].strip()):
        raise FormatError("the generation prompt does not extend the rendered conversation")
    return shared


def _id(index: int) -> str:
    return f"c0000000{index}"


def _ids(delimiter: str) -> str:
    """A delimiter with the probe's call ids in it (Solar Open's `<|tool_call:begin|>c00000001`)
    as any id: the model writes its own."""
    return delimiter.replace(_id(1), CALL_ID).replace(_id(2), CALL_ID)


def _numbered(open_: str, again: str) -> tuple[str, str]:
    """The openings of a block's first call and of the next, where the template numbers its
    calls in them (Command R7B's `"tool_call_id": "0"`, then `"1"`): the number as any id, so
    a third call, or one the model numbers otherwise, is read too."""
    tail = _common_suffix([open_, again])
    while tail and tail[0].isdigit():
        tail = tail[1:]
    first, second = open_[: len(open_) - len(tail)], again[: len(again) - len(tail)]
    number, other = (re.search(r"\d+$", t) for t in (first, second))
    if not (number and other and number.group(0) != other.group(0)):
        return open_, again
    first, second = first[: number.start()], second[: other.start()]
    if not _common_suffix([first, second]).strip():
        return open_, again
    return first + CALL_ID + tail, second + CALL_ID + tail


def _call(name: str, index: int, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": _id(index),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments or {KEY: VALUE})},
    }


def _results(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": c["id"], "content": RESULT} for c in calls]


async def _think_tags(probe: _Probe, source: str) -> tuple[str, str] | None:
    """From the rendering of past reasoning; else a known pair the template's source names."""
    message = {"content": CONTENT, "reasoning_content": REASONING, "tool_calls": [_call(NAME, 1)]}
    try:
        text = await probe.assistant(message)
    except FormatError:
        text = ""
    for start, end in KNOWN_THINK_TAGS:
        if probe.gen.rstrip().endswith(start):
            return start, end
        if REASONING in text and start in text and end in text:
            return start, end
        if start in source and end in source:
            return start, end
    if REASONING not in text or CONTENT not in text:
        return None
    # A template with its own tags: what stands between the reasoning and the content, or the
    # call, where that comes first (Gemma 4 writes content last): its first special token.
    at = text.index(REASONING)
    end = text[at + len(REASONING) : text.index(CONTENT)].split(NAME)[0].strip()
    if NAME in text[at : text.index(CONTENT)] and (tag := SPECIAL.search(end)):
        end = tag.group(0)
    start = text[len(_common_prefix([probe.gen, text])) : at].strip()
    return (start, end) if start and end else None


async def _tool_call_format(probe: _Probe, header: str) -> ToolCallFormat | None:
    one = await probe.tool_calls([_call(NAME, 1)])
    if not one or NAME not in one:
        return None  # the template has no tool calls: nobody can parse one
    located = _locate(one, NAME)
    if not located:
        return await _param_format(probe, header)
    name_at, args_at, args_end, notation = located
    after = one[args_end:]
    two = await probe.tool_calls([_call(NAME, 1), _call(NAME_2, 2)])
    second = two and NAME_2 in two and _locate(two, NAME)
    block_close = again = ""
    if two and second:
        shared = _common_prefix([after, two[second[2] :]])
        close = _clean(shared)
        block_close = _block_close(probe, after[len(close) :], cut=shared != close)
        again = two[second[2] + len(close) : two.index(NAME_2)].strip()
    else:  # one call per message: the close runs up to the next special token
        marker = SPECIAL.search(after)
        close = after[: marker.start()] if marker else after
    start = len(header) if one.startswith(header) else 0
    open_ = one[start:name_at]
    open_ = open_[open_.find(CONTENT) + len(CONTENT) :] if CONTENT in open_ else open_
    if not open_.strip():
        raise FormatError("nothing in its tool calls tells them from content")
    mid = one[name_at + len(NAME) : args_at]
    if two and second and (other := _locate(two[second[2] :], NAME_2)):
        mid = _varying(mid, two[second[2] :][other[0] + len(NAME_2) : other[1]])
    open_, again = _numbered(_ids(open_.lstrip()), _ids(again) if block_close else "")
    return ToolCallFormat(
        open=open_,
        mid=_ids(mid),
        close=_ids(close),
        block_close=block_close,
        again=again,
        notation=notation,
        content_last=one.find(CONTENT) > name_at,
    )


async def _param_format(probe: _Probe, header: str) -> ToolCallFormat:
    """Tool calls whose arguments are written one by one, learned from a call with two."""
    arguments = {KEY: VALUE, KEY_2: VALUE_2}
    one = await probe.tool_calls([_call(NAME, 1, arguments)])
    two = await probe.tool_calls([_call(NAME, 1, arguments), _call(NAME_2, 2, arguments)])
    marks = [NAME, KEY, VALUE, KEY_2, VALUE_2]
    at = _positions(one or "", marks)
    if one is None or at is None:
        raise FormatError("its tool calls are neither JSON arguments nor parameters")
    between = [one[at[i] + len(marks[i]) : at[i + 1]] for i in range(len(marks) - 1)]
    name_to_key, key_end, value_to_key, key_end_2 = between
    key_open = _common_suffix([name_to_key, value_to_key])
    if not key_open.strip() or key_end != key_end_2:
        raise FormatError("its tool calls' parameters follow no pattern loopd can read")
    key_end = await _typed_key_end(probe, key_end)
    value_end = value_to_key[: len(value_to_key) - len(key_open)].replace(KEY, PARAM_KEY)
    last_end = value_end.replace(PARAM_KEY, KEY_2)  # how the last argument ends
    after = one[at[-1] + len(VALUE_2) :]
    second = _positions(two or "", [NAME, KEY, VALUE, KEY_2, VALUE_2, NAME_2])
    if not two or second is None or not after.startswith(last_end):
        raise FormatError("its tool calls' ends cannot be told apart")
    shared = _common_prefix([after, two[second[4] + len(VALUE_2) :]])
    close = _clean(shared)[len(last_end) :]
    block_close = _block_close(
        probe, after[len(last_end) + len(close) :], cut=shared != _clean(shared)
    )
    again = two[second[4] + len(VALUE_2) + len(last_end) + len(close) : second[5]].strip()
    start = len(header) if one.startswith(header) else 0
    open_ = one[start : at[0]]
    open_ = open_[open_.find(CONTENT) + len(CONTENT) :] if CONTENT in open_ else open_
    if not open_.strip() or not close.strip():
        raise FormatError("nothing in its tool calls tells them from content")
    mid = name_to_key[: len(name_to_key) - len(key_open)]
    name_to_key_2 = two[second[5] + len(NAME_2) :].split(KEY, 1)[0]
    if name_to_key_2.endswith(key_open):  # Kimi-K3's call index (`index="1"`, `"2"`)
        mid = _varying(mid, name_to_key_2[: len(name_to_key_2) - len(key_open)])
    # What opens a call after another, where a block has no close of its own but opens its
    # calls otherwise than its first (Kimi-K3's `<|open|>call tool="`).
    again_alone = bool(again) and again != open_.strip()
    open_, again = _numbered(
        _ids(open_.lstrip()), _ids(again) if block_close or again_alone else ""
    )
    return ToolCallFormat(
        open=open_,
        mid=_ids(mid),
        close=_ids(close),
        params=ParamFormat(key_open=key_open, key_end=key_end, value_end=value_end),
        block_close=block_close,
        again=again,
    )


async def _typed_key_end(probe: _Probe, key_end: str) -> str:
    """A key's end where the template marks the value's type in it (DeepSeek V3.2's
    `" string="true">`, `" string="false">` for a list or a number): the mark matches any."""
    listed = await probe.tool_calls([_call(NAME, 1, {KEY: [VALUE], KEY_2: VALUE_2})])
    if listed is None or KEY not in listed:
        return key_end
    after = listed[listed.index(KEY) + len(KEY) :]
    value_at = after.find(json.dumps([VALUE]))
    return _varying(key_end, after[:value_at]) if value_at > 0 else key_end


def _varying(first: str, second: str) -> str:
    """A delimiter where two renderings differ by one word (Kimi's call index `:0`, `:1`;
    DeepSeek's `string="true"`, `"false"`): that word matches any the model writes."""
    head = _common_prefix([first, second])
    tail = _common_suffix([first[len(head) :], second[len(head) :]])
    while head and head[-1].isalnum():  # the whole word varies, not its end
        head = head[:-1]
    while tail and tail[0].isalnum():
        tail = tail[1:]
    differs = first[len(head) : len(first) - len(tail)]
    other = second[len(head) : len(second) - len(tail)]
    return head + CALL_ID + tail if differs.isalnum() and other.isalnum() else first


def _clean(text: str) -> str:
    """`text` without a tag it ends in the middle of (`...\n<` from `<invoke` against `</x>`)."""
    opened = text.rfind("<")
    return text[:opened] if opened > text.rfind(">") else text


def _block_close(probe: _Probe, rest: str, *, cut: bool) -> str:
    """After the last call of a block, what closes the block when calls share one: text up to
    the next special token (Mistral's `]`, Command R+'s `]````), and that token too when it
    closes the block, i.e. the message ends right after it (LFM2's `]<|tool_call_end|>`, Kimi's
    `<|tool_calls_section_end|>`, DeepSeek's end of its calls). Not a token that ends the
    message itself (`<|im_end|>`) or opens the results (GLM's `<|observation|>`, Gemma 4's
    `<|tool_response>`). `cut`: the calls part in the middle of a tag, where the template's
    message ending cannot be told."""
    rest = rest.lstrip()
    marker = SPECIAL.search(rest)
    if marker is None:
        return ""
    text = rest[: marker.start()].strip()
    if RESULT in text:
        return ""
    tag, ends = marker.group(0), probe.message_end()
    after = rest[marker.end() :].lstrip()
    closes = tag not in ends and any(after.startswith(e) for e in ends) if ends else cut
    if text:
        return rest[: marker.end()].strip() if closes else text
    return tag if closes else ""


def _positions(text: str, marks: list[str]) -> list[int] | None:
    """Where each mark is, in order; None if one is missing."""
    found, at = [], 0
    for mark in marks:
        at = text.find(mark, at)
        if at < 0:
            return None
        found.append(at)
        at += len(mark)
    return found


def _common_suffix(texts: list[str]) -> str:
    return _common_prefix([t[::-1] for t in texts])[::-1]


def _locate(text: str, name: str) -> tuple[int, int, int, Notation] | None:
    """Where the name is, where its arguments start and end, and their notation."""
    name_at = text.find(name)
    key_at = text.find(KEY, name_at)
    if name_at < 0 or key_at < 0:
        return None
    for notation in get_args(Notation):
        args_at = text.rfind(OPENING[notation], name_at, key_at)
        if args_at < 0:
            continue
        try:
            value, args_end = decode_arguments(notation, text, args_at)
        except ValueError:
            continue
        if value == {KEY: VALUE}:
            return name_at, args_at, args_end, notation
    return None
