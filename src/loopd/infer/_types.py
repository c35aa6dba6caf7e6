"""What goes to llama-server and what comes back: the request, its events, the completion.

Events and completions are pydantic models with a literal `kind`, so the channel can put them
on the wire as they are. The request is a plain dataclass: its messages are already JSON-ready
dicts, and copying them through validation on every turn would cost time for nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator

from loopd.canonical import canonical

from ._format import ChatFormat
from ._grammar import call_grammar
from ._prompt_json import PromptJson, PromptPiece

__all__ = [
    "BUDGET_MESSAGE",
    "ChatEvent",
    "ChatRequest",
    "Completion",
    "Content",
    "Generation",
    "Progress",
    "PromptPiece",
    "PromptRequest",
    "Queued",
    "Reasoning",
    "Repeating",
    "Retrying",
    "ThinkingCapped",
    "Timings",
    "ToolCall",
    "ToolCallDelta",
    "Unread",
    "Waiting",
    "template_kwargs",
]


BUDGET_MESSAGE = " [thinking budget reached]"
"""Sent as `reasoning_budget_message`: llama-server ends reasoning it capped with this text,
which is how the client tells a capped reasoning from one that ended by itself."""


@dataclass(frozen=True)
class Generation:
    """What a request asks of the model besides its prompt, alike for both kinds of request."""

    slot: int = 0
    """The slot whose KV cache this conversation owns (`id_slot`)."""
    thinking: bool = True
    """Ask templates that support it to think (`enable_thinking`)."""
    thinking_cap: int | None = None
    """Reasoning tokens allowed; sent as `reasoning_budget_tokens` and enforced by the client."""
    repetition_cap: int | None = None
    """Characters of one piece of text repeated after which the client ends the stream."""
    max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    """Extra body fields such as `temperature` or `seed`; they cannot override the fields a
    request sets itself."""
    affinity: str | None = None
    """The session the request is of, named in `[server] affinity_header` for a router that
    keeps a session on the server holding its cache."""

    @property
    def budget(self) -> int | None:
        """The reasoning tokens allowed, when the model thinks at all."""
        return self.thinking_cap if self.thinking else None

    def fields(self) -> dict[str, Any]:
        """The body fields both endpoints read alike: sampling first, so nothing after it is
        overridden by it."""
        return {
            **self.sampling,
            "stream": True,
            "id_slot": self.slot,
            "cache_prompt": True,
            "return_progress": True,
        }


@dataclass(frozen=True)
class ChatRequest:
    """One streamed chat completion, pinned to a slot."""

    messages: list[dict[str, Any]]
    """OpenAI-style messages, sent exactly as given."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    generation: Generation = Generation()
    date: str | None = None
    """The date templates that read `date_string` write (Llama 3.x): the session's first day,
    so the prompt does not change at midnight."""

    def body(self) -> bytes:
        g = self.generation
        payload: dict[str, Any] = {
            **g.fields(),
            "messages": self.messages,
            "stream_options": {"include_usage": True},
            "chat_template_kwargs": template_kwargs(thinking=g.thinking, date=self.date),
        }
        if self.tools:
            payload["tools"] = self.tools
        if g.max_tokens is not None:
            payload["max_tokens"] = g.max_tokens
        if g.budget is not None:
            payload["reasoning_budget_tokens"] = g.budget
            payload["reasoning_budget_message"] = BUDGET_MESSAGE
        return canonical(payload)


# The fields of the last `/completion` chunk loopd reads: the server would otherwise send the
# whole prompt back as text at the end of every request.
_FINAL_FIELDS = ["content", "tokens", "stop", "stop_type", "tokens_predicted", "timings"]


@dataclass(frozen=True)
class PromptRequest:
    """One streamed `/completion` of a token-exact prompt, pinned to a slot. The output is raw
    text, told apart into reasoning, content and tool calls by `format`."""

    prompt: Sequence[PromptPiece]
    """A `Prompt` where a session's history is in it: encoded from where the slot's last one
    ended."""
    format: ChatFormat
    generation: Generation = Generation()
    prefill: str = ""
    """Text the answer starts with, already at the end of `prompt`: parsed as the model's."""
    grammar: str = ""
    """A GBNF grammar the generated text must follow (tests make a small model finish a call);
    without one, a lazy grammar of the tools' calls (`call_grammar`)."""
    tools: tuple[dict[str, Any], ...] = ()
    """The tools the prompt offers: their schemas constrain a call's arguments and type the
    values of parameters written as text."""

    def body(self, prompts: PromptJson | None = None) -> bytes:
        """The request's JSON; `prompts`: the encoder its slot keeps, which encodes only what
        the prompt adds to the slot's last one."""
        fmt, g = self.format, self.generation
        payload: dict[str, Any] = {
            **g.fields(),
            "return_tokens": True,
            "response_fields": _FINAL_FIELDS,
            # Special tokens that are delimiters come back as text, so the parser sees them.
            "preserved_tokens": fmt.markers(),
            "n_predict": -1 if g.max_tokens is None else g.max_tokens,
        }
        if self.grammar:
            payload["grammar"] = self.grammar
        elif (calls := call_grammar(fmt, self.tools)) is not None:
            # As the chat endpoint does: once a call opens, its syntax and arguments are
            # constrained, so even a small model writes a call loopd can read.
            payload |= calls.request_fields()
            payload["preserved_tokens"] = list(dict.fromkeys([*fmt.markers(), *calls.preserved]))
        if g.budget is not None and fmt.think:
            payload["reasoning_budget_tokens"] = g.budget
            payload["reasoning_budget_start_tag"] = fmt.think[0]
            payload["reasoning_budget_end_tags"] = [fmt.think[1]]
            payload["reasoning_budget_message"] = BUDGET_MESSAGE
            payload["generation_prompt"] = fmt.generation_prompt
        prompt = (prompts or PromptJson()).parts(self.prompt)
        return b"".join([b'{"prompt":', *prompt, b",", canonical(payload)[1:]])


def template_kwargs(*, thinking: bool, date: str | None) -> dict[str, Any]:
    """`chat_template_kwargs`: thinking on or off, and a pinned `date_string`."""
    kwargs: dict[str, Any] = {"enable_thinking": thinking}
    if date is not None:
        kwargs["date_string"] = date
    return kwargs


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class Timings(_Model):
    """llama-server's `timings` of one request (other fields it sends are ignored), or the
    same figures read off another engine's `usage` (`_engines`)."""

    cache_n: int | None
    """Prompt tokens taken from the slot's KV cache; None where the server does not say (an
    OpenAI-compatible server that reports no `cached_tokens`)."""
    prompt_n: int
    """Prompt tokens processed anew."""
    prompt_ms: float
    predicted_n: int
    """Tokens generated."""
    predicted_ms: float

    @property
    def cached(self) -> int:
        """`cache_n`, 0 where the server does not say: for sums (a prompt's length)."""
        return self.cache_n or 0

    @property
    def prompt_tokens(self) -> int:
        """The whole prompt's length."""
        return self.cached + self.prompt_n

    block: int | None = None
    """The cache's grain where it is kept in blocks (vLLM: `--block-size`): only whole blocks
    are reused, so the limit of `cache_n` is block-grained (docs/cache.md). None: per token."""


class ToolCall(_Model):
    """A tool call as the model made it; `arguments` is the exact string received."""

    id: str
    name: str
    arguments: str


class Unread(_Model):
    """Text of an answer the parser failed on: passed on as content, as written, and the rest
    of the answer with it, unread."""

    text: str
    error: str
    """What the parser raised."""


class Completion(_Model):
    """The whole answer to one request."""

    content: str | None
    """None when the model sent no content at all."""
    reasoning_content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None
    """`stop`, `length`, `tool_calls`, or `thinking_cap` when the client cut reasoning off."""
    timings: Timings | None
    """Missing only when the client ended the stream itself (the thinking cap)."""
    reasoning_tokens: int = 0
    """Reasoning pieces received; llama-server streams one token per piece."""
    thinking_capped: bool = False
    tokens: tuple[PromptPiece, ...] | None = None
    """For a token-exact request: the tokens generated, exactly (text stands in for the rare
    ones the stream does not name: the pieces of a character split over several tokens)."""
    ended: bool = False
    """The last token generated ended the message (end of generation, not a limit)."""
    unread: Unread | None = None
    """Where the parser failed on the answer (a token-exact request); None: it read it all."""


class Queued(_Model):
    """The slot is busy: llama-server has not started on this request yet."""

    kind: Literal["queued"] = "queued"


class Waiting(_Model):
    """The server took the request; the prompt is about to be processed."""

    kind: Literal["waiting"] = "waiting"


class Progress(_Model):
    """Prompt processing: `processed` of `total` tokens, `cache` of them from the KV cache."""

    kind: Literal["progress"] = "progress"
    total: int
    cache: int
    processed: int


class Reasoning(_Model):
    kind: Literal["reasoning"] = "reasoning"
    text: str


class Content(_Model):
    kind: Literal["content"] = "content"
    text: str


class ToolCallDelta(_Model):
    """A piece of a tool call: id and name arrive whole (and may be re-sent), arguments append."""

    kind: Literal["tool_call_delta"] = "tool_call_delta"
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ThinkingCapped(_Model):
    """Reasoning reached the cap; the server or the client ends it."""

    kind: Literal["thinking_capped"] = "thinking_capped"
    cap: int


class Repeating(_Model):
    """The answer (or its reasoning) has said the same `period` characters over and over for
    `span` characters: the client ends the stream, keeping what was said."""

    kind: Literal["repeating"] = "repeating"
    period: int
    span: int


class Retrying(_Model):
    """The request failed in a way worth retrying; the next attempt starts after `delay` s."""

    kind: Literal["retrying"] = "retrying"
    attempt: int
    delay: float
    why: str

    def said(self) -> str:
        """The retry in one line, as clients show it."""
        return f"retrying in {self.delay:.1f} s (attempt {self.attempt}): {self.why}"


ChatEvent = Annotated[
    Queued
    | Waiting
    | Progress
    | Reasoning
    | Content
    | ToolCallDelta
    | ThinkingCapped
    | Repeating
    | Retrying,
    Discriminator("kind"),
]
