"""The channel: a Unix socket where clients send user messages and watch turns, in JSON lines.

The socket is made 0600 in a 0700 directory, bound under a temporary name and renamed into
place; a stale socket of a dead daemon is replaced, a live one is left alone. Each connection
has a reader (this task), a writer fed by a bounded outbox, and a relay from the session
actor's events. A client that sends garbage gets an `error` line and can go on; one that sends
a line over the cap, or keeps sending garbage, is closed; one that stops reading is dropped
when its outbox is full. None of it reaches the session or another client.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import socket as stdsocket
import stat
from dataclasses import dataclass
from pathlib import Path

import trio
from pydantic import ValidationError

from loopd import __version__, proto
from loopd.actors import Busy, Core, Published, Subscription, TurnDone, TurnFailed
from loopd.baseline import make_baseline
from loopd.config import Config
from loopd.exact import past_reasoning
from loopd.infer import slot_tokens
from loopd.store import Store

__all__ = ["ChannelServer", "DaemonRunning", "UnixSocket", "UnsafeSocket", "open_socket"]

log = logging.getLogger(__name__)

BAD_LINES = 20
"""Bad lines in a row before a connection is closed as abusive."""
HISTORY_PAGE = 500
GOODBYE_GRACE = 1.0


class UnsafeSocket(Exception):
    """The socket's folder could let another user in; loopd will not listen there."""


class DaemonRunning(Exception):
    """A live daemon already listens on the socket."""


def _private_directory(path: Path) -> bool:
    """Make the socket's directory 0700; whether a socket is already there. A directory that
    is a link or another user's is refused: whoever owns it could put their own socket there
    and read what clients send (a shared /tmp lets anyone create the folder first)."""
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.lstat()
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeSocket(f"{directory} is a symbolic link; loopd's socket needs a real folder")
    if info.st_uid != os.getuid():
        raise UnsafeSocket(
            f"{directory} belongs to another user (uid {info.st_uid}); set [channel] socket to "
            "a path in a folder of your own"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        directory.chmod(0o700)
    return path.exists() or path.is_symlink()


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


@dataclass
class UnixSocket:
    path: Path
    listener: trio.SocketListener
    inode: int
    """The socket file's inode when bound: it is unlinked on close only if it is still ours."""

    async def aclose(self) -> None:
        with contextlib.suppress(OSError):
            if self.path.stat().st_ino == self.inode:
                self.path.unlink()
        await self.listener.aclose()


async def open_socket(path: Path) -> UnixSocket:
    """Listen on `path`: 0600, in a 0700 directory, replacing only a stale socket."""
    if _private_directory(path):
        probe = trio.socket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
        try:
            await probe.connect(str(path))
        except OSError as e:
            if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise
            log.info("replacing the stale socket %s", path)
            _unlink(path)
        else:
            raise DaemonRunning(f"a loopd daemon already runs at {path}")
        finally:
            probe.close()
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    _unlink(staging)
    sock = trio.socket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
    await sock.bind(str(staging))
    inode = _publish(staging, path)
    sock.listen(64)
    return UnixSocket(path, trio.SocketListener(sock), inode)


def _publish(staging: Path, path: Path) -> int:
    staging.chmod(0o600)
    inode = staging.stat().st_ino
    staging.rename(path)
    return inode


@dataclass
class ChannelServer:
    core: Core
    store: Store
    config: Config
    server_url: str
    model: str | None = None

    def __post_init__(self) -> None:
        self._connections: set[_Connection] = set()
        self._ids = itertools.count(1)

    async def serve(self, listener: trio.SocketListener) -> None:
        await trio.serve_listeners(self._handle, [listener])

    async def _handle(self, stream: trio.SocketStream) -> None:
        if len(self._connections) >= self.config.channel.max_clients:
            await _refuse(stream, self.config.channel.max_clients)
            return
        connection = _Connection(self, next(self._ids), stream)
        self._connections.add(connection)
        try:
            await connection.run()
        except Exception:
            log.exception("connection %d failed", connection.number)
        finally:
            self._connections.discard(connection)

    async def goodbye(self, reason: str) -> None:
        """Tell every client the daemon is going, and give their writers a moment."""
        for connection in list(self._connections):
            connection.close_with(proto.Bye(reason=reason))
        with trio.move_on_after(GOODBYE_GRACE):
            while self._connections:  # noqa: ASYNC110 - connections end on their own
                await trio.sleep(0.01)


async def _refuse(stream: trio.SocketStream, cap: int) -> None:
    message = f"loopd serves at most {cap} clients at once ([channel] max_clients)"
    with trio.move_on_after(GOODBYE_GRACE):
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(proto.dump(proto.Error(code="too_many_clients", message=message)))
        await stream.aclose()


class _LineTooLong(Exception):
    pass


class _Lines:
    """Bytes in, whole non-blank lines out; a line over the cap is refused as soon as it is
    known to be one, before more of it is buffered."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self.buffer += data
        lines = []
        while (newline := self.buffer.find(b"\n")) >= 0:
            line = bytes(self.buffer[:newline])
            del self.buffer[: newline + 1]
            if len(line) > self.cap:
                raise _LineTooLong
            if line.strip():
                lines.append(line)
        if len(self.buffer) > self.cap:
            raise _LineTooLong
        return lines


class _Connection:
    def __init__(self, server: ChannelServer, number: int, stream: trio.SocketStream) -> None:
        self.server, self.number, self.stream = server, number, stream
        # Lines waiting for the client: one that falls this far behind has stopped reading.
        buffer = server.config.channel.subscriber_buffer
        self.outbox, self._outgoing = trio.open_memory_channel[bytes](buffer)
        self._waiting_bytes = 0
        """Bytes in the outbox: one `history` line can be large, so lines alone do not bound it."""
        self.watch_all = False
        self.prefix = f"{number}/"
        self.subscription: Subscription | None = None
        self.done = trio.Event()

    def say(self, message: proto.DaemonMessage) -> None:
        """Queue a line; a client that stopped reading is dropped."""
        line = proto.dump(message)
        if self._waiting_bytes + len(line) > self.server.config.channel.outbox_bytes:
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

    def _drop(self) -> None:
        log.warning("connection %d stopped reading; dropping it", self.number)
        self.done.set()

    def close_with(self, message: proto.DaemonMessage) -> None:
        self.say(message)
        self.outbox.close()

    async def run(self) -> None:
        actor = self.server.core.session
        self.subscription = actor.subscribe(self.server.config.channel.subscriber_buffer)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write)
            nursery.start_soon(self._relay, self.subscription)
            nursery.start_soon(self._read)
            await self.done.wait()
            nursery.cancel_scope.cancel()
        actor.unsubscribe(self.subscription)
        with trio.CancelScope(shield=True), trio.move_on_after(GOODBYE_GRACE):
            await self.stream.aclose()

    async def _write(self) -> None:
        try:
            async with self._outgoing:
                async for line in self._outgoing:
                    self._waiting_bytes -= len(line)
                    await self.stream.send_all(line)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            self.done.set()

    async def _relay(self, subscription: Subscription) -> None:
        async for published in subscription.receive:
            if message := self._shown(published):
                self.say(message)
        if subscription.lagged:
            self.close_with(
                proto.Error(
                    code="lagged",
                    message="you fell behind the turn's events; read the history to catch up",
                )
            )

    def _shown(self, published: Published) -> proto.DaemonMessage | None:
        mine = published.turn.startswith(self.prefix)
        if not (mine or self.watch_all):
            return None
        turn = published.turn.split("/", 1)[1]
        item = published.item
        if isinstance(item, TurnDone):
            return proto.TurnDone(
                id=turn, content=item.outcome.content, usage=proto.Usage.of(item.outcome.usage)
            )
        if isinstance(item, TurnFailed):
            return proto.TurnFailed(id=turn, kind=item.kind, message=item.message)
        return proto.Event(id=turn, event=item)

    async def _read(self) -> None:
        cap = self.server.config.channel.max_line
        lines = _Lines(cap)
        bad = 0
        try:
            # An empty read: the client is done sending (half a line left over is dropped).
            while data := await self.stream.receive_some(65536):
                try:
                    complete = lines.feed(data)
                except _LineTooLong:
                    message = f"a line may be at most {cap} bytes"
                    self.close_with(proto.Error(code="line_too_long", message=message))
                    return
                for line in complete:
                    error = await self._take(line)
                    bad = bad + 1 if error else 0
                    if error:
                        self.say(error)
                    if bad >= BAD_LINES:
                        self.close_with(proto.Bye(reason=f"{BAD_LINES} bad lines in a row"))
                        return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.done.set()
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
            return _describe(e)
        return await self._answer(message)

    async def _answer(self, message: proto.ClientMessage) -> proto.Error | None:
        handler = getattr(self, f"_on_{message.type}")
        error: proto.Error | None = await handler(message)
        return error

    async def _on_hello(self, message: proto.Hello) -> proto.Error | None:
        if message.protocol != proto.PROTOCOL:
            return proto.Error(
                code="protocol",
                message=f"this loopd speaks protocol {proto.PROTOCOL}, the client "
                f"{message.protocol}: update the older of the two",
            )
        self.say(proto.Welcome(daemon=__version__, session=self.server.core.session.session.id))
        return None

    async def _on_send(self, message: proto.Send) -> proto.Error | None:
        actor, key = self.server.core.session, self.prefix + message.id
        if key == actor.running or key in actor.queued:
            return proto.Error(code="duplicate_id", message="that id is in use", id=message.id)
        try:
            position = actor.submit(key, message.content, message.thinking)
        except Busy as e:
            return proto.Error(code="busy", message=str(e), id=message.id)
        self.say(proto.Accepted(id=message.id, position=position))
        return None

    async def _on_cancel(self, message: proto.Cancel) -> proto.Error | None:
        if self.server.core.session.cancel(self.prefix + message.id):
            return None
        return proto.Error(
            code="unknown_turn", message="no turn of yours by that id runs or waits", id=message.id
        )

    async def _on_subscribe(self, _: proto.Subscribe) -> None:
        self.watch_all = True

    async def _on_status(self, _: proto.StatusRequest) -> None:
        self.say(self.status())

    async def _on_sessions(self, _: proto.SessionsRequest) -> None:
        listed = await self.server.store.sessions()
        infos = [
            proto.SessionInfo(
                id=s.id,
                created=s.created.isoformat(),
                turns=s.turns,
                last_activity=s.last_activity.isoformat(),
            )
            for s in listed
        ]
        self.say(proto.Sessions(current=self.server.core.session.session.id, sessions=infos))

    async def _on_history(self, message: proto.HistoryRequest) -> None:
        session = self.server.core.session.session
        records = list(session.records)
        start = message.start or 0
        first = start if start >= 0 else max(0, len(records) + start)  # negative: from the end
        end = len(records) if message.end is None else min(message.end, len(records))
        page = records[first : min(end, first + HISTORY_PAGE)]
        dumped = [r.model_dump(mode="json", by_alias=True) for r in page]
        self.say(proto.History(session=session.id, start=first, records=dumped))

    async def _on_new_session(self, _: proto.NewSession) -> proto.Error | None:
        actor = self.server.core.session
        if actor.running or actor.queued:
            return proto.Error(
                code="session_busy",
                message="a turn is running or waiting; cancel it or wait for it first",
            )
        session = await self.server.store.create(
            make_baseline(self.server.config.session.system_prompt)
        )
        try:
            old = actor.replace_session(session)
        except Busy as e:
            session.close()
            return proto.Error(code="session_busy", message=str(e))
        old.close()
        log.info("new session %s", session.id)
        self.say(proto.Welcome(daemon=__version__, session=session.id))
        return None

    def status(self) -> proto.Status:
        server, actor = self.server, self.server.core.session
        usage = actor.session.last_usage()
        return proto.Status(
            session=actor.session.id,
            server=server.server_url,
            model=server.model,
            slot=server.config.slots.main,
            busy=actor.running is not None,
            queue=len(actor.queued),
            turns=actor.session.turns,
            last_usage=proto.Usage.of(usage),
            context=slot_tokens(usage.timings) if usage and usage.timings else None,
            past_reasoning=past_reasoning(actor.session.records),
        )


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
