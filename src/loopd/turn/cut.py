"""An answer cut short as it streamed is kept, as far as it came.

A cancel (Ctrl-C, an editor's `session/cancel`, every client gone), the turn's deadline
(`[loop] turn_timeout`) or a server whose stream broke after output ends a request without its
answer. The person saw what streamed, and llama-server's slot holds the prompt and the tokens
generated until then. So the turn records it the way an answer cut by `max_tokens` is
recorded: its `prompt` record (token-exact history), an `assistant` record with the text and
token ids that came (`ended` false) and `cut` saying what cut it, and a `usage` record whose
figures are the prompt's as the server's last progress told them and the tokens that came.
The next request extends those tokens like any answer's, and the model sees what it had said.

Nothing that never streamed is invented: text the parser still held (a delimiter, a call
begun) stays in the tokens alone. A tool call is kept only whole, and a cut answer's calls are
never run: the turn's close answers each "Not run: the turn ended first (...)", so the log stays
a valid conversation. A call the model had begun is not a call: its text is in the tokens (the
model sees what it wrote), and nothing is left waiting for a result. An answer cut inside its
reasoning keeps the reasoning, with no content, as one cut by the thinking cap does.

The client hands over the answer as far as it came (`Client.chat`'s `cut`), synchronously, as
its read ends; the records are written in the turn's shielded close, within a bound.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from loopd.backoff import Backoff
from loopd.infer import (
    AnyRequest,
    ChatEvent,
    Completion,
    Cut,
    EventSink,
    Progress,
    Timings,
    is_output,
)
from loopd.session.records import (
    AssistantRecord,
    CutReason,
    PromptRecord,
    TurnEndReason,
    UnreadRecord,
    UsageRecord,
)
from loopd.session.store import Session
from loopd.turn.guess import Guessed, Request
from loopd.turn.guess import Inference as Sending

__all__ = ["KEEP_GRACE", "CutAnswers", "Inference"]


class Inference(Sending, Protocol):
    """What a turn needs of the model (what `guess.send` needs), and a request's answer as far
    as it came where its stream ends without one (`cut`, `loopd.infer.Cut`)."""

    async def chat(
        self,
        request: AnyRequest,
        on_event: EventSink,
        *,
        sent: Callable[[], None] | None = None,
        cut: Cut | None = None,
    ) -> Completion: ...


KEEP_GRACE = 5.0
"""Seconds the records of a cut answer may take (a few fsyncs); a close must never hang."""

_CUT_BY: dict[TurnEndReason, CutReason] = {
    "cancelled": "cancelled",
    "turn_limit": "turn_limit",
    "error": "error",
}


@dataclass
class _Cut:
    completion: Completion
    prompt: PromptRecord | None
    timings: Timings | None


class CutAnswers:
    """Watches a turn's requests: which is under way, with what `prompt` record, and, where
    its stream ended without an answer, that answer as far as it came (`keep` records it)."""

    def __init__(self) -> None:
        self._prompts: dict[int, tuple[AnyRequest, PromptRecord | None]] = {}
        self.cut: _Cut | None = None
        """The request under way was cut, and this is what came; None after any other end."""

    def expect(self, request: Request | Guessed) -> Request | Guessed:
        """`request` as it will be sent: its `prompt` record is known by the request, and so is
        the one a guess's check sends instead."""
        if not isinstance(request, Guessed):
            self._prompts = {id(request[0]): request}
            return request
        self._prompts = {id(request.request[0]): request.request}
        check = request.check

        async def checked() -> Request | None:
            right = await check()
            if right is not None:
                self._prompts[id(right[0])] = right
            return right

        return Guessed(request.request, checked)

    def on(self, inference: Inference) -> Sending:
        """`inference`, its requests watched."""
        return _Watched(inference, self)

    def prompt_of(self, request: AnyRequest) -> PromptRecord | None:
        """The `prompt` record to append with `request`'s answer."""
        sent, record = self._prompts.get(id(request), (None, None))
        return record if sent is request else None

    async def keep(self, session: Session, reason: TurnEndReason, *, shown: bool) -> None:
        """Record the answer cut as the turn ended, if one was and part of it was `shown`
        (passed on to the clients); shielded by the caller, bounded here."""
        cut, self.cut = self.cut, None
        if cut is None or not shown or (by := _CUT_BY.get(reason)) is None:
            return
        c = cut.completion
        with trio.move_on_after(KEEP_GRACE):
            if cut.prompt is not None:
                await session.append(cut.prompt)
            await session.append(AssistantRecord.of(c, cut=by))
            if c.unread is not None:
                await session.append(UnreadRecord(text=c.unread.text, error=c.unread.error))
            await session.append(
                UsageRecord(
                    timings=cut.timings,
                    reasoning_tokens=c.reasoning_tokens,
                    thinking_capped=c.thinking_capped,
                )
            )


class _Watched:
    """An `Inference` whose each request's cut answer goes to its `CutAnswers`."""

    def __init__(self, inference: Inference, answers: CutAnswers) -> None:
        self.inference, self.answers = inference, answers

    @property
    def retry(self) -> Backoff:
        return self.inference.retry

    @property
    def reached(self) -> bool:
        return self.inference.reached

    async def chat(
        self,
        request: AnyRequest,
        on_event: EventSink,
        *,
        sent: Callable[[], None] | None = None,
        cut: Cut | None = None,
    ) -> Completion:
        answers = self.answers
        answers.cut = None  # a new try: whatever an earlier one left is not this answer
        figures = _Figures()

        def seen(event: ChatEvent) -> None:
            figures.see(event)
            on_event(event)

        def keep(completion: Completion) -> None:
            whole = _whole_calls(completion)
            answers.cut = _Cut(whole, answers.prompt_of(request), figures.timings(whole))
            if cut is not None:
                cut(completion)

        return await self.inference.chat(request, seen, sent=sent, cut=keep)


class _Figures:
    """What a cut stream told of its cost: the prompt's last progress, the output's time."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.first: float | None = None
        self.progress: Progress | None = None
        self.pieces = 0

    def see(self, event: ChatEvent) -> None:
        if isinstance(event, Progress):
            self.progress = event
        elif is_output(event):
            self.pieces += 1
            self.first = self.first or time.monotonic()

    def timings(self, c: Completion) -> Timings | None:
        """The server's figures for the prompt, and the tokens that came (llama-server streams
        a token a piece); None where it told no progress (the prompt's size is unknown)."""
        if (p := self.progress) is None:
            return None
        now = time.monotonic()
        first = self.first or now
        generated = len(c.tokens) if c.tokens is not None else self.pieces
        return Timings(
            cache_n=p.cache,
            prompt_n=p.total - p.cache,
            prompt_ms=(first - self.start) * 1000,
            predicted_n=generated,
            predicted_ms=(now - first) * 1000,
        )


def _whole_calls(c: Completion) -> Completion:
    """`c` with its whole tool calls alone. On the chat endpoint a call streams in pieces, and
    one cut before its arguments close is not a call; a token-exact answer's parser gives only
    whole calls."""
    if c.tokens is not None or not c.tool_calls:
        return c
    return c.model_copy(update={"tool_calls": tuple(t for t in c.tool_calls if _json(t.arguments))})


def _json(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except (ValueError, RecursionError):  # nested too deep is no call loopd can run either
        return False
    return True
