"""One connection's outbox, without a socket: the bound on what waits for a client, and the
last word before a close, which passes that bound."""

from __future__ import annotations

from typing import Any

import trio

from loopd.channel._connection import Connection
from loopd.channel._handlers import DaemonInfo
from loopd.config import ChannelConfig
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
