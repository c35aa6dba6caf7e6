"""`bxctl acp`: loopd as an Agent Client Protocol agent, on stdin and stdout.

An editor starts `bxctl acp` and speaks ACP to it: JSON-RPC 2.0, one message a line. It is a
client of loopd, with one connection to loopd's socket per ACP session, since a loopd client is
in one session at a time. When no loopd answers it starts one (`bxctl.start`), in the
background from the first moment, so the editor's first `session/new` finds it up sooner;
that and every later connection wait for the start, and one that finds loopd gone starts it
again. stdout carries JSON-RPC alone: nothing of loopd's reaches it, and once `serve` holds it
fd 1 is stderr, so a print, a warning, a library's log or a child's output goes there. What
each method does is in docs/editors.md; how loopd's events become ACP's is `acp_map`.

The `agent-client-protocol` package's models are the schema: each request's params are read
with them and each answer and notification is built from them. Its connections are not used:
they run on asyncio, bxctl on trio, and the framing they would save is a line each way.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio
from acp import PROTOCOL_VERSION, schema
from pydantic import ValidationError

from bxctl import rewind
from bxctl.acp_config import BadOption, ConfigOption, config_options, set_mode_of
from bxctl.acp_map import (
    COMMANDS,
    BadCursor,
    Command,
    EditorServer,
    NotOffered,
    UnsupportedServer,
    Update,
    command_of,
    commands_update,
    decision_of,
    listed,
    mcp_servers,
    output_update,
    permission_request,
    replayed,
    rewound_text,
    status_text,
    stop_reason,
    text_of,
    undone_text,
    update_of,
    usage_of,
    usage_update,
)
from bxctl.connection import Connection, SessionRefused, Unreachable
from bxctl.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS, METHOD_NOT_FOUND, Peer, RpcError
from bxctl.requests import UNDO_USAGE, decided, undo_of
from bxctl.start import Starter
from bxctl.text import title_of, turn_lines
from bxctl.user_commands import UserCommand, expand, find_commands
from loopd import __version__
from loopd.config import user_commands
from loopd.session.records import RECORD
from loopd.wire.events import ApprovalNeeded, ToolOutputChunk, ToolResult, TurnEvent
from loopd.wire.proto import (
    HISTORY_PAGE,
    Cancel,
    ClientMessage,
    Compact,
    DaemonMessage,
    Error,
    Event,
    History,
    HistoryRequest,
    McpServer,
    ModeChanged,
    ModeSet,
    Rewind,
    Send,
    SessionFailed,
    Sessions,
    SessionsRequest,
    SetMode,
    Status,
    StatusRequest,
    TurnDone,
    TurnFailed,
    Undone,
    Welcome,
)

__all__ = ["LOOPD_UNREACHABLE", "MAX_LINE", "RESOURCE_NOT_FOUND", "serve"]


MAX_LINE = 16 * 1024 * 1024
"""The longest line read from the editor; a longer one is answered with an error and skipped."""

RESOURCE_NOT_FOUND = -32002
"""ACP's: a session that is not there."""
LOOPD_UNREACHABLE = -32010
"""loopd is not running, or went away during the request."""


@dataclass
class _Turn:
    done: trio.Event = field(default_factory=trio.Event)
    end: DaemonMessage | None = None
    """`turn_done`, `turn_failed`, `session_failed` or an `error`; None: loopd went away."""
    counted: bool = True
    """Its usage is the session's (a `send`'s; not a `compact`'s, which is the summary's)."""


@dataclass
class _Asked:
    """A request to loopd whose answer the relay hands over, found by the request's `ref`:
    `status`, `undone`, `history`, `mode`, a `rewind`'s `welcome`, or the error that refuses
    it."""

    rewind: bool = False
    """It is a `rewind`: an `undone` may come before its answer."""
    done: trio.Event = field(default_factory=trio.Event)
    got: DaemonMessage | None = None
    """None: loopd went away."""
    undone: Undone | None = None
    """A `rewind`'s `undone`, which comes before its `welcome`."""


@dataclass(eq=False)
class _Session:
    """An ACP session: a loopd session, through a connection of its own."""

    id: str
    """The id the editor knows (the loopd session it began as; a compaction or a `/rewind`
    goes on in a new loopd session, `connection.session`, under the same ACP id)."""
    connection: Connection
    turns: dict[str, _Turn] = field(default_factory=dict)
    numbers: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    relay: trio.CancelScope = field(default_factory=trio.CancelScope)
    """What follows its connection (`Agent._relay`); cancelled when the session is closed."""
    window: int | None = None
    """The context window of loopd's slots (its `status`'s `context_size`), when known."""
    asked: dict[str, _Asked] = field(default_factory=dict)
    """The requests that wait for their answers, by ref."""
    servers: list[McpServer] = field(default_factory=list)
    """The editor's MCP servers for it: given again when loopd comes back."""
    mode: ModeSet | ModeChanged | None = None
    """Its mode, thinking and model, as loopd last said (its config options)."""
    titled: bool = False
    """The editor was told its title (`session_info_update`)."""
    output: dict[int, str] = field(default_factory=dict)
    """The output so far of each command that runs, by call: an update replaces a call's
    content, so each carries all of it (loopd sends a bounded amount live)."""

    def printed(self, chunk: ToolOutputChunk) -> str:
        """The output so far of `chunk`'s call, `chunk` with it."""
        output = self.output[chunk.call] = self.output.get(chunk.call, "") + chunk.text
        return output

    def options(self) -> list[ConfigOption]:
        assert self.mode is not None  # noqa: S101 - `Agent._open` asked for it
        return config_options(self.mode)


class Agent:
    def __init__(
        self, socket: Path, output: trio.abc.SendStream, starter: Starter | None = None
    ) -> None:
        self.socket = socket
        self.starter = starter
        """How to start loopd when none answers (None: `--no-start`, say so instead)."""
        self._starting = trio.Lock()
        self.sessions: dict[str, _Session] = {}
        self.went_on: dict[str, str] = {}
        """The loopd session each closed ACP session was in last, where that is not its own id
        (it went on in another): loading it again opens that one."""
        self._nursery: trio.Nursery | None = None
        self.peer = Peer(
            output,
            name="bxctl acp",
            methods={
                "initialize": (schema.InitializeRequest, self.initialize),
                "session/new": (schema.NewSessionRequest, self.new_session),
                "session/load": (schema.LoadSessionRequest, self.load_session),
                "session/prompt": (schema.PromptRequest, self.prompt),
                "session/list": (schema.ListSessionsRequest, self.list_sessions),
                "session/resume": (schema.ResumeSessionRequest, self.resume_session),
                "session/fork": (schema.ForkSessionRequest, self.fork_session),
                "session/close": (schema.CloseSessionRequest, self.close_session),
                "session/delete": (schema.DeleteSessionRequest, self.delete_session),
                "session/set_config_option": (
                    schema.SetSessionConfigOptionSelectRequest,
                    self.set_config_option,
                ),
            },
            notifications={"session/cancel": (schema.CancelNotification, self.cancel)},
            errors={Unreachable: LOOPD_UNREACHABLE},
            max_line=MAX_LINE,
            then={
                "session/new": self._offer_commands,
                "session/load": self._reopened,
                "session/resume": self._reopened,
                "session/fork": self._reopened,
            },
        )

    async def serve(self, stdin: trio.abc.ReceiveStream) -> None:
        """Answer the editor until it closes stdin."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.starter is not None:
                nursery.start_soon(self._start_early)
            await self.peer.serve(stdin)
            nursery.cancel_scope.cancel()
        for session in self.sessions.values():
            await session.connection.aclose()

    async def notify(self, session: str, update: Update) -> None:
        notification = schema.SessionNotification(session_id=session, update=update)
        await self.peer.notify("session/update", notification)

    async def _offer_commands(self, request: object, result: object) -> None:
        """Once the editor has a session (new, loaded, resumed or forked): the commands it
        offers."""
        session = getattr(result, "session_id", None) or getattr(request, "session_id", "")
        opened = self.sessions.get(str(session))
        own = await self._own_commands(opened) if opened is not None else {}
        await self.notify(str(session), commands_update(list(own.values())))

    async def _reopened(self, request: object, result: object) -> None:
        """A session the editor opens again (loaded, resumed, forked): its commands, and its
        title where it has one."""
        await self._offer_commands(request, result)
        session = getattr(result, "session_id", None) or getattr(request, "session_id", "")
        if (opened := self.sessions.get(str(session))) is not None:
            await self._tell_title(opened)

    async def _tell_title(self, session: _Session) -> None:
        """The session's title (`session_info_update`), once it has one: its first user
        message, as `session/list` titles it (a compaction's, the session it continues)."""
        if session.titled:
            return
        connection = await Connection.open(self.socket)
        async with connection.stream:
            answer = await connection.request(SessionsRequest())
        if not isinstance(answer, Sessions):
            return
        by_id = {s.id: s for s in answer.sessions}
        listed = by_id.get(session.connection.session)
        if listed is None or (title := title_of(listed, by_id)) is None:
            return
        session.titled = True
        update = schema.SessionInfoUpdate(session_update="session_info_update", title=title)
        await self.notify(session.id, update)

    async def _own_commands(self, session: _Session) -> dict[str, UserCommand]:
        """The user's commands, and the project's where the session has a folder of its own
        (`bxctl.user_commands`); loopd's own names win."""
        cwd = session.connection.cwd
        folder = Path(cwd) if cwd else None
        reserved = {c.name for c in COMMANDS}
        return await trio.to_thread.run_sync(find_commands, folder, user_commands(), reserved)

    # -- the methods ---------------------------------------------------------------------

    async def initialize(self, request: schema.InitializeRequest) -> schema.InitializeResponse:
        return schema.InitializeResponse(
            protocol_version=min(request.protocol_version, PROTOCOL_VERSION),
            agent_capabilities=schema.AgentCapabilities(
                load_session=True,
                prompt_capabilities=schema.PromptCapabilities(
                    image=False, audio=False, embedded_context=True
                ),
                mcp_capabilities=schema.McpCapabilities(http=True, sse=True),
                session_capabilities=schema.SessionCapabilities(
                    list=schema.SessionListCapabilities(),
                    resume=schema.SessionResumeCapabilities(),
                    close=schema.SessionCloseCapabilities(),
                    fork=schema.SessionForkCapabilities(),
                ),
            ),
            agent_info=schema.Implementation(name="loopd", title="loopd", version=__version__),
            auth_methods=[],
        )

    async def new_session(self, request: schema.NewSessionRequest) -> schema.NewSessionResponse:
        session = self._follow(await self._open("new", request.cwd, request.mcp_servers))
        return schema.NewSessionResponse(session_id=session.id, config_options=session.options())

    async def load_session(self, request: schema.LoadSessionRequest) -> schema.LoadSessionResponse:
        """The history of the loopd session the editor's id stands for (after a compaction or
        a `/rewind`, the newest one it went on in, by loopd's logs: across restarts of the
        editor and of this process), replayed, then live again."""
        session = await self._reopen(request.session_id, request.mcp_servers)
        start = 0
        while True:  # the whole history, a page at a time, before the answer
            page = await session.connection.request(
                HistoryRequest(start=start, end=start + HISTORY_PAGE)
            )
            if not isinstance(page, History):
                raise RpcError(INTERNAL_ERROR, f"loopd did not give the history: {page}")
            for update in replayed([RECORD.validate_python(r) for r in page.records]):
                await self.notify(session.id, update)
            if len(page.records) < HISTORY_PAGE:
                break
            start += len(page.records)
        self._follow(session)
        return schema.LoadSessionResponse(config_options=session.options())

    async def resume_session(
        self, request: schema.ResumeSessionRequest
    ) -> schema.ResumeSessionResponse:
        """`session/load` without the history: the editor still shows it. Its cache comes
        back as a loaded session's does."""
        session = self._follow(await self._reopen(request.session_id, request.mcp_servers))
        return schema.ResumeSessionResponse(config_options=session.options())

    async def _reopen(self, session_id: str, given: Sequence[EditorServer] | None) -> _Session:
        """The editor's session `session_id` on a new connection (the old one closed), in the
        loopd session it stands for: loopd follows that one's rewinds and compactions to the
        newest; not followed yet."""
        which = self._loopd_session(session_id)
        if (old := self.sessions.pop(session_id, None)) is not None:
            await self._close(old)
        return await self._open(which, None, given, as_id=session_id, follow=True)

    def _loopd_session(self, session_id: str) -> str:
        """The loopd session the editor's `session_id` stands for: the one it is in, or was
        in last, here; else that id."""
        if (session := self.sessions.get(session_id)) is not None:
            return session.connection.session
        return self.went_on.get(session_id, session_id)

    async def fork_session(self, request: schema.ForkSessionRequest) -> schema.ForkSessionResponse:
        """A new session with the history of `session_id` (its latest turn included), that
        one left as it is; its first prompt is served from that session's cache. The editor's
        MCP servers for it are not started (loopd starts them only for a session it opens)."""
        which = self._loopd_session(request.session_id)
        session = self._follow(await self._open(which, None, request.mcp_servers, fork=True))
        return schema.ForkSessionResponse(session_id=session.id, config_options=session.options())

    async def delete_session(
        self, request: schema.DeleteSessionRequest
    ) -> schema.DeleteSessionResponse:
        """Refused, saying why: not offered in the capabilities, but an editor may ask."""
        raise RpcError(
            METHOD_NOT_FOUND,
            f"loopd does not delete session {request.session_id}: its logs are append-only, "
            "so nothing said is ever lost; it stays listed, to load, resume or fork",
        )

    async def set_config_option(
        self, request: schema.SetSessionConfigOptionSelectRequest
    ) -> schema.SetSessionConfigOptionResponse:
        """Set the session's mode or thinking in loopd, which keeps it in the session's log
        and enforces it; answered with every option as it is now."""
        session = self._session(request.session_id)
        try:
            message = set_mode_of(request.config_id, request.value)
        except BadOption as e:
            raise RpcError(INVALID_PARAMS, str(e)) from None
        if session.connection.closed:  # loopd went away: it may be back
            await self._reconnect(session)
        answer = await self._ask(session, message)
        if isinstance(answer, Error) and answer.code == "unknown_model":
            raise RpcError(INVALID_PARAMS, answer.message)
        if not isinstance(answer, ModeSet):
            raise RpcError(INTERNAL_ERROR, f"loopd did not set the mode: {answer}")
        session.mode = answer
        return schema.SetSessionConfigOptionResponse(config_options=session.options())

    async def close_session(
        self, request: schema.CloseSessionRequest
    ) -> schema.CloseSessionResponse:
        """Cancel the session's turns and leave it: loopd stops its actor once no client is
        in it and no turn runs (it is in the store, to load or resume again)."""
        session = self.sessions.pop(request.session_id, None)
        if session is None:
            raise RpcError(RESOURCE_NOT_FOUND, f"no session {request.session_id} open here")
        await self._close(session)
        return schema.CloseSessionResponse()

    async def _close(self, session: _Session) -> None:
        """Cancel its turns (their prompts answer `cancelled`) and close its connection."""
        if session.connection.session != session.id:
            self.went_on[session.id] = session.connection.session
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            for running in list(session.turns):
                if not session.connection.closed:
                    await session.connection.send(Cancel(id=running))
        for turn_id, turn in session.turns.items():
            turn.end = TurnFailed(id=turn_id, kind="cancelled", message="the session was closed")
            turn.done.set()
        session.relay.cancel()
        await session.connection.aclose()

    async def list_sessions(
        self, request: schema.ListSessionsRequest
    ) -> schema.ListSessionsResponse:
        """The sessions of the store, on a connection of its own that opens none."""
        await self._loopd()
        connection = await Connection.open(self.socket)
        async with connection.stream:
            answer = await connection.request(SessionsRequest())
        if not isinstance(answer, Sessions):
            raise RpcError(INTERNAL_ERROR, f"loopd did not list its sessions: {answer}")
        try:
            sessions, cursor = listed(answer.sessions, request.cwd, request.cursor)
        except BadCursor as e:
            raise RpcError(INVALID_PARAMS, str(e)) from None
        return schema.ListSessionsResponse(sessions=sessions, next_cursor=cursor)

    async def _start_early(self) -> None:
        """Start loopd while the editor initializes; a failure is said again (with the log)
        to the request that needs loopd."""
        with contextlib.suppress(Unreachable):
            await self._loopd()

    async def _loopd(self) -> None:
        """Return once loopd answers, started here when none does (one start at a time)."""
        if self.starter is not None:
            async with self._starting:
                await self.starter.ensure()

    async def _connect(
        self,
        which: str,
        cwd: str | None = None,
        servers: Sequence[McpServer] = (),
        *,
        fork: bool = False,
        follow: bool = False,
    ) -> tuple[Connection, str]:
        """A connection to loopd in session `which` (`new` in folder `cwd`; `follow`: the
        newest it went on in) with the editor's MCP servers for it, or (`fork`) in a new fork of
        it, and the session's id; closed again when loopd refuses it (`SessionRefused`)."""
        await self._loopd()
        connection = await Connection.open(self.socket)
        try:
            session = await connection.hello(
                which, cwd=cwd, servers=() if fork else servers, client="bxctl acp", follow=follow
            )
            if fork:
                session = await connection.fork()
        except BaseException:
            await connection.aclose()
            raise
        return connection, session

    async def _open(  # noqa: PLR0913 - what it opens, and how
        self,
        which: str,
        cwd: str | None,
        given: Sequence[EditorServer] | None,
        *,
        fork: bool = False,
        as_id: str | None = None,
        follow: bool = False,
    ) -> _Session:
        """An ACP session in loopd session `which` (`new`: in folder `cwd`; `fork`: a new fork
        of it; `follow`: the newest session it went on in), under the editor's id `as_id` (by
        default the loopd session's); not followed yet (`_follow`)."""
        try:
            servers = mcp_servers(given)
        except UnsupportedServer as e:
            raise RpcError(INVALID_PARAMS, str(e)) from None
        try:
            connection, loopd_id = await self._connect(
                which, cwd, servers, fork=fork, follow=follow
            )
        except SessionRefused as e:
            code = RESOURCE_NOT_FOUND if e.code == "unknown_session" else INVALID_PARAMS
            raise RpcError(code, str(e)) from None
        acp_id = as_id or loopd_id
        session = self.sessions[acp_id] = _Session(acp_id, connection, servers=servers)
        status = await connection.request(StatusRequest())
        session.window = status.context_size if isinstance(status, Status) else None
        mode = await connection.request(SetMode())
        if not isinstance(mode, ModeSet):
            raise RpcError(INTERNAL_ERROR, f"loopd did not say the session's mode: {mode}")
        session.mode = mode
        return session

    def _follow(self, session: _Session) -> _Session:
        """Relay what loopd says in `session` from now on; `session`."""
        assert self._nursery is not None  # noqa: S101 - serve set it
        self._nursery.start_soon(self._relay, session)
        return session

    def _session(self, session_id: str) -> _Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise RpcError(
                RESOURCE_NOT_FOUND,
                f"no session {session_id} here: session/new, session/load or "
                "session/resume it first",
            )
        return session

    async def prompt(self, request: schema.PromptRequest) -> schema.PromptResponse:
        session = self._session(request.session_id)
        if session.connection.closed:  # loopd went away: it may be back
            await self._reconnect(session)
        try:
            text = text_of(request.prompt)
        except NotOffered as e:
            raise RpcError(INVALID_PARAMS, str(e)) from None
        if (command := command_of(text)) is not None:
            return await self._command(session, command)
        if text.startswith("/"):  # one of the user's own commands sends its file's text
            name, _, arguments = text[1:].partition(" ")
            if (own := (await self._own_commands(session)).get(name)) is not None:
                text = expand(own, arguments.strip())
        return await self._turn(session, lambda turn: Send(id=turn, content=text))

    async def _turn(
        self, session: _Session, message_of: Callable[[str], Send | Compact]
    ) -> schema.PromptResponse:
        """Run the message `message_of` makes for a turn id (a `send`, a `compact`) as a turn
        of the session, to its end."""
        turn_id = f"p{next(session.numbers)}"
        message = message_of(turn_id)
        turn = session.turns[turn_id] = _Turn(counted=isinstance(message, Send))
        try:
            await session.connection.send(message)
            await turn.done.wait()
        finally:
            del session.turns[turn_id]
        if turn.counted and not session.titled and not session.connection.closed:
            with contextlib.suppress(Unreachable):  # a title is worth no error of its own
                await self._tell_title(session)
        return _response(turn.end)

    async def _command(self, session: _Session, command: Command) -> schema.PromptResponse:
        """One of loopd's commands (`acp_map.COMMANDS`), its answer told as the agent's."""
        name, words = command
        if name == "compact":
            ended = await self._turn(session, lambda turn: Compact(id=turn))
            if ended.stop_reason == "end_turn":
                said = (
                    f"Compacted: the session goes on in loopd session {session.connection.session}"
                )
                await self._say(session, f"{said}, from the model's summary of this one.")
            return ended
        if name == "rewind":
            await self._say(session, await self._rewind(session, words))
            return schema.PromptResponse(stop_reason="end_turn")
        asked: ClientMessage | None = StatusRequest() if name == "status" else undo_of(words)
        if asked is None:
            await self._say(session, UNDO_USAGE)
            return schema.PromptResponse(stop_reason="end_turn")
        answer = await self._ask(session, asked)
        if isinstance(answer, Status):
            await self._say(session, status_text(answer))
        elif isinstance(answer, Undone):
            await self._say(session, undone_text(answer))
        elif isinstance(answer, Error):
            await self._say(session, f"loopd refused it ({answer.code}): {answer.message}")
        return schema.PromptResponse(stop_reason="end_turn")

    async def _rewind(self, session: _Session, words: list[str]) -> str:
        """`/rewind`: the turns to pick from; `/rewind N [files]`: go on in a fork of the
        session at the end of turn N (loopd's `rewind`), under the same ACP id. What to say."""
        if not words:
            said = await rewind.said(lambda m: self._ask(session, m))
            return "\n".join([*turn_lines(said), rewind.HELP])
        if (asked := rewind.parse(words)) is None:
            return rewind.USAGE
        if session.turns:  # it would go on in the fork, its end unseen
            return "A turn runs: /rewind once it ends (or cancel it)."
        at, files = asked
        parent = session.connection.session
        got = await self._asked(session, Rewind(at=at, files=files))
        if isinstance(got.got, Error):
            return f"loopd refused it ({got.got.code}): {got.got.message}"
        assert isinstance(got.got, Welcome)  # noqa: S101 - the answer asked for, or an error
        session.output.clear()
        paths = got.undone.paths if got.undone is not None else []
        return rewound_text(at, got.got.session, parent, paths if files else None)

    async def _ask(self, session: _Session, message: ClientMessage) -> DaemonMessage:
        """A request to loopd in the session, and its answer or error (through the relay)."""
        got = (await self._asked(session, message)).got
        assert got is not None  # noqa: S101 - `_asked` raised otherwise
        return got

    async def _asked(self, session: _Session, message: ClientMessage) -> _Asked:
        """As `_ask`, with a `rewind`'s `undone`, where one came before its `welcome`. The
        request is named, and waited for, before it goes: the relay may read its answer
        before `send` returns."""
        message = session.connection.named(message)
        assert message.ref is not None  # noqa: S101 - named
        asked = session.asked[message.ref] = _Asked(rewind=isinstance(message, Rewind))
        try:
            await session.connection.send(message)
            await asked.done.wait()
        finally:
            del session.asked[message.ref]
        if asked.got is None:
            raise RpcError(LOOPD_UNREACHABLE, "loopd went away; try again once it is back")
        return asked

    async def _say(self, session: _Session, text: str) -> None:
        await self.notify(
            session.id,
            schema.AgentMessageChunk(
                session_update="agent_message_chunk",
                content=schema.TextContentBlock(type="text", text=text),
            ),
        )

    async def _reconnect(self, session: _Session) -> None:
        """A new connection to loopd, in the session the old one was in last."""
        try:
            connection, _ = await self._connect(session.connection.session, servers=session.servers)
        except SessionRefused as e:
            raise RpcError(
                INTERNAL_ERROR, f"loopd is back but would not open the session: {e}"
            ) from None
        session.connection, session.relay = connection, trio.CancelScope()
        self._follow(session)

    async def cancel(self, cancel: schema.CancelNotification) -> None:
        session = self.sessions.get(cancel.session_id)
        if session is None or session.connection.closed:
            return
        for turn in list(session.turns):
            await session.connection.send(Cancel(id=turn))

    # -- loopd's side --------------------------------------------------------------------

    async def _relay(self, session: _Session) -> None:
        """What loopd says in the session: updates for the editor, the ends of turns,
        approvals to ask for."""
        connection = session.connection
        try:
            with session.relay:
                await self._follow_connection(session, connection)
        except Unreachable:
            pass
        finally:
            connection.closed = True
            for turn in session.turns.values():
                turn.done.set()  # with no end: loopd went away
            for asked in session.asked.values():
                asked.done.set()
            await connection.aclose()

    async def _follow_connection(self, session: _Session, connection: Connection) -> None:
        try:
            while (message := await connection.receive()) is not None:
                if isinstance(message, SessionFailed):
                    # loopd closed the session: its prompts end with why, and the next
                    # prompt opens it again on a new connection (`_reconnect`).
                    for turn in session.turns.values():
                        turn.end = message
                    break
                await self._relay_one(session, message)
        except trio.ClosedResourceError:
            pass  # closed under it: a load of the session anew, or the end

    async def _relay_one(self, session: _Session, message: DaemonMessage) -> None:
        asked = session.asked.get(getattr(message, "ref", None) or "")
        if asked is not None and asked.rewind and isinstance(message, Undone):
            asked.undone = message  # the files it put back: its `welcome` follows
            return
        if asked is not None:
            asked.got = message
            asked.done.set()
            return
        turn = session.turns.get(getattr(message, "id", None) or "")
        if isinstance(message, ModeChanged):  # another client changed it: the editor shows it
            session.mode = message
            update = schema.ConfigOptionUpdate(
                session_update="config_option_update", config_options=session.options()
            )
            await self.notify(session.id, update)
        elif isinstance(message, Event):
            await self._relay_event(session, message.event)
        elif isinstance(message, TurnDone | TurnFailed | Error) and turn is not None:
            if isinstance(message, TurnDone) and turn.counted:
                await self._tell_usage(session, message)
            turn.end = message
            turn.done.set()
            session.output.clear()  # a call cut off with its turn gets no result

    async def _relay_event(self, session: _Session, event: TurnEvent) -> None:
        if isinstance(event, ApprovalNeeded):
            assert self._nursery is not None  # noqa: S101 - serve set it
            self._nursery.start_soon(self._approval, session, event)
        elif isinstance(event, ToolOutputChunk):
            await self.notify(session.id, output_update(event.call, session.printed(event)))
        else:
            if isinstance(event, ToolResult):
                session.output.pop(event.call, None)  # its result takes its place
            if (update := update_of(event, session.connection.session)) is not None:
                await self.notify(session.id, update)

    async def _tell_usage(self, session: _Session, done: TurnDone) -> None:
        """Where the session stands after the turn (`usage_update`), when loopd says."""
        if (update := usage_update(done.usage, session.window)) is not None:
            await self.notify(session.id, update)

    async def _approval(self, session: _Session, asking: ApprovalNeeded) -> None:
        try:
            answer = await self.peer.ask(
                "session/request_permission", permission_request(session.id, asking)
            )
            outcome = schema.RequestPermissionResponse.model_validate(answer).outcome
        except (RpcError, ValidationError):
            outcome = None
        approve = decided(asking, decision_of(getattr(outcome, "option_id", None)))
        if not session.connection.closed:
            await session.connection.send(approve)


def _response(end: DaemonMessage | None) -> schema.PromptResponse:
    if end is None:
        raise RpcError(
            LOOPD_UNREACHABLE,
            "loopd went away during the turn; prompt again to go on (a loopd that is not "
            "running is started again, unless --no-start)",
        )
    if isinstance(end, TurnDone):
        return schema.PromptResponse(stop_reason="end_turn", usage=usage_of(end.usage))
    if isinstance(end, TurnFailed):
        if (reason := stop_reason(end)) is not None:
            return schema.PromptResponse(stop_reason=reason)
        raise RpcError(INTERNAL_ERROR, f"the turn failed ({end.kind}): {end.message}")
    if isinstance(end, SessionFailed):  # no stop reason says it: an error, as ACP allows
        raise RpcError(
            INTERNAL_ERROR,
            f"loopd closed the session: {end.message}; prompt again to reopen it once that "
            "is fixed",
        )
    assert isinstance(end, Error)  # noqa: S101 - the relay ends turns with these four
    raise RpcError(INTERNAL_ERROR, f"loopd refused the prompt ({end.code}): {end.message}")


def _stderr() -> int:
    """stderr's descriptor; /dev/null's when the editor started bxctl with it closed."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # None, or closed
        return os.open(os.devnull, os.O_WRONLY)


async def serve(socket: Path, starter: Starter | None = None) -> None:
    """`bxctl acp`: the agent on this process's stdin and stdout; `starter`: how to start
    loopd when none answers (None: say so instead)."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    stdout = trio.lowlevel.FdStream(os.dup(sys.stdout.fileno()))
    os.dup2(_stderr(), sys.stdout.fileno())  # all but JSON-RPC: to stderr
    async with stdin, stdout:
        try:
            await Agent(socket, stdout, starter).serve(stdin)
        except* trio.BrokenResourceError:
            pass  # the editor closed our stdout: nobody is left to answer
