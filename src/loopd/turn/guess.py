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
from typing import TYPE_CHECKING, Any

import outcome
import trio

from loopd.infer import AnyRequest, ChatEvent, Completion, EventSink
from loopd.session.records import PromptRecord

if TYPE_CHECKING:
    from loopd.turn.loop import Inference

__all__ = ["SAID", "Guessed", "Request", "Shapes", "send"]

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


async def send(
    inference: Inference,
    request: Request | Guessed,
    on_event: EventSink,
    *,
    first: Callable[[], Awaitable[None]] | None = None,
) -> tuple[Completion, PromptRecord | None]:
    """The request's completion, and the `prompt` record to append with it. A guessed request
    is sent at once while it is checked; where the check finds another, that one's. `first`
    (the question made durable) runs while the request goes: nothing of the answer is passed
    on before it is done. An error of the check or of `first` is raised as it is."""
    if not isinstance(request, Guessed):
        if first is None:
            return await inference.chat(request[0], on_event), request[1]
        request = Guessed(request, _right)
    held = _Held(on_event)
    guess = trio.CancelScope()
    checked: list[outcome.Outcome[Request | None]] = []

    async def check() -> None:
        checked.append(await outcome.acapture(_before_output, request.check, first))
        if isinstance(checked[0], outcome.Value) and checked[0].value is None:
            held.release()
        else:
            guess.cancel()  # nothing of it was passed on

    answered: Completion | Exception | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(check)  # as the request waits: it goes first
        with guess:
            try:
                answered = await inference.chat(request.request[0], held)
            except Exception as e:  # noqa: BLE001 - raised below, once the check is done
                answered = e
    right = checked[0].unwrap()
    if right is not None:
        return await inference.chat(right[0], on_event), right[1]
    if isinstance(answered, Exception):
        raise answered
    assert answered is not None  # noqa: S101 - cancelled only for a wrong guess
    return answered, request.request[1]


async def _before_output(
    check: Callable[[], Awaitable[Request | None]], first: Callable[[], Awaitable[None]] | None
) -> Request | None:
    right = await check()
    if first is not None:
        await first()
    return right


async def _right() -> None:
    """The check of a request that was not guessed."""
