"""A token-exact request sent before the server has rendered its new message.

Each request renders the messages since the last answer with the server's template (a round
trip to the server before anything can be sent). After an answer without calls the next
request's rendering is the previous one's with the user's words changed: loopd keeps each
rendering with those words replaced by a marker (`Shapes`), sends the next request at once
from it, and renders the real one beside it (`send`). What the answer says is held
until the two are compared; where they differ (a template that trims the message, or reads
it), the guessed request is cancelled, nothing of it passed on, and the rendered one sent.
The question's record is made durable the same way, beside the request (`send`'s `first`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

import outcome
import trio

from loopd.backoff import Backoff
from loopd.infer import AnyRequest, ChatEvent, Completion, EventSink
from loopd.session.records import PromptRecord

__all__ = ["SAID", "Guessed", "Inference", "Request", "Shapes", "send"]


class Inference(Protocol):
    """What a turn needs of the model: a completion per try, the backoff between tries, and
    whether its server has answered once since loopd started (`Client.reached`)."""

    @property
    def retry(self) -> Backoff: ...

    @property
    def reached(self) -> bool: ...

    async def chat(
        self, request: AnyRequest, on_event: EventSink, *, sent: Callable[[], None] | None = None
    ) -> Completion: ...


SAID = "Sz7Said"
"""Stands for the user's words in a kept rendering."""

SHAPES_KEPT = 64
"""Conversations whose rendering is kept: one a session, as long as its answers make no
calls."""


class Shapes:
    """Renderings of conversations that end with a user message, by the conversation around
    that message's words."""

    def __init__(self) -> None:
        self._kept: dict[str, str] = {}
        self._tools: dict[int, tuple[tuple[dict[str, Any], ...], str]] = {}

    def tools(self, tools: tuple[dict[str, Any], ...]) -> str:
        """`tools` as a key holds them: dumped once for each tuple of them (a session's, while
        its baseline lasts), not again on the way to every first token."""
        kept = self._tools.get(id(tools))
        if kept is None or kept[0] is not tools:
            if len(self._tools) >= SHAPES_KEPT:
                del self._tools[next(iter(self._tools))]
            kept = self._tools[id(tools)] = (tools, json.dumps(tools, sort_keys=True))
        return kept[1]

    @staticmethod
    def key(conversation: list[dict[str, Any]], *context: Any) -> tuple[str, str] | None:
        """What a rendering is kept by, and the words it is kept without; None where the
        conversation does not end with a user's words."""
        last = conversation[-1] if conversation else {}
        said = last.get("content")
        if last.get("role") != "user" or not isinstance(said, str) or not said:
            return None
        shape = [*conversation[:-1], {**last, "content": SAID}]
        return json.dumps([shape, *context], sort_keys=True), said

    def guess(self, key: tuple[str, str]) -> str | None:
        kept = self._kept.get(key[0])
        return None if kept is None else kept.replace(SAID, key[1])

    def keep(self, key: tuple[str, str], rendered: str) -> None:
        """Kept where the words appear once, as written, and nothing else does."""
        name, said = key
        if rendered.count(said) != 1 or SAID in rendered:
            return
        if name not in self._kept and len(self._kept) >= SHAPES_KEPT:
            del self._kept[next(iter(self._kept))]
        self._kept[name] = rendered.replace(said, SAID)


Request = tuple[AnyRequest, PromptRecord | None]
"""A request, and the `prompt` record to append with its answer."""


class Guessed:
    """A request built from a guessed rendering, and its check: `check` renders the real one
    and returns None where the guess was right, else the request to send instead."""

    def __init__(self, request: Request, check: Callable[[], Awaitable[Request | None]]) -> None:
        self.request, self.check = request, check


class _Held:
    """Events held until `release`, then passed on as they come."""

    def __init__(self, on_event: EventSink) -> None:
        self.on_event = on_event
        self.events: list[ChatEvent] = []
        self.released = False

    def __call__(self, event: ChatEvent) -> None:
        if self.released:
            self.on_event(event)
        else:
            self.events.append(event)

    def release(self) -> None:
        self.released = True
        for event in self.events:
            self.on_event(event)


class _Before:
    """What is done before the answer is passed on, beside its request: the check of a guessed
    rendering, and the question made durable. The request is cancelled on an error of either
    (the turn's) or a wrong guess (nothing of it was passed on)."""

    def __init__(self, held: _Held, guess: trio.CancelScope) -> None:
        self.held, self.guess = held, guess
        self.started = False
        """The work beside the request started: once it was written (or could not be)."""
        self.checked: list[outcome.Outcome[Request | None]] = []
        self.durable: list[outcome.Outcome[None]] = []

    def start(
        self,
        nursery: trio.Nursery,
        check: Callable[[], Awaitable[Request | None]],
        first: Callable[[], Awaitable[None]] | None,
    ) -> None:
        """Start both, once: called when the request is written, so that neither task is made
        on the way to it and the server has it before their work."""
        if not self.started:
            self.started = True
            nursery.start_soon(self.check, check)
            nursery.start_soon(self.make_durable, first)

    async def check(self, check: Callable[[], Awaitable[Request | None]]) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()  # started as a cancelled request ended
        self.checked.append(await outcome.acapture(check))
        self._settle()

    async def make_durable(self, first: Callable[[], Awaitable[None]] | None) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        self.durable.append(await outcome.acapture(first) if first else outcome.Value(None))
        self._settle()

    def _settle(self) -> None:
        done = [*self.checked, *self.durable]
        if any(isinstance(o, outcome.Error) for o in done):
            self.guess.cancel()
        elif len(done) == 2:
            right = self.checked[0]
            if isinstance(right, outcome.Value) and right.value is None:
                self.held.release()
            else:
                self.guess.cancel()

    def right(self) -> Request | None:
        """The request to send instead of the guessed one, if any; raises what failed (first
        the question not made durable, whatever the check said)."""
        self.durable[0].unwrap()
        return self.checked[0].unwrap()


async def send(
    inference: Inference,
    request: Request | Guessed,
    on_event: EventSink,
    *,
    first: Callable[[], Awaitable[None]] | None = None,
) -> tuple[Completion, PromptRecord | None]:
    """The request's completion, and the `prompt` record to append with it. A guessed request
    is sent at once and checked while it goes; where the check finds another, that one's.
    `first` (the question made durable) runs while the request goes: nothing of the answer is
    passed on before it is done. Both start once the request is written (`inference.chat`'s
    `sent`), so the server has it before their work. An error of the check or of `first` is
    raised as it is."""
    if not isinstance(request, Guessed):
        if first is None:
            return await inference.chat(request[0], on_event), request[1]
        request = Guessed(request, _right)
    before = _Before(_Held(on_event), trio.CancelScope())
    answered: Completion | Exception | None = None
    async with trio.open_nursery() as nursery:
        start = partial(before.start, nursery, request.check, first)
        with before.guess:
            try:
                answered = await inference.chat(request.request[0], before.held, sent=start)
            except Exception as e:  # noqa: BLE001 - raised below, once the check is done
                answered = e
            finally:
                start()  # written or not, the request is over
    right = before.right()
    if right is not None:
        return await inference.chat(right[0], on_event), right[1]
    if isinstance(answered, Exception):
        raise answered
    assert answered is not None  # noqa: S101 - cancelled only for a wrong guess
    return answered, request.request[1]


async def _right() -> None:
    """The check of a request that was not guessed."""
