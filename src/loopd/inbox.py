"""Asking an actor, and answering: a message with a reply channel, and the answer (or its
error) back. Used by every actor (`loopd.actors`, the tool port)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import outcome
import trio

__all__ = ["Reply", "ask", "reply_error", "reply_value", "run_for"]

T = TypeVar("T")
M = TypeVar("M")

Reply = trio.MemorySendChannel[outcome.Outcome[T]]


async def ask(
    inbox: trio.MemorySendChannel[M],
    build: Callable[[Reply[T]], M],
    *,
    orphan: Callable[[T], None] | None = None,
) -> T:
    """Send the message `build` makes and wait for its answer; an error comes back raised.
    `orphan`: what becomes of an answer that came while the asker was being cancelled (a
    slot the pool lent it must be given back), which would otherwise be lost.

    The wait for the answer is the only scheduling point: `await inbox.send` and `async with`
    would each add a pass of trio's loop, on the way to every turn's request."""
    await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled asker sends nothing
    send, receive = trio.open_memory_channel[outcome.Outcome[T]](1)
    message = build(send)
    with receive:
        try:
            inbox.send_nowait(message)
        except trio.WouldBlock:  # a bounded inbox that is full
            await inbox.send(message)
        try:
            return (await receive.receive()).unwrap()
        except BaseException:
            # A cancel takes the asker off the channel at once: an answer sent after it, in
            # the same pass of trio's loop, waits in the channel, unread.
            late = _unread(receive)
            if orphan is not None and isinstance(late, outcome.Value):
                orphan(late.value)
            raise


def _unread(receive: trio.MemoryReceiveChannel[outcome.Outcome[T]]) -> outcome.Outcome[T] | None:
    try:
        return receive.receive_nowait()
    except (trio.WouldBlock, trio.EndOfChannel):
        return None


def reply_value(reply: Reply[T], value: T) -> None:
    answer(reply, outcome.Value(value))


def reply_error(reply: Reply[T], error: Exception) -> None:
    answer(reply, outcome.Error(error))


def answer(reply: trio.MemorySendChannel[M], message: M) -> None:
    """Send without waiting; an asker that left is no error."""
    with contextlib.suppress(trio.BrokenResourceError, trio.WouldBlock):
        reply.send_nowait(message)


async def run_for(
    scope: trio.CancelScope,
    work: Callable[[], Awaitable[T]],
    send: Callable[[outcome.Outcome[T]], None],
) -> None:
    """Do a job for a caller who holds `scope`: nothing if it gave up already, else `work`
    under that scope (its cancel ends the work at once), its outcome sent back as it is."""
    if scope.cancel_called:
        return
    with scope:
        result: outcome.Outcome[T]
        try:
            result = outcome.Value(await work())
        except Exception as e:  # noqa: BLE001 - the caller gets it, typed as it was
            result = outcome.Error(e)
        send(result)
