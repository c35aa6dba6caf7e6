"""One client's connection: JSON lines in and out, and nothing else.

A reader (the connection's own task) frames lines and hands each parsed message to the
handlers; a writer sends what waits in a bounded outbox (a line said while nothing waits is
written at once, as far as the socket takes it); a relay passes on the session's events the
client may see (while it waits for one, the session's task hands the next over itself). A
client that sends garbage gets an `error` line and can go on; one that sends a line over the
cap, or keeps sending garbage, is closed; one that stops reading is dropped when its outbox is
full. None of it reaches the session or another client.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import trio
from pydantic import ValidationError

from loopd.actors import Core, Subscription, SubscriptionItem
from loopd.config import ChannelConfig
from loopd.wire import proto
from loopd.wire.lines import TooLong
from loopd.wire.reader import LineReader

from ._handlers import Client, DaemonInfo, handle

__all__ = ["BAD_LINES", "GOODBYE_GRACE", "Connection"]

log = logging.getLogger(__name__)

BAD_LINES = 20
"""Bad lines in a row before a connection is closed as abusive."""
GOODBYE_GRACE = 1.0
REF_CAP = 200
"""The longest `ref` echoed (as `proto`'s own cap): a refused line's is not checked by it."""


@dataclass(eq=False)  # kept in a set by identity
class Connection:
    number: int
    stream: trio.SocketStream
    core: Core
    info: DaemonInfo
    config: ChannelConfig

    def __post_init__(self) -> None:
        # Lines waiting for the client: one that falls `subscriber_buffer` behind has stopped
        # reading. The channel holds one more, so the last word before a close (`lagged`,
        # `line_too_long`, `bye`) reaches even a client whose outbox is full.
        self.outbox, self._outgoing = trio.open_memory_channel[bytes](
            self.config.subscriber_buffer + 1
        )
        self._waiting_bytes = 0
        """Bytes in the outbox: one `history` line can be large, so lines alone do not bound it."""
        self._unsent = 0
        """Lines queued and not yet written: while one is, a line written at once would pass it."""
        self._writer_waiting = False
        """The writer waits for a line: one said now can be written at once (`_write_now`)."""
        self.client = Client(
            self.core,
            self.info,
            self.say,
            prefix=f"{self.number}/",
            buffer=self.config.subscriber_buffer,
        )
        self.done = trio.Event()

    def say(self, message: proto.DaemonMessage, *, last: bool = False) -> None:
        """Queue a line; a client that stopped reading is dropped. `last`: the line before
        the outbox closes, queued past the bounds."""
        line = proto.dump(message)
        if self._unsent == 0 and self._writer_waiting:
            line = line[self._write_now(line) :]
            if not line:
                return
        full = self.outbox.statistics().current_buffer_used >= self.config.subscriber_buffer
        if not last and (full or self._waiting_bytes + len(line) > self.config.outbox_bytes):
            self._drop()
            return
        try:
            self.outbox.send_nowait(line)
        except trio.WouldBlock:
            self._drop()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        else:
            self._waiting_bytes += len(line)
            self._unsent += 1

    def _write_now(self, line: bytes) -> int:
        """How much of `line` the socket took at once, without waiting: what the writer would
        send a scheduling pass later, on the way to every first token. An error is left for
        the writer, whose `send_all` meets it again and ends the connection."""
        try:
            return os.write(self.stream.socket.fileno(), line)
        except OSError:  # BlockingIOError too: the client is not reading
            return 0

    def _drop(self) -> None:
        log.warning("connection %d stopped reading; dropping it", self.number)
        self.done.set()

    def close_with(self, message: proto.DaemonMessage) -> None:
        """Say `message` last: the writer sends what waits, then it, then ends."""
        self.say(message, last=True)
        self.outbox.close()

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write)
                nursery.start_soon(self._relay)
                nursery.start_soon(self._read)
                await self.done.wait()
                nursery.cancel_scope.cancel()
        finally:
            if self.client.session is not None:
                await self.client.leave(self.client.session, self.client.subscription)
            with trio.CancelScope(shield=True), trio.move_on_after(GOODBYE_GRACE):
                await self.stream.aclose()

    async def _write(self) -> None:
        try:
            async with self._outgoing:
                while True:
                    self._writer_waiting = True
                    try:
                        line = await self._outgoing.receive()
                    finally:
                        self._writer_waiting = False
                    self._waiting_bytes -= len(line)
                    await self.stream.send_all(line)
                    self._unsent -= 1
        except (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.done.set()

    async def _relay(self) -> None:
        """The events of the client's session, of whichever it is in now."""
        current: Subscription | None = None
        while True:
            while self.client.subscription is current:
                await self.client.moved.wait()
            current = self.client.subscription
            assert current is not None  # noqa: S101 - a move always leaves one
            current.direct = self._show
            async for published in current.receive:
                self._show(published)
            if current.lagged:
                self.close_with(
                    proto.Error(
                        code="lagged",
                        message="you fell behind the turn's events; read the history to catch up",
                    )
                )
                return

    def _show(self, published: SubscriptionItem) -> None:
        """Say an event of the session, if the client may see it. Called by the session's
        task too (`Subscription.direct`): a bug here ends this connection, never the turn."""
        try:
            if message := self.client.shown(published):
                self.say(message)
        except Exception:
            log.exception("connection %d: an event could not be shown", self.number)
            self.done.set()

    async def _read(self) -> None:
        lines = LineReader(self.stream, self.config.max_line)
        bad = 0
        try:
            while (line := await lines.next()) is not None:
                if isinstance(line, TooLong):
                    message = f"a line may be at most {line.cap} bytes"
                    self.close_with(proto.Error(code="line_too_long", message=message))
                    return
                error = await self._take(line)
                bad = bad + 1 if error else 0
                if error:
                    self.say(error)
                if bad >= BAD_LINES:
                    self.close_with(proto.Bye(reason=f"{BAD_LINES} bad lines in a row"))
                    return
        finally:
            # No more answers: the writer sends what is queued (a last error, a bye), then ends.
            self.outbox.close()

    async def _take(self, line: bytes) -> proto.Error | None:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            return proto.Error(code="bad_utf8", message="lines must be UTF-8")
        try:
            message = proto.CLIENT_MESSAGE.validate_json(text)
        except ValidationError as e:
            error = _describe(e)
            ref = _ref_in(text)
            return error if ref is None else error.model_copy(update={"ref": ref})
        return await handle(self.client, message)


def _ref_in(text: str) -> str | None:
    """The `ref` of a line that is no valid message, where it names one: so the client can
    tell which of its requests was refused."""
    try:
        fields = json.loads(text)
    except (ValueError, RecursionError):
        return None
    ref = fields.get("ref") if isinstance(fields, dict) else None
    return ref if isinstance(ref, str) and 0 < len(ref) <= REF_CAP else None


def _describe(error: ValidationError) -> proto.Error:
    first = error.errors()[0]
    kind, loc = first["type"], ".".join(str(p) for p in first["loc"])
    if kind == "json_invalid":
        return proto.Error(code="bad_json", message=f"not JSON: {first['msg']}")
    if kind in ("model_type", "model_attributes_type") or (kind == "dict_type" and not loc):
        return proto.Error(code="not_object", message="each line must be a JSON object")
    if kind == "union_tag_not_found":
        return proto.Error(code="bad_message", message="missing field: type")
    if kind == "union_tag_invalid":
        return proto.Error(
            code="unknown_type", message=f"unknown type: {first['input'].get('type')!r}"
        )
    return proto.Error(code="bad_message", message=f"{loc}: {first['msg']}")
