"""A connection to loopd's socket: `loopd.wire.proto`'s client messages out, daemon messages
in. Each request goes out under a `ref` of this connection's, and its answer is the line that
carries that ref back, whatever its type (`request`); the lines of a turn come to whoever
reads (`receive`), each with its turn's `id`."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import trio
from pydantic import ValidationError

from bxctl.oneshot import (
    MAX_LINE,
    SessionRefused,
    Unreachable,
    check_owner,
    connection_closed,
    not_running,
)
from loopd import __version__
from loopd.wire.events import SessionContinued
from loopd.wire.lines import TooLong
from loopd.wire.proto import (
    DAEMON_MESSAGE,
    ClientMessage,
    DaemonMessage,
    Error,
    Event,
    ForkSession,
    Hello,
    McpServer,
    NewSession,
    OpenSession,
    Rewind,
    Undone,
    Welcome,
)
from loopd.wire.reader import LineReader

__all__ = ["Connection", "SessionRefused", "Unreachable"]


class Connection:
    def __init__(self, stream: trio.SocketStream, path: Path) -> None:
        self.stream = stream
        self.path = path
        self._lines = LineReader(stream, MAX_LINE)
        self.closed = False
        """The daemon closed the connection (or it broke)."""
        self.session = "new"
        """The session it is in, as far as loopd said (`welcome`, `session_continued`)."""
        self.instructions: list[str] = []
        """The `AGENTS.md` files its session's baseline carries (the last `welcome`)."""
        self.cwd: str | None = None
        """Its session's own folder (the last `welcome`); None: none, or loopd's roots."""
        self._refs = itertools.count(1)

    @classmethod
    async def open(cls, path: Path) -> Connection:
        check_owner(path)
        try:
            stream = await trio.open_unix_socket(str(path))
        except OSError as e:
            raise not_running(path, e) from None
        return cls(stream, path)

    def named(self, message: ClientMessage) -> ClientMessage:
        """`message` under a `ref` of this connection's (as it is, where it has one): its
        answers carry it back. A reader that must be ready for the answer before it is sent
        names the message first."""
        if message.ref is not None:
            return message
        return message.model_copy(update={"ref": f"r{next(self._refs)}"})

    async def send(self, message: ClientMessage) -> str:
        """Send `message`, named (`named`); its ref."""
        message = self.named(message)
        await self.stream.send_all(message.model_dump_json(exclude_none=True).encode() + b"\n")
        assert message.ref is not None  # noqa: S101 - named
        return message.ref

    async def request(self, message: ClientMessage) -> DaemonMessage:
        """Send, then wait for its answer, or the error that refuses it: the first line that
        carries its ref. Lines that answer nothing of it are passed over (`receive` notes
        what they say of the session)."""
        return await self.answer(await self.send(message))

    async def answer(self, ref: str) -> DaemonMessage:
        """The next line that carries `ref`."""
        while (got := await self.receive()) is not None:
            if getattr(got, "ref", None) == ref:  # a line that answers nothing has none
                return got
        raise connection_closed(self.path)

    async def hello(  # noqa: PLR0913 - hello's fields
        self,
        session: str = "new",
        *,
        cwd: str | None = None,
        servers: Sequence[McpServer] = (),
        client: str = "bxctl",
        discard_if_empty: bool = False,
        follow: bool = False,
    ) -> str:
        """Say hello, in session `session` (an id, `latest` or `new`, in folder `cwd`), giving
        it MCP servers of its own; the session's id. `discard_if_empty`: a new session goes if
        nothing is said in it (`hello`'s); `follow`: in the newest session `session` went on
        in (`hello`'s). Raises `SessionRefused` when loopd cannot open it."""
        greeting = Hello(
            client=f"{client} {__version__}",
            session=session,
            cwd=cwd,
            mcp_servers=list(servers),
            discard_if_empty=discard_if_empty,
            follow=follow,
        )
        return await self._move(greeting)

    async def new_session(self, cwd: str | None = None, *, discard_if_empty: bool = False) -> str:
        """Go on in a new session (in folder `cwd`; gone if nothing is said in it, where
        `discard_if_empty`); its id. Raises `SessionRefused`."""
        return await self._move(NewSession(cwd=cwd, discard_if_empty=discard_if_empty))

    async def open_session(self, session: str) -> str:
        """Go on in `session` (an id, or `latest`); the id loopd serves. Raises
        `SessionRefused`."""
        return await self._move(OpenSession(id=session))

    async def fork(self, at: int | None = None) -> str:
        """Go on in a new fork of its session at the end of turn `at` (the latest); its id.
        Raises `SessionRefused`."""
        return await self._move(ForkSession(at=at))

    async def _move(self, message: Hello | NewSession | OpenSession | ForkSession) -> str:
        """Send a message that moves this client to another session, answered `welcome`
        (which `receive` notes); the session's id."""
        answer = await self.request(message)
        if isinstance(answer, Error):
            raise SessionRefused(answer)
        return self.session

    async def rewind(self, at: int, files: bool) -> list[str]:
        """Go on in a new fork of its session at the end of turn `at`, with `files` what the
        later turns changed put back first; the files put back. Raises `SessionRefused`, and
        then nothing was put back and it is where it was."""
        ref = await self.send(Rewind(at=at, files=files))
        paths: list[str] = []
        while isinstance(got := await self.answer(ref), Undone):  # the welcome follows
            paths = got.paths
        if isinstance(got, Error):
            raise SessionRefused(got)
        return paths

    async def here(self, start: Callable[[str | None], Awaitable[str]]) -> tuple[str, str | None]:
        """Start a new session as a terminal client does (`start(cwd)`: `hello` or
        `new_session`): in the folder bxctl runs in, as a coding agent works in its folder,
        so the session is listed as that folder's (an editor's history shows it too). Where
        loopd refuses that folder (outside `[tools] roots`, the home folder, `/`), the
        session has no folder of its own. The id, and the note that says so (or None)."""
        folder = str(Path.cwd())
        try:
            return await start(folder), None
        except SessionRefused as e:
            if e.code != "folder_refused":
                raise
            note = (
                f"not working in {folder}: {e}; this session has no folder of its own "
                "(its file tools work in [tools] roots, if any)"
            )
            return await start(None), note

    async def receive(self) -> DaemonMessage | None:
        """The next message, or None when the daemon closed the connection."""
        line = await self._lines.next()
        if line is None:
            self.closed = True
            return None
        if isinstance(line, TooLong):
            raise Unreachable(f"loopd sent a line longer than {line.cap} bytes")
        try:
            message = DAEMON_MESSAGE.validate_json(line)
        except ValidationError as e:
            raise Unreachable(f"loopd sent a line bxctl cannot read: {e}") from e
        if isinstance(message, Welcome):
            self.session = message.session
            self.instructions, self.cwd = message.instructions, message.cwd
        elif isinstance(message, Event) and isinstance(message.event, SessionContinued):
            self.session = message.event.session
        return message

    async def aclose(self) -> None:
        await self.stream.aclose()
