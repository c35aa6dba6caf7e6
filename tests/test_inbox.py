"""Asking an actor (`loopd.inbox.ask`): the answer or its error back, nothing sent by an asker
cancelled already, and no scheduling pass beyond the wait for the answer."""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from loopd.inbox import Reply, ask, reply_error, reply_value
from support.steps import counted_steps

Inbox = tuple[trio.MemorySendChannel[Reply[int]], trio.MemoryReceiveChannel[Reply[int]]]


async def answer_all(inbox: trio.MemoryReceiveChannel[Reply[int]], value: int | None) -> None:
    async for reply in inbox:
        if value is None:
            reply_error(reply, ValueError("no"))
        else:
            reply_value(reply, value)


async def test_the_answer_and_an_error_come_back() -> None:
    send, receive = trio.open_memory_channel[Reply[int]](math.inf)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_all, receive, 7)
        assert await ask(send, lambda reply: reply) == 7
        nursery.cancel_scope.cancel()
    send, receive = trio.open_memory_channel[Reply[int]](math.inf)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_all, receive, None)
        with pytest.raises(ValueError, match="no"):
            await ask(send, lambda reply: reply)
        nursery.cancel_scope.cancel()


async def test_an_answer_costs_the_asker_one_pass_of_the_loop() -> None:
    send, receive = trio.open_memory_channel[Reply[int]](math.inf)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_all, receive, 7)
        await trio.testing.wait_all_tasks_blocked()
        with counted_steps() as steps:
            assert await ask(send, lambda reply: reply) == 7
        nursery.cancel_scope.cancel()
    # Woken once, by the answer: the send and the reply channel's closing do not yield.
    assert steps.count == 1


async def test_an_asker_cancelled_already_sends_nothing() -> None:
    send, receive = trio.open_memory_channel[Reply[int]](math.inf)
    with trio.CancelScope() as scope:
        scope.cancel()
        await ask(send, lambda reply: reply)
    assert scope.cancelled_caught
    assert receive.statistics().current_buffer_used == 0


async def test_a_full_bounded_inbox_is_waited_for() -> None:
    send, receive = trio.open_memory_channel[Reply[int]](0)
    async with trio.open_nursery() as nursery:
        asked = trio.Event()

        async def asker() -> None:
            assert await ask(send, lambda reply: reply) == 3
            asked.set()

        nursery.start_soon(asker)
        await trio.testing.wait_all_tasks_blocked()
        reply_value(await receive.receive(), 3)
        await asked.wait()


async def test_an_answer_sent_as_the_asker_is_cancelled_goes_to_its_orphan_handler() -> None:
    send, receive = trio.open_memory_channel[Reply[int]](math.inf)
    orphans: list[int] = []
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:

            async def asker() -> None:
                await ask(send, lambda reply: reply, orphan=orphans.append)

            nursery.start_soon(asker)
            reply = await receive.receive()
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()  # takes the asker off its channel; then, in the same pass:
            reply_value(reply, 5)
    assert orphans == [5]
