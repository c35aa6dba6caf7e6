"""Asking an actor: a message with a reply channel, and the answer (or its error) back."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

import outcome
import trio

__all__ = ["Reply", "ask", "reply_error", "reply_value"]

T = TypeVar("T")
M = TypeVar("M")

Reply = trio.MemorySendChannel[outcome.Outcome[T]]


async def ask(inbox: trio.MemorySendChannel[M], build: Callable[[Reply[T]], M]) -> T:
    """Send the message `build` makes and wait for its answer; an error comes back raised."""
    send, receive = trio.open_memory_channel[outcome.Outcome[T]](1)
    await inbox.send(build(send))
    async with receive:
        return (await receive.receive()).unwrap()


def reply_value(reply: Reply[T], value: T) -> None:
    _reply(reply, outcome.Value(value))


def reply_error(reply: Reply[T], error: Exception) -> None:
    _reply(reply, outcome.Error(error))


def _reply(reply: Reply[T], answer: outcome.Outcome[T]) -> None:
    with contextlib.suppress(trio.BrokenResourceError, trio.WouldBlock):  # the asker left
        reply.send_nowait(answer)
