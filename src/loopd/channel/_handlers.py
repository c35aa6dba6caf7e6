"""What each client message does: one typed handler per message type, each a message to the
client's session actor (or the registry of sessions, or the slot pool) and the line that
answers it. No session logic lives here; this layer only translates between the wire and the
actors.

Each answer carries its request's `ref` (the handlers pass it on); a turn's lines carry the
`ref` of the `send` or `compact` that started it, which the client keeps by turn (`refs`) until
the turn ends, for its own turns alone: a ref is one client's, meaningless to another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from loopd import __version__
from loopd.actors import (
    Busy,
    CannotFork,
    CannotUndo,
    Core,
    DuplicateTurn,
    FolderNotAllowed,
    ModeChanged,
    NoSuchSession,
    Published,
    SessionError,
    SessionFailed,
    SessionHandle,
    SessionStatus,
    SessionUnavailable,
    Subscription,
    SubscriptionItem,
    TooManySessions,
    TurnDone,
    TurnFailed,
    UnknownModel,
)
from loopd.session.continued import newest
from loopd.supervise import ActorFailed
from loopd.wire import proto
from loopd.wire.events import PlanUpdate

__all__ = ["Client", "DaemonInfo", "handle"]


@dataclass
class DaemonInfo:
    """What a status tells besides the session: what the server said of itself, when loopd
    started or, for one that did not answer then, when it first did."""

    server_url: str
    model: str | None
    context_size: int | None = None
    """Each request's context window in tokens: `[server.managed] n_ctx`, or what an
    external server said (`GET /slots`, `/v1/models`); None when it said nothing."""
    engine: str | None = None
    """What serves the model (`llama`, `vllm`, `openai`); None: not known yet."""
    models: dict[str, DaemonInfo] = field(default_factory=dict)
    """With several models (`[models.NAME]`): what serves each, by name."""
    default: str | None = None
    """With several models: the one a session that names none runs on."""

    def of(self, model: str | None) -> DaemonInfo:
        """What serves `model` (None: the default): its own entry with several models."""
        return self.models.get(model or self.default or "", self)


@dataclass(eq=False)
class Client:
    """One connected client, as the handlers see it: the session it is attached to, and its
    subscription to that session's events."""

    core: Core
    info: DaemonInfo
    say: Callable[[proto.DaemonMessage], None]
    prefix: str
    """Turn ids are kept apart per client: this client's `t1` is `<prefix>t1` to the actor."""
    buffer: int
    """Events buffered for it (`[channel] subscriber_buffer`)."""
    watch_all: bool = False
    """It subscribed: it sees every turn, not only its own."""
    session: SessionHandle | None = None
    subscription: Subscription | None = None
    moved: trio.Event = field(default_factory=trio.Event)
    """Set when it moves to another session (then replaced)."""
    protocol: int = proto.PROTOCOL
    """The version it speaks: its `hello`'s."""
    refs: dict[str, str] = field(default_factory=dict)
    """The `ref` of each of its turns that has one, by the actor's id of the turn, until the
    turn ends."""

    def shown(self, published: SubscriptionItem) -> proto.DaemonMessage | None:
        """The line a published event becomes for this client, if it may see it."""
        if isinstance(published, SessionFailed):  # the session's end: every client's concern
            return proto.SessionFailed(
                session=published.session, fault=published.fault, message=published.message
            )
        if isinstance(published, ModeChanged):  # every client's but the one that asked
            if published.by == self.prefix:
                return None
            state = published.state
            return proto.ModeChanged(
                session=state.session,
                mode=state.mode,
                thinking=state.thinking,
                model=state.model,
                models=list(state.models),
            )
        own = published.turn.startswith(self.prefix)
        if not (own or self.watch_all):
            return None
        ref = self.ref_of(published)
        if isinstance(published.item, TurnDone | TurnFailed):
            self.refs.pop(published.turn, None)
        return line_of(published, ref)

    def ref_of(self, published: Published) -> str | None:
        """The `ref` a line of this published event carries for this client."""
        return self.refs.get(published.turn) if published.turn.startswith(self.prefix) else None

    async def attached(self) -> SessionHandle:
        """Its session; the latest, for a client that named none."""
        if self.session is None:
            await self.move("latest")
        assert self.session is not None  # noqa: S101 - move attached it
        return self.session

    async def move(
        self,
        which: str,
        cwd: str | None = None,
        servers: Sequence[proto.McpServer] = (),
        *,
        discard_if_empty: bool = False,
        follow: bool = False,
    ) -> str:
        """Attach it to session `which` (an id, `latest` or `new` in folder `cwd`) with the MCP
        servers it gives it, leaving the one it was in; the session's id. `follow`: to the
        newest session `which` went on in (`loopd.session.continued`). Raises a
        `SessionError`."""
        if follow:
            which = await newest(self.core.sessions.store, which)
        attached = await self.core.sessions.attach(
            which, cwd, servers, discard_if_empty=discard_if_empty
        )
        return await self._switch(*attached)

    async def fork(self, parent: str | None, at: int | None) -> str:
        """Move it to a new fork of `parent` (its own session when None) at turn `at`; the
        fork's id. Raises a `SessionError`."""
        if parent is None:
            parent = (await (await self.attached()).status()).session
        return await self._switch(*await self.core.sessions.fork(parent, at))

    async def rewind(self, at: int) -> str:
        """Move it to a new fork of its own session at turn `at`, that session's log saying it
        went on there (what an editor reopening it follows); the fork's id. Raises a
        `SessionError`."""
        own = await self.attached()
        parent = (await own.status()).session
        handle, forked = await self.core.sessions.fork(parent, at)
        with contextlib.suppress(SessionError):  # stopped since: its failure is said elsewhere
            await own.continued(parent, forked, at)
        return await self._switch(handle, forked)

    async def _switch(self, handle: SessionHandle, session: str) -> str:
        subscription = await handle.subscribe(self.buffer)
        old, old_subscription = self.session, self.subscription
        self.session, self.subscription = handle, subscription
        moved, self.moved = self.moved, trio.Event()
        moved.set()
        if old is not None:
            await self.leave(old, old_subscription)
        return session

    async def leave(self, handle: SessionHandle, subscription: Subscription | None) -> None:
        if subscription is not None:
            await handle.unsubscribe(subscription)
        self.core.sessions.detach(handle)


def line_of(published: Published, ref: str | None = None) -> proto.DaemonMessage:
    turn = published.turn.split("/", 1)[1]
    item = published.item
    if isinstance(item, TurnDone):
        usage = proto.Usage.of(item.outcome.usage)
        return proto.TurnDone(id=turn, content=item.outcome.content, usage=usage, ref=ref)
    if isinstance(item, TurnFailed):
        return proto.TurnFailed(id=turn, kind=item.kind, message=item.message, ref=ref)
    return proto.Event(id=turn, event=item, ref=ref)


def _pending(client: Client, status: SessionStatus) -> list[proto.Event]:
    """The calls that wait for approval, whoever's turn they are in: any client may answer."""
    lines = (line_of(p, client.ref_of(p)) for p in status.pending)
    return [line for line in lines if isinstance(line, proto.Event)]


async def _hello(client: Client, message: proto.Hello) -> proto.Error | None:
    if not proto.OLDEST_PROTOCOL <= message.protocol <= proto.PROTOCOL:
        return proto.Error(
            code="protocol",
            message=f"this loopd speaks protocols {proto.OLDEST_PROTOCOL} to {proto.PROTOCOL}, "
            f"the client {message.protocol}: update the older of the two",
        )
    client.protocol = message.protocol
    moved = await client.move(
        message.session,
        message.cwd,
        message.mcp_servers,
        discard_if_empty=message.discard_if_empty,
        follow=message.follow,
    )
    _welcome(client, moved, message.ref)
    return None


def _welcome(client: Client, session: str, ref: str | None) -> None:
    sessions = client.core.sessions
    instructions = list(sessions.instructions(session))
    welcome = proto.Welcome(
        protocol=client.protocol,
        daemon=__version__,
        session=session,
        instructions=instructions,
        cwd=sessions.cwd(session),
        ref=ref,
    )
    client.say(welcome)


async def _send(client: Client, message: proto.Send) -> proto.Error | None:
    session = await client.attached()
    return await _queue(
        client, message, lambda key: session.send(key, message.content, message.thinking)
    )


async def _compact(client: Client, message: proto.Compact) -> proto.Error | None:
    return await _queue(client, message, (await client.attached()).compact)


async def _queue(
    client: Client, message: proto.Send | proto.Compact, submit: Callable[[str], Awaitable[int]]
) -> proto.Error | None:
    """Queue a turn under the client's own id for it; `accepted` gives its place. Its ref is
    kept first: the turn's first events may come before `submit` returns."""
    key, turn = client.prefix + message.id, message.id
    before = client.refs.get(key)  # a duplicate id's: that turn keeps its own
    if message.ref is not None:
        client.refs[key] = message.ref
    try:
        position = await submit(key)
    except SessionError as e:
        if before is None:
            client.refs.pop(key, None)
        else:
            client.refs[key] = before
        if isinstance(e, DuplicateTurn):
            return proto.Error(code="duplicate_id", message="that id is in use", id=turn)
        return proto.Error(code=CODES[type(e)], message=str(e), id=turn)
    client.say(proto.Accepted(id=turn, position=position, ref=message.ref))
    return None


async def _cancel(client: Client, message: proto.Cancel) -> proto.Error | None:
    if await (await client.attached()).cancel(client.prefix + message.id):
        return None
    return proto.Error(
        code="unknown_turn", message="no turn of yours by that id runs or waits", id=message.id
    )


async def _subscribe(client: Client, _: proto.Subscribe) -> None:
    client.watch_all = True
    # What waits for a person is shown at once, not only when the next call asks.
    for line in _pending(client, await (await client.attached()).status()):
        client.say(line)


async def _status(client: Client, message: proto.StatusRequest) -> None:
    s = await (await client.attached()).status()
    views = await client.core.pool.views()
    slots = [
        proto.SlotInfo(
            server=v.server,
            slot=v.number,
            session=v.session,
            tokens=v.tokens,
            busy=v.busy,
            model=v.model,
        )
        for v in views
    ]
    info = client.info.of(s.model)
    client.say(
        proto.Status(
            session=s.session,
            server=info.server_url,
            model=info.model,
            engine=info.engine,
            slot=next(
                (v.number for v in views if v.session == s.session and v.model == s.model), None
            ),
            session_model=s.model,
            busy=s.running is not None,
            queue=len(s.queued),
            turns=s.turns,
            last_usage=proto.Usage.of(s.last_usage),
            context=s.context,
            context_size=info.context_size,
            past_reasoning=s.past_reasoning,
            pending=_pending(client, s),
            slots=slots,
            plan=None if s.plan is None else PlanUpdate.of(s.plan),
            ref=message.ref,
        )
    )


async def _context(client: Client, message: proto.ContextRequest) -> None:
    seen = await (await client.attached()).context()
    functions = [tool.get("function", {}) for tool in seen.offered]
    offered = [
        proto.ToolShown(
            name=f.get("name", ""),
            summary=(f.get("description", "").strip().splitlines() or [""])[0],
            found=False,
            source="loopd",
        )
        for f in functions
    ]
    found = [
        proto.ToolShown(name=e.name, summary=e.summary, found=True, source=e.source)
        for e in seen.found
    ]
    filled = seen.filling
    parts = None
    if filled is not None:
        parts = proto.ContextParts(
            start=filled.start,
            messages=filled.messages,
            tool_results=filled.tool_results,
            answers=filled.answers,
            reasoning=filled.reasoning,
        )
    client.say(
        proto.Context(
            session=seen.session,
            system_prompt=seen.system,
            instructions=list(seen.instructions),
            tools=offered + found,
            tokens=None if filled is None else filled.held,
            context_size=client.info.context_size,
            parts=parts,
            exact=filled is not None and filled.exact,
            ref=message.ref,
        )
    )


async def _sessions(client: Client, message: proto.SessionsRequest) -> None:
    # A client in no session stays in none: a list (an editor's) opens nothing.
    current = None if client.session is None else (await client.session.status()).session
    listed = await client.core.sessions.sessions()
    infos = [proto.SessionInfo.of(s) for s in listed.sessions]
    unreadable = [proto.Unreadable.of(u) for u in listed.unreadable]
    client.say(
        proto.Sessions(current=current, sessions=infos, unreadable=unreadable, ref=message.ref)
    )


async def _history(client: Client, message: proto.HistoryRequest) -> None:
    page = await (await client.attached()).history(message.start, message.end)
    dumped = [r.model_dump(mode="json", by_alias=True) for r in page.records]
    client.say(
        proto.History(session=page.session, start=page.start, records=dumped, ref=message.ref)
    )


async def _new_session(client: Client, message: proto.NewSession) -> None:
    moved = await client.move(
        "new", message.cwd, message.mcp_servers, discard_if_empty=message.discard_if_empty
    )
    _welcome(client, moved, message.ref)


async def _open_session(client: Client, message: proto.OpenSession) -> None:
    _welcome(
        client,
        await client.move(message.id, servers=message.mcp_servers, follow=message.follow),
        message.ref,
    )


async def _fork_session(client: Client, message: proto.ForkSession) -> None:
    _welcome(client, await client.fork(message.session, message.at), message.ref)


async def _rewind(client: Client, message: proto.Rewind) -> None:
    if message.files:
        record = await (await client.attached()).rewind_files(message.at)
        if record is not None:
            paths = list(record.paths)
            client.say(proto.Undone(calls=list(record.calls), paths=paths, ref=message.ref))
    _welcome(client, await client.rewind(message.at), message.ref)


async def _approve(client: Client, message: proto.Approve) -> proto.Error | None:
    handle = await client.attached()
    if not await handle.decide(message.call, message.decision, message.session):
        of = f" of session {message.session}" if message.session else ""
        return proto.Error(
            code="unknown_call", message=f"call {message.call}{of} waits for no approval"
        )
    client.say(
        proto.Approved(
            call=message.call, session=message.session, decision=message.decision, ref=message.ref
        )
    )
    return None


async def _set_mode(client: Client, message: proto.SetMode) -> None:
    session = await client.attached()
    state = await session.set_mode(message.mode, message.thinking, message.model, client.prefix)
    client.say(
        proto.ModeSet(
            session=state.session,
            mode=state.mode,
            thinking=state.thinking,
            model=state.model,
            models=list(state.models),
            ref=message.ref,
        )
    )


async def _undo(client: Client, message: proto.Undo) -> None:
    record = await (await client.attached()).undo(message.call)
    client.say(proto.Undone(calls=list(record.calls), paths=list(record.paths), ref=message.ref))


CODES: dict[type[SessionError], proto.ErrorCode] = {
    Busy: "busy",
    DuplicateTurn: "duplicate_id",
    TooManySessions: "too_many_sessions",
    NoSuchSession: "unknown_session",
    SessionUnavailable: "session_unavailable",
    FolderNotAllowed: "folder_refused",
    CannotUndo: "undo_refused",
    CannotFork: "fork_refused",
    UnknownModel: "unknown_model",
}
"""What each session error is on the wire."""

Handler = Callable[[Client, Any], Awaitable[proto.Error | None]]

HANDLERS: dict[type[proto.ClientMessage], Handler] = {
    proto.Hello: _hello,
    proto.Send: _send,
    proto.Compact: _compact,
    proto.Cancel: _cancel,
    proto.Subscribe: _subscribe,
    proto.StatusRequest: _status,
    proto.ContextRequest: _context,
    proto.SessionsRequest: _sessions,
    proto.HistoryRequest: _history,
    proto.NewSession: _new_session,
    proto.OpenSession: _open_session,
    proto.ForkSession: _fork_session,
    proto.Rewind: _rewind,
    proto.Approve: _approve,
    proto.Undo: _undo,
    proto.SetMode: _set_mode,
}


async def handle(client: Client, message: proto.ClientMessage) -> proto.Error | None:
    """Do what `message` asks; an error line for the client when it cannot be done. Any
    message may attach the client to a session first, which may fail. The error carries the
    message's `ref`."""
    try:
        error = await HANDLERS[type(message)](client, message)
    except SessionError as e:
        error = proto.Error(code=CODES[type(e)], message=str(e))
    except ActorFailed as e:  # the pool or the port failed on it, and restarts: try again
        error = proto.Error(code="busy", message=str(e))
    if error is None or message.ref is None:
        return error
    return error.model_copy(update={"ref": message.ref})
