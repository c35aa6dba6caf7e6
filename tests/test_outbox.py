"""One connection's outbox: the bound on what waits for a client, and the last word before a
close, which passes that bound (without a socket); a line written at once while nothing waits,
and the order of lines kept when the socket is full (a real socket pair); a session's event
handed over to a relay that waits, in order, a bug there ending the connection alone."""

from __future__ import annotations

import socket
from contextlib import suppress
from typing import Any

import trio
import trio.testing

from loopd.actors import Published, Subscription
from loopd.channel._connection import Connection
from loopd.channel._handlers import DaemonInfo
from loopd.config import ChannelConfig
from loopd.infer import Content
from loopd.wire import proto


def connection(buffer: int) -> Connection:
    """Only the outbox is used: no stream, no core."""
    config = ChannelConfig(subscriber_buffer=buffer)
    nothing: Any = None
    return Connection(1, nothing, nothing, DaemonInfo("http://llama", None), config)


def waiting(c: Connection) -> list[str]:
    lines: list[str] = []
    while True:
        try:
            lines.append(proto.DAEMON_MESSAGE.validate_json(c._outgoing.receive_nowait()).type)
        except (trio.WouldBlock, trio.EndOfChannel):
            return lines


def test_a_client_that_lets_more_lines_wait_than_the_buffer_is_dropped() -> None:
    c = connection(2)
    c.say(proto.Bye(reason="one"))
    c.say(proto.Bye(reason="two"))
    assert not c.done.is_set()
    c.say(proto.Bye(reason="three"))
    assert c.done.is_set()
    assert waiting(c) == ["bye", "bye"]


def test_the_last_word_reaches_a_client_whose_outbox_is_full() -> None:
    c = connection(2)
    c.say(proto.Bye(reason="one"))
    c.say(proto.Bye(reason="two"))
    c.close_with(proto.Error(code="lagged", message="you fell behind"))
    assert not c.done.is_set()
    assert waiting(c) == ["bye", "bye", "error"]


def connected(buffer: int) -> tuple[Connection, socket.socket]:
    """A connection on one end of a real socket pair; the client's end, not read from yet."""
    ours, theirs = socket.socketpair()
    config = ChannelConfig(subscriber_buffer=buffer)
    nothing: Any = None
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
    return Connection(1, stream, nothing, DaemonInfo("http://llama", None), config), theirs


async def test_a_line_said_while_nothing_waits_is_on_the_socket_before_say_returns() -> None:
    """No pass of the scheduler between an event and its line: the first token's way out."""
    c, theirs = connected(8)
    theirs.setblocking(False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        await trio.testing.wait_all_tasks_blocked()
        c.say(proto.Bye(reason="now"))
        assert proto.DAEMON_MESSAGE.validate_json(theirs.recv(65536)) == proto.Bye(reason="now")
        nursery.cancel_scope.cancel()
    theirs.close()


async def test_lines_keep_their_order_when_the_socket_fills_midway() -> None:
    """Lines written at once, lines that wait, and a line the socket took only part of reach
    the client whole and in the order they were said."""
    c, theirs = connected(4096)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.stream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    said = [proto.Bye(reason=f"{n}:" + "x" * (n * 97 % 3000)) for n in range(400)]
    received = bytearray()
    theirs.setblocking(False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        await trio.testing.wait_all_tasks_blocked()
        for n, message in enumerate(said):
            c.say(message)
            # The client reads as lines are said: room on the socket while a line waits.
            with suppress(BlockingIOError):
                received += theirs.recv(2048)
            if n % 50 == 49:  # the writer sends some of what waits, then more is said
                await trio.lowlevel.checkpoint()
        assert not c.done.is_set()
        while received.count(b"\n") < len(said):
            await trio.sleep(0.001)
            with suppress(BlockingIOError):
                received += theirs.recv(1 << 20)
        nursery.cancel_scope.cancel()
    theirs.close()
    lines = [proto.DAEMON_MESSAGE.validate_json(line) for line in received.splitlines()]
    assert lines == said


def content(n: int) -> Published:
    return Published(f"1/t{n}", Content(text=f"piece {n}"))


def received_lines(theirs: socket.socket) -> list[proto.DaemonMessage]:
    data = bytearray()
    with suppress(BlockingIOError):
        while chunk := theirs.recv(65536):
            data += chunk
    return [proto.DAEMON_MESSAGE.validate_json(line) for line in data.splitlines()]


async def test_an_event_offered_while_the_relay_waits_is_on_the_socket_before_offer_returns() -> (
    None
):
    """The session's task hands the event to the waiting relay itself: no pass of trio's loop
    between a token and its line."""
    c, theirs = connected(8)
    theirs.setblocking(False)
    c.client.subscription = subscription = Subscription(8)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        await trio.testing.wait_all_tasks_blocked()
        assert subscription.offer(content(1))
        assert received_lines(theirs) == [proto.Event(id="t1", event=Content(text="piece 1"))]
        nursery.cancel_scope.cancel()
    theirs.close()


async def test_events_queued_before_the_relay_waits_come_before_one_handed_over() -> None:
    c, theirs = connected(8)
    theirs.setblocking(False)
    c.client.subscription = subscription = Subscription(8)
    assert subscription.offer(content(1))
    assert subscription.offer(content(2))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        await trio.testing.wait_all_tasks_blocked()
        assert subscription.offer(content(3))
        lines = received_lines(theirs)
        nursery.cancel_scope.cancel()
    theirs.close()
    assert [line.id for line in lines if isinstance(line, proto.Event)] == ["t1", "t2", "t3"]


async def test_a_bug_showing_an_event_ends_the_connection_not_the_session_that_offered_it() -> None:
    c, theirs = connected(8)
    c.client.subscription = subscription = Subscription(8)

    def broken(_: object) -> None:
        raise RuntimeError("a bug")

    c.client.shown = broken  # type: ignore[method-assign,assignment]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(c.run)
        await trio.testing.wait_all_tasks_blocked()
        assert subscription.offer(content(1))  # raised nothing into the session's task
        assert c.done.is_set()
        nursery.cancel_scope.cancel()
    theirs.close()
