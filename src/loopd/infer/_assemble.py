"""Turning llama-server's stream chunks into events and one completion, without any I/O.

The chunk format is llama-server's (see LLAMA_SERVER.md): deltas of reasoning, content and tool
calls, `prompt_progress` while the prompt is processed, `timings` on the last chunk. Parsing is
strict about types and lenient about fields it does not use, so a newer server still works and
a garbled one fails with a clear message instead of a wrong answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from ._errors import StreamBroken, StreamErrorEvent
from ._repeat import Repetition
from ._types import (
    BUDGET_MESSAGE,
    ChatEvent,
    Completion,
    Content,
    Progress,
    Reasoning,
    Repeating,
    ThinkingCapped,
    Timings,
    ToolCall,
    ToolCallDelta,
)

__all__ = [
    "THINKING_CAP_GRACE",
    "Assembler",
    "Clock",
    "Loose",
    "PromptProgress",
    "Usage",
    "read_chunk",
]

# Reasoning that the server does not end (a template without thinking tags ignores the budget)
# is cut by the client once it runs this many pieces past the cap: room for the server's own
# closing text (the budget message and the end tag) when it does end it.
THINKING_CAP_GRACE = 16


class Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Function(Loose):
    name: str | None = None
    arguments: str | None = None


class _ToolCallPiece(Loose):
    index: int = 0
    id: str | None = None
    function: _Function | None = None


class _Delta(Loose):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    """vLLM's name for `reasoning_content`, and some hosted APIs'."""
    tool_calls: list[_ToolCallPiece] | None = None


class _Choice(Loose):
    delta: _Delta | None = None
    finish_reason: str | None = None


class PromptProgress(Loose):
    total: int
    cache: int
    processed: int


class _PromptDetails(Loose):
    cached_tokens: int | None = None


class Usage(Loose):
    """The `usage` an OpenAI-compatible stream ends with (`stream_options.include_usage`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _PromptDetails | None = None

    def timings(self, prompt_ms: float, predicted_ms: float, block: int | None) -> Timings:
        """The same figures as llama-server's `timings`; the cache's only where it says."""
        details = self.prompt_tokens_details
        cached = details.cached_tokens if details else None
        return Timings(
            cache_n=cached,
            prompt_n=self.prompt_tokens - (cached or 0),
            prompt_ms=prompt_ms,
            predicted_n=self.completion_tokens,
            predicted_ms=predicted_ms,
            block=block,
        )


class _Chunk(Loose):
    choices: list[_Choice] = []
    timings: Timings | None = None
    usage: Usage | None = None
    prompt_progress: PromptProgress | None = None
    error: object | None = None


_CHUNK = TypeAdapter(_Chunk)


class _Failing(Protocol):
    @property
    def error(self) -> object | None: ...


_C = TypeVar("_C", bound=_Failing)


def read_chunk(adapter: TypeAdapter[_C], data: str) -> _C:
    """One `data:` payload, read strictly; an error the server put in the stream raises."""
    try:
        chunk = adapter.validate_json(data)
    except ValidationError as e:
        raise StreamBroken(f"the server sent a chunk loopd cannot read: {data[:200]!r}") from e
    if chunk.error is not None:
        raise StreamErrorEvent(chunk.error)
    return chunk


@dataclass
class Clock:
    """When an answer began and when its first output came: the prompt's and the
    generation's time, for a server whose stream does not tell them (its `usage` has only
    counts). Measured by the client, so they include the network's time."""

    start: float = field(default_factory=time.monotonic)
    first: float | None = None

    def tick(self) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def ms(self) -> tuple[float, float]:
        """The prompt's and the generation's milliseconds, as far as they went."""
        now = time.monotonic()
        first = now if self.first is None else self.first
        return (first - self.start) * 1000, (now - first) * 1000


@dataclass
class _CallParts:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


@dataclass
class Assembler:
    """Feed it each `data:` payload; it returns the events to pass on and builds the answer."""

    thinking_cap: int | None = None
    repetition_cap: int | None = None
    """Characters of one piece of text said over and over after which the client ends the
    stream (`loopd.infer._repeat`); None: no such cut."""
    _content: list[str] = field(default_factory=list)
    _reasoning: list[str] = field(default_factory=list)
    _calls: dict[int, _CallParts] = field(default_factory=dict)
    _finish_reason: str | None = None
    _timings: Timings | None = None
    reasoning_tokens: int = 0
    thinking_capped: bool = False
    _loops: dict[str, Repetition] = field(default_factory=dict)
    _cut: str | None = None
    """Why the client ends the stream: `thinking_cap` or `repetition`."""
    done: bool = False
    """The stream said it is over (`[DONE]`)."""
    block: int | None = None
    """The server's cache grain, for figures read off `usage` (`Timings.block`)."""
    clock: Clock = field(default_factory=Clock)

    def feed(self, data: str) -> list[ChatEvent]:
        """One `data:` payload of the chat endpoint's stream."""
        if data == "[DONE]":
            self.done = True
            return self.finish()
        chunk = read_chunk(_CHUNK, data)
        events: list[ChatEvent] = []
        if (p := chunk.prompt_progress) is not None:
            events.append(Progress(total=p.total, cache=p.cache, processed=p.processed))
        if chunk.timings is not None:
            self._timings = chunk.timings
        elif chunk.usage is not None:  # a server other than llama-server: no `timings`
            self._timings = chunk.usage.timings(*self.clock.ms(), self.block)
        for choice in chunk.choices:
            if choice.delta is not None:
                self._feed_delta(choice.delta, events)
            if choice.finish_reason is not None:
                self._finish_reason = choice.finish_reason
        return events

    def _feed_delta(self, delta: _Delta, events: list[ChatEvent]) -> None:
        if reasoning := delta.reasoning_content or delta.reasoning:
            events += self.reasoning(reasoning)
        if delta.content:
            events += self.content(delta.content)
        for piece in delta.tool_calls or ():
            function = piece.function or _Function()
            events += self.call(piece.index, piece.id, function.name, function.arguments or "")

    # -- what any stream is made of: fed by this assembler's `feed`, or by `RawAssembler`'s
    # parser of `/completion`'s raw text --------------------------------------------------------

    def reasoning(self, text: str) -> list[ChatEvent]:
        """A piece of the model's reasoning."""
        self.clock.tick()
        events: list[ChatEvent] = [Reasoning(text=text)]
        self._reasoning.append(text)
        self.reasoning_tokens += 1
        self._watch("reasoning", text, events)
        return events

    def content(self, text: str) -> list[ChatEvent]:
        """A piece of the answer."""
        self.clock.tick()
        events: list[ChatEvent] = []
        self._reasoning_ended(events)
        self._content.append(text)
        events.append(Content(text=text))
        self._watch("content", text, events)
        return events

    def call(
        self, index: int, call_id: str | None, name: str | None, arguments: str
    ) -> list[ChatEvent]:
        """A piece of tool call `index`: its id and name come whole (and again whole if the
        parser revises them), its arguments in pieces."""
        self.clock.tick()
        events: list[ChatEvent] = []
        self._reasoning_ended(events)
        parts = self._calls.setdefault(index, _CallParts())
        if call_id:
            parts.id = call_id
        if name:
            parts.name = name
        parts.arguments.append(arguments)
        events.append(
            ToolCallDelta(index=index, id=call_id or None, name=name or None, arguments=arguments)
        )
        return events

    def end(self, finish_reason: str, timings: Timings | None) -> list[ChatEvent]:
        """The stream is over, as another reader of it found: its finish reason and figures."""
        self.done = True
        self._finish_reason, self._timings = finish_reason, timings
        return self.finish()

    def _reasoning_ended(self, events: list[ChatEvent]) -> None:
        """The server ends capped reasoning with the budget message: that is how we know."""
        cap = self.thinking_cap
        if cap is None or self.thinking_capped or not self._reasoning:
            return
        if "".join(self._reasoning[-8:]).endswith(BUDGET_MESSAGE):
            self.thinking_capped = True
            events.append(ThinkingCapped(cap=cap))

    def finish(self) -> list[ChatEvent]:
        """The stream ended: the events that only its end can tell."""
        events: list[ChatEvent] = []
        self._reasoning_ended(events)
        return events

    def _watch(self, stream: str, text: str, events: list[ChatEvent]) -> None:
        """Cut the stream once it says the same thing over and over (`repetition_cap`)."""
        if self.repetition_cap is None or self._cut is not None:
            return
        watch = self._loops.setdefault(stream, Repetition(self.repetition_cap))
        if (period := watch.feed(text)) is not None:
            self._cut = "repetition"
            events.append(Repeating(period=period, span=self.repetition_cap))

    def past_limit(self) -> list[ChatEvent] | None:
        """None while the stream is within bounds; once reasoning runs past the cap and the
        server's grace, or the answer loops (`Repeating` already passed on), the last events,
        and the client must end the stream."""
        if self._cut is not None:
            return []
        cap = self.thinking_cap
        if cap is None or self.reasoning_tokens <= cap + THINKING_CAP_GRACE:
            return None
        self._cut = "thinking_cap"
        if self.thinking_capped:
            return []
        self.thinking_capped = True
        return [ThinkingCapped(cap=cap)]

    def completion(self, *, cut_by_client: bool = False) -> Completion:
        return Completion(
            content="".join(self._content) if self._content else None,
            reasoning_content="".join(self._reasoning) if self._reasoning else None,
            tool_calls=tuple(
                ToolCall(id=c.id, name=c.name, arguments="".join(c.arguments))
                for _, c in sorted(self._calls.items())
            ),
            finish_reason=self._cut if cut_by_client and self._cut else self._finish_reason,
            timings=self._timings,
            reasoning_tokens=self.reasoning_tokens,
            thinking_capped=self.thinking_capped,
        )
