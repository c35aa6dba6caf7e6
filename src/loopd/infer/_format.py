"""How a chat template writes an assistant message, learned from the template itself.

A token-exact prompt is sent to llama-server's `/completion`, which returns the model's raw
text: reasoning, content and tool calls are not told apart for us. Rather than a parser per
model family, loopd asks the server's own template (`/apply-template`) to render a few small
conversations with marked values, and reads the delimiters off the result: the generation
prompt, the thinking tags, what precedes content, and how a tool call wraps its name and its
JSON arguments. A template whose tool calls carry arguments in another shape (XML parameters)
cannot be read, and loopd says so.

The learning is sans-IO: `learn_format(render)` takes the render function as an argument.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "CALL_ID",
    "ChatFormat",
    "FormatError",
    "ParamFormat",
    "Render",
    "ToolCallFormat",
    "delimiter_pattern",
    "learn_format",
    "special_markers",
]


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

# Thinking tags of the families llama.cpp knows; a template that renders reasoning teaches its
# own tags, these serve the templates that never render past reasoning (QwQ, DeepSeek R1).
KNOWN_THINK_TAGS = (
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("◁think▷", "◁/think▷"),
    ("<|channel|>analysis<|message|>", "<|end|>"),
)

# Strings that look like one special token: <|x|> (also with DeepSeek's full-width bars), <x>,
# </x>, [X], [/X].
_SPECIAL = re.compile(r"</?[|\uff5c][^<>]{1,60}?>|</?[A-Za-z_:][\w:.\-]{0,40}>|\[/?[A-Z_]{2,30}\]")


CALL_ID = "\x00id\x00"
"""Stands in a delimiter for a call id the model writes itself (Mistral's `"id": "..."`)."""


def delimiter_pattern(delimiter: str, *, spaced: bool = False) -> re.Pattern[str]:
    """A delimiter in which any run of whitespace matches any other (models vary spacing), and
    a call id matches any id; `spaced`: whitespace before it too."""
    parts = []
    for word in delimiter.split():
        pieces = [re.escape(p) for p in word.split(CALL_ID)]
        parts.append(r"[^\s\"]*".join(pieces))
    return re.compile((r"\s*" if spaced else "") + r"\s*".join(parts))


class FormatError(Exception):
    """The template cannot be read for a token-exact prompt (it says why)."""


@dataclass(frozen=True)
class ParamFormat:
    """Arguments written one by one: `key_open + key + key_end + value + value_end`, each
    value as text (GLM's `<arg_key>`, Qwen3-Coder's `<parameter=...>`, MiniMax's)."""

    key_open: str
    key_end: str
    value_end: str


@dataclass(frozen=True)
class ToolCallFormat:
    """A tool call as `open + name + mid + arguments + close`: a JSON object, or, with
    `params`, parameters one by one."""

    open: str
    mid: str
    close: str
    params: ParamFormat | None = None
    block_close: str = ""
    """What closes a block of several calls (`</minimax:tool_call>`), after the last one."""
    again: str = ""
    """What opens a call that follows another in the same block (`<invoke name="`), when that
    is not `open`."""


@dataclass(frozen=True)
class ChatFormat:
    generation_prompt: str
    """What the template adds to make the model answer (`add_generation_prompt`)."""
    think: tuple[str, str] | None
    """The start and end tags of reasoning, when the template has any."""
    thinking_open: bool
    """The generation prompt already opens the reasoning block."""
    content_prefixes: tuple[str, ...]
    """What a template writes before content (harmony's final channel header)."""
    tool_call: ToolCallFormat | None
    """None when the template has no tool calls (`learn_format` refuses a template whose tool
    calls are not a name and JSON arguments: loopd could not read them)."""

    def markers(self) -> list[str]:
        """Every delimiter the parser looks for, to be sent as `preserved_tokens` so the server
        keeps the text of those that are special tokens."""
        texts = [*self.content_prefixes, self.generation_prompt]
        if self.think:
            texts += self.think
        if self.tool_call:
            texts += [self.tool_call.open, self.tool_call.close]
        return special_markers(texts)


def _common_prefix(texts: list[str]) -> str:
    """The longest string all of `texts` start with (character by character, unlike paths)."""
    first, last = min(texts), max(texts)
    size = next((i for i, (a, b) in enumerate(zip(first, last, strict=False)) if a != b), None)
    return first if size is None else first[:size]


def special_markers(texts: list[str]) -> list[str]:
    found: list[str] = []
    for text in texts:
        for m in _SPECIAL.findall(text):
            if m not in found:
                found.append(m)
    return found


async def learn_format(render: Render, system: str, source: str = "") -> ChatFormat:
    """Read the delimiters off renderings of small conversations with marked values.

    An assistant message is never rendered last: llama-server takes a trailing assistant
    message for a prefill and leaves it open. A user message or tool results follow it."""
    base: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Hello."},
    ]
    without = await render(base, generation_prompt=False)
    with_prompt = await render(base, generation_prompt=True)
    if not with_prompt.startswith(without):
        raise FormatError("the generation prompt does not extend the rendered conversation")
    gen = with_prompt[len(without) :]

    plain = await _assistant(render, base, without, {"content": CONTENT})
    header = _clean(_common_prefix([gen, plain]))
    prefix = plain[len(header) : plain.index(CONTENT)].strip()
    think = await _think_tags(render, base, without, gen, source)
    return ChatFormat(
        generation_prompt=gen,
        think=think,
        thinking_open=think is not None and gen.rstrip().endswith(think[0]),
        content_prefixes=(prefix,) if prefix else (),
        tool_call=await _tool_call_format(render, base, without, header),
    )


def _call(name: str, index: int, arguments: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "id": f"c0000000{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments or {KEY: VALUE})},
    }


def _results(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": c["id"], "content": "Done."} for c in calls]


async def _assistant(
    render: Render, base: list[dict[str, Any]], without: str, message: dict[str, Any]
) -> str:
    """The text one assistant message and what follows it add after `base`. (Many templates
    leave content out of a message with tool calls.)"""
    calls = message.get("tool_calls", [])
    after = _results(calls) if calls else [{"role": "user", "content": "Next."}]
    full = await render([*base, {"role": "assistant", **message}, *after], generation_prompt=False)
    start = len(without) if full.startswith(without) else _after_user(full, without)
    if start is None or (not calls and CONTENT not in full[start:]):
        raise FormatError("the template does not render an assistant message after the history")
    return full[start:]


def _after_user(full: str, without: str) -> int | None:
    """Where the assistant starts when the template rewrote what came before (Mistral moves the
    tools to the last user message): right after the user message and its end marker."""
    user = "Hello."
    if user not in without or user not in full:
        return None
    end_of_user = without[without.rindex(user) + len(user) :]
    start = full.index(user) + len(user)
    return start + len(end_of_user) if full.startswith(end_of_user, start) else None


async def _think_tags(
    render: Render, base: list[dict[str, Any]], without: str, gen: str, source: str
) -> tuple[str, str] | None:
    """From the rendering of past reasoning; else a known pair the template's source names."""
    message = {"content": CONTENT, "reasoning_content": REASONING, "tool_calls": [_call(NAME, 1)]}
    try:
        text = await _assistant(render, base, without, message)
    except FormatError:
        text = ""
    for start, end in KNOWN_THINK_TAGS:
        if gen.rstrip().endswith(start):
            return start, end
        if REASONING in text and start in text and end in text:
            return start, end
        if start in source and end in source:
            return start, end
    if REASONING not in text or CONTENT not in text:
        return None
    # A template with its own tags: what stands between the reasoning and the content.
    at = text.index(REASONING)
    end = text[at + len(REASONING) : text.index(CONTENT)].strip()
    start = text[len(_common_prefix([gen, text])) : at].strip()
    return (start, end) if start and end else None


async def _tool_call_format(
    render: Render, base: list[dict[str, Any]], without: str, header: str
) -> ToolCallFormat | None:
    one = await _tool_calls_text(render, base, without, [_call(NAME, 1)])
    if not one or NAME not in one:
        return None  # the template has no tool calls: nobody can parse one
    located = _locate(one, NAME)
    if not located:
        return await _param_format(render, base, without, header)
    name_at, args_at, args_end = located
    after = one[args_end:]
    two = await _tool_calls_text(render, base, without, [_call(NAME, 1), _call(NAME_2, 2)])
    second = two and NAME_2 in two and _locate(two, NAME)
    block_close = again = ""
    if two and second:
        shared = _common_prefix([after, two[second[2] :]])
        close = _clean(shared)
        block_close = _block_close(after[len(close) :], cut=shared != close)
        again = two[second[2] + len(close) : two.index(NAME_2)].strip()
    else:  # one call per message: the close runs up to the next special token
        marker = _SPECIAL.search(after)
        close = after[: marker.start()] if marker else after
    start = len(header) if one.startswith(header) else 0
    open_ = one[start:name_at]
    open_ = open_[open_.find(CONTENT) + len(CONTENT) :] if CONTENT in open_ else open_
    if not open_.strip():
        raise FormatError("nothing in its tool calls tells them from content")
    mid = one[name_at + len(NAME) : args_at]
    first_id = _call(NAME, 1)["id"]
    return ToolCallFormat(
        open=open_.lstrip().replace(first_id, CALL_ID),
        mid=mid.replace(first_id, CALL_ID),
        close=close.replace(first_id, CALL_ID),
        block_close=block_close,
        again=again if block_close else "",
    )


async def _param_format(
    render: Render, base: list[dict[str, Any]], without: str, header: str
) -> ToolCallFormat:
    """Tool calls whose arguments are written one by one, learned from a call with two."""
    arguments = {KEY: VALUE, KEY_2: VALUE_2}
    one = await _tool_calls_text(render, base, without, [_call(NAME, 1, arguments)])
    two = await _tool_calls_text(
        render, base, without, [_call(NAME, 1, arguments), _call(NAME_2, 2, arguments)]
    )
    marks = [NAME, KEY, VALUE, KEY_2, VALUE_2]
    at = _positions(one or "", marks)
    if one is None or at is None:
        raise FormatError("its tool calls are neither JSON arguments nor parameters")
    between = [one[at[i] + len(marks[i]) : at[i + 1]] for i in range(len(marks) - 1)]
    name_to_key, key_end, value_to_key, key_end_2 = between
    key_open = _common_suffix([name_to_key, value_to_key])
    if not key_open.strip() or key_end != key_end_2:
        raise FormatError("its tool calls' parameters follow no pattern loopd can read")
    value_end = value_to_key[: len(value_to_key) - len(key_open)]
    after = one[at[-1] + len(VALUE_2) :]
    second = _positions(two or "", [NAME, KEY, VALUE, KEY_2, VALUE_2, NAME_2])
    if not two or second is None or not after.startswith(value_end):
        raise FormatError("its tool calls' ends cannot be told apart")
    shared = _common_prefix([after, two[second[4] + len(VALUE_2) :]])
    close = _clean(shared)[len(value_end) :]
    block_close = _block_close(after[len(value_end) + len(close) :], cut=shared != _clean(shared))
    again = two[second[4] + len(VALUE_2) + len(value_end) + len(close) : second[5]].strip()
    start = len(header) if one.startswith(header) else 0
    open_ = one[start : at[0]]
    open_ = open_[open_.find(CONTENT) + len(CONTENT) :] if CONTENT in open_ else open_
    if not open_.strip() or not close.strip():
        raise FormatError("nothing in its tool calls tells them from content")
    return ToolCallFormat(
        open=open_.lstrip(),
        mid=name_to_key[: len(name_to_key) - len(key_open)],
        close=close,
        params=ParamFormat(key_open=key_open, key_end=key_end, value_end=value_end),
        block_close=block_close,
        again=again if block_close else "",
    )


def _clean(text: str) -> str:
    """`text` without a tag it ends in the middle of (`...\n<` from `<invoke` against `</x>`)."""
    opened = text.rfind("<")
    return text[:opened] if opened > text.rfind(">") else text


def _block_close(rest: str, *, cut: bool) -> str:
    """After the last call of a block: the tag that closes the block, when calls share one."""
    marker = _SPECIAL.match(rest.lstrip())
    return marker.group(0) if cut and marker else ""


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


async def _tool_calls_text(
    render: Render, base: list[dict[str, Any]], without: str, calls: list[dict[str, Any]]
) -> str | None:
    try:
        return await _assistant(render, base, without, {"content": CONTENT, "tool_calls": calls})
    except FormatError:
        return None


def _locate(text: str, name: str) -> tuple[int, int, int] | None:
    """Where the name is, and where its JSON arguments start and end."""
    name_at = text.find(name)
    key_at = text.find(KEY, name_at)
    if name_at < 0 or key_at < 0:
        return None
    args_at = text.rfind("{", name_at, key_at)
    if args_at < 0:
        return None
    try:
        value, args_end = json.JSONDecoder().raw_decode(text, args_at)
    except json.JSONDecodeError:
        return None
    if value != {KEY: VALUE}:
        return None
    return name_at, args_at, args_end
