"""How a chat template writes an assistant message: the delimiters of its generation prompt,
its reasoning, its content and its tool calls (`ChatFormat`), as `learn_format` reads them off
the template's own renderings (`_learn`), and as the parser looks for them in raw output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ._notation import GEMMA_QUOTE, Notation

__all__ = [
    "CALL_ID",
    "PARAM_KEY",
    "SPECIAL",
    "ChatFormat",
    "FormatError",
    "ParamFormat",
    "ToolCallFormat",
    "delimiter_pattern",
    "special_markers",
]

# Strings that look like one special token: <|x|> (also with DeepSeek's full-width bars), <x>,
# </x>, Gemma 4's <x|>, [X], [/X].
SPECIAL = re.compile(
    r"</?[|\uff5c][^<>]{1,60}?>|</?[A-Za-z_:][\w:.\-]{0,40}\|?>|\[/?[A-Z_]{2,30}\]"
)


CALL_ID = "\x00id\x00"
"""Stands in a delimiter for a word the model writes itself, which varies from call to call:
a call id (Mistral's `"id": "..."`), an index (Kimi's `:0`), a value's type (DeepSeek's
`string="true"`)."""

PARAM_KEY = "\x00key\x00"
"""Stands in a parameter's end for its key, where the template closes each parameter with it
(MiniMax-M3's `<key>value</key>`)."""


# A call id written as a JSON member (Mistral's and Apriel's `, "id": "..."`): models leave it
# out, and llama.cpp reads the call without it.
_ID_MEMBER = re.compile(r',\s*"id"\s*:\s*"\x00id\x00"')


# Where whitespace may stand in a delimiter though the template writes none: around a special
# token, and around JSON's punctuation (Cohere's `<|START_ACTION|>\n[`, GLM's
# `</arg_key>\n<arg_value>`, a JSON list of calls pretty-printed).
_SPACE_MAY_STAND = re.compile(rf"({SPECIAL.pattern}|[\[\]{{}}:,])")


def delimiter_pattern(delimiter: str, *, spaced: bool = False) -> re.Pattern[str]:
    """A delimiter in which any run of whitespace matches any other (models vary spacing),
    whitespace may stand around its special tokens and JSON punctuation, a call id matches any
    id, and an id member may be left out; `spaced`: whitespace before it too."""

    def words(text: str) -> str:
        parts = []
        for word in text.split():
            for part in _SPACE_MAY_STAND.split(word):
                if part:
                    pieces = [re.escape(p) for p in part.split(CALL_ID)]
                    parts.append(r"[^\s\"]*".join(pieces))
        return r"\s*".join(parts)

    chunks = _ID_MEMBER.split(delimiter)
    pattern = r'(?:\s*,\s*"id"\s*:\s*"[^\s\"]*")?\s*'.join(words(c) for c in chunks)
    return re.compile((r"\s*" if spaced else "") + pattern)


class FormatError(Exception):
    """The template cannot be read for a token-exact prompt (it says why)."""


@dataclass(frozen=True)
class ParamFormat:
    """Arguments written one by one: `key_open + key + key_end + value + value_end`, each
    value as text (GLM's `<arg_key>`, Qwen3-Coder's `<parameter=...>`, MiniMax's); `PARAM_KEY`
    in `value_end` stands for the key."""

    key_open: str
    key_end: str
    value_end: str

    def end_of(self, key: str) -> str:
        """What ends the value of `key`."""
        return self.value_end.replace(PARAM_KEY, key)


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
    notation: Notation = "json"
    """How the arguments are written (Gemma 4 has its own notation, LFM2 Python's)."""
    content_last: bool = False
    """The template writes a message's content after its calls and their results (Gemma 4)."""
    rendered: bool = True
    """The template writes past calls; False for a known syntax of one that drops them (LFM2,
    Granite 3.3, DeepSeek R1): a past answer then ends where its content does."""


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
    calls follow none of the shapes it knows: loopd could not read them)."""

    @property
    def messages(self) -> bool:
        """An answer of several messages, each a header, `<|message|>` and a body (`_messages`),
        not a pair of tags: gpt-oss's harmony, muse-glimmer's messages to a recipient."""
        return self.think is not None and self.think[0].endswith("<|message|>")

    @property
    def harmony(self) -> bool:
        """gpt-oss's message format: channels, recipients and several messages in one answer."""
        return self.messages and self.think is not None and self.think[0].startswith("<|channel|>")

    @property
    def prompt_opens_call(self) -> bool:
        """The generation prompt ends with a call's opening (Functionary v3.2's `>>>`, which
        opens its content too, as `>>>all`): an answer that does not start with a content
        prefix starts with a call's name."""
        call = self.tool_call
        return bool(call and call.open.strip() and self.generation_prompt.endswith(call.open))

    def markers(self) -> list[str]:
        """Every delimiter the parser looks for, to be sent as `preserved_tokens` so the server
        keeps the text of those that are special tokens."""
        texts = [*self.content_prefixes, self.generation_prompt]
        if self.think:
            texts += self.think
        if self.tool_call:
            texts += [self.tool_call.open, self.tool_call.close]
            if self.tool_call.notation == "gemma":
                texts.append(GEMMA_QUOTE)
        return special_markers(texts)


def special_markers(texts: list[str]) -> list[str]:
    found: list[str] = []
    for text in texts:
        for m in SPECIAL.findall(text):
            if m not in found:
                found.append(m)
    return found
