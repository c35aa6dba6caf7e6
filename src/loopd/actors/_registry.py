"""The live sessions: a session actor for each conversation a client is attached to or a turn
runs in, started in the registry's nursery when a client first attaches to it, and stopped
once no client is attached and no turn runs or waits (its log closed; its slot keeps its cache
in the pool until another session needs it).

Not an actor: its methods change its map without awaiting anything in between, and wait only
for a session to open or to stop, in the caller's task.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import trio

from loopd.session.closing import close_interrupted_turn, turn_open
from loopd.session.fork import ForkRefused, fork
from loopd.session.instructions import with_instructions
from loopd.session.records import Baseline, GivenServer, McpServersRecord
from loopd.session.store import (
    Listing,
    Session,
    SessionInfo,
    SessionLocked,
    Store,
    StoreError,
    UnknownSession,
    fault_of,
)
from loopd.tools import FolderRefused, PortHandle, Roots
from loopd.wire.proto import McpServer

from ._agents import Agents
from ._errors import (
    CannotFork,
    FolderNotAllowed,
    NoSuchSession,
    SessionFailed,
    SessionUnavailable,
    TooManySessions,
)
from ._instructions import InstructionReader
from ._session import SessionActor, SessionHooks
from ._session_inbox import SessionHandle

__all__ = ["SessionRegistry"]

log = logging.getLogger(__name__)

NEW = "new"
LATEST = "latest"


@dataclass(eq=False)
class _Live:
    ids: set[str]
    instructions: tuple[str, ...] = ()
    """The paths of the `AGENTS.md` files its baseline carries."""
    cwd: str | None = None
    """Its own folder (its header's)."""
    discard_if_empty: bool = False
    """Made new for a client that asked for it to go if nothing is said in it (`hello`'s)."""
    clients: int = 1
    idle: bool = True
    handle: SessionHandle | None = None
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)


class _Hooks(SessionHooks):
    def __init__(self, registry: SessionRegistry, live: _Live) -> None:
        self.registry, self.live = registry, live

    def idle(self) -> None:
        self.live.idle = True
        self.registry.close_if_unused(self.live)

    def busy(self) -> None:
        self.live.idle = False

    def renamed(self, old: str, new: str) -> None:
        self.registry.renamed(self.live, old, new)

    def followed(self) -> bool:
        return self.live.clients > 0


ActorFactory = Callable[[Session, SessionHooks, PortHandle], SessionActor]
"""Makes a session's actor, whose calls go through the port handle given."""
GivenTools = Callable[
    [Sequence[McpServer], Path | None],
    AbstractAsyncContextManager[tuple[PortHandle, tuple[GivenServer, ...]]],
]
"""Runs the MCP servers a client gave a session working in a folder while the block lasts
(`tools.given_tools`): the port as that session sees it (its skills among its tools), and what
became of each server."""


class SessionRegistry:
    def __init__(  # noqa: PLR0913 - what a new session is made of, and the bounds
        self,
        nursery: trio.Nursery,
        store: Store,
        baseline: Callable[[], Baseline],
        actor: ActorFactory,
        tools: GivenTools,
        *,
        max_live: int,
        roots: Roots,
        agents: Agents | None = None,
        instructions: InstructionReader | None = None,
    ) -> None:
        self._nursery, self.store, self._baseline = nursery, store, baseline
        self._actor, self._tools, self.max_live = actor, tools, max_live
        self.roots = roots
        """`[tools] roots`: a new session's own folder must be inside one of them."""
        self._agents = agents
        """The sub-agents running now, whose sessions their parents' turns hold."""
        self._instructions = instructions
        """Reads a new session's `AGENTS.md` files; None: none are read."""
        self._by_id: dict[str, _Live] = {}
        self._by_handle: dict[SessionHandle, _Live] = {}
        self._pending: dict[str, trio.Event] = {}
        """Sessions being opened or stopped: set when that is done."""

    @property
    def live(self) -> int:
        return len(set(self._by_id.values()))

    async def attach(
        self,
        which: str,
        cwd: str | None = None,
        servers: Sequence[McpServer] = (),
        *,
        discard_if_empty: bool = False,
    ) -> tuple[SessionHandle, str]:
        """The session `which` (an id, `latest` or `new`) for one more client: its handle and
        id; `cwd`: a new session's own folder (an existing one keeps its own); `servers`: MCP
        servers for it alone, started if this opens it (a live one keeps its own). Raises
        `TooManySessions`, `FolderNotAllowed`, `NoSuchSession` or `SessionUnavailable`."""
        try:
            folder = self.roots.folder(cwd) if cwd is not None and which == NEW else None
        except FolderRefused as e:
            raise FolderNotAllowed(str(e)) from None
        key = which
        if which == LATEST:
            which = await self.store.find_latest() or NEW
            # The first session, made for another client's `latest`; or the latest, stopping
            # (and removed if it holds nothing: `_discard_if_empty`): asked for again after.
            while (waiting := self._pending.get(LATEST, self._pending.get(which))) is not None:
                await waiting.wait()
                which = await self.store.find_latest() or NEW
            key = LATEST if which == NEW else which
        while which != NEW:
            if (live := self._by_id.get(which)) is not None and live.handle is not None:
                if servers:
                    log.info("session %s is live: the MCP servers given are not started", which)
                live.clients += 1
                return live.handle, which
            if (pending := self._pending.get(which)) is None:
                break
            await pending.wait()
        if self.live + len(self._pending) >= self.max_live:
            raise TooManySessions(
                f"loopd serves {self.max_live} sessions at once ([session] max_live); leave "
                "one, or wait for its turn to end"
            )
        return await self._open(which, key, folder, servers, discard_if_empty)

    async def fork(self, parent: str, at: int | None) -> tuple[SessionHandle, str]:
        """A new session, the fork of `parent` at the end of its turn `at` (its latest when
        None), for one more client, as `attach` gives it; `parent` stays as it is. Raises
        `CannotFork`, `NoSuchSession`, `SessionUnavailable`, or as `attach`."""
        try:
            forked = await fork(self.store, parent, at)
        except ForkRefused as e:
            raise CannotFork(str(e)) from None
        except UnknownSession as e:
            raise NoSuchSession(str(e)) from None
        except StoreError as e:
            why = f"session {parent} could not be forked: {fault_of(e)[1]}"
            log.warning("%s", why)
            raise SessionUnavailable(why) from None
        return await self.attach(forked)

    def cwd(self, session: str) -> str | None:
        """The own folder of live session `session` (None: none, or `[tools] roots`)."""
        live = self._by_id.get(session)
        return live.cwd if live is not None else None

    def instructions(self, session: str) -> tuple[str, ...]:
        """The paths of the `AGENTS.md` files the baseline of live session `session` carries."""
        live = self._by_id.get(session)
        return live.instructions if live is not None else ()

    async def _open(
        self,
        which: str,
        key: str,
        cwd: Path | None,
        servers: Sequence[McpServer],
        discard_if_empty: bool = False,
    ) -> tuple[SessionHandle, str]:
        """Open `which` (an id, or `new` in folder `cwd`) with `servers`; others asking for
        `key` meanwhile wait for it."""
        opened = trio.Event()
        if key != NEW:
            self._pending[key] = opened
        try:
            if which == NEW:
                session = await self._new(cwd)
                log.info("new session %s", session.id)
            else:
                session = await self._stored(which)
                log.info(
                    "session %s: %d records, %d turns", which, len(session.records), session.turns
                )
            files = session.header.instructions.files if session.header.instructions else ()
            live = _Live({session.id}, tuple(f.path for f in files), cwd=session.header.cwd)
            live.discard_if_empty = which == NEW and discard_if_empty
            live.handle = await self._nursery.start(self._serve, session, live, servers)
        finally:
            self._pending.pop(key, None)
            opened.set()
        self._by_id[session.id] = live
        self._by_handle[live.handle] = live
        return live.handle, session.id

    async def _new(self, cwd: Path | None) -> Session:
        """A new session in folder `cwd`, its baseline with the `AGENTS.md` files as they are
        now: the session keeps them as its header says, whatever happens to the files."""
        baseline, instructions = self._baseline(), None
        if self._instructions is not None:
            read = await trio.to_thread.run_sync(self._instructions.read, cwd)
            baseline, instructions = with_instructions(baseline, read)
        try:
            return await self.store.create(baseline, cwd=cwd, instructions=instructions)
        except StoreError as e:  # a full disk, a folder loopd may not write
            why = f"a new session could not be created: {fault_of(e)[1]}"
            log.warning("%s", why)
            raise SessionUnavailable(why) from None

    async def _stored(self, which: str) -> Session:
        self._refuse_running_sub_agent(which)
        try:
            session = await self.store.open(which)
        except UnknownSession as e:
            raise NoSuchSession(str(e)) from None
        except StoreError as e:  # locked by another process, or a log that does not read
            if isinstance(e, SessionLocked):
                self._refuse_running_sub_agent(which)  # one that started while it opened
            log.warning("session %s cannot be opened: %s", which, e)
            raise SessionUnavailable(str(e)) from None
        try:
            await close_interrupted(self.store, session)
        except StoreError as e:  # its closing records could not be written: not opened
            session.close()
            why = f"session {which} cannot be opened: {fault_of(e)[1]}"
            log.warning("%s", why)
            raise SessionUnavailable(why) from None
        return session

    def _refuse_running_sub_agent(self, which: str) -> None:
        """A running sub-agent's log is its parent's turn's to write: it opens once that call
        is over. Its news and approvals reach the clients of the session at the top."""
        if self._agents is None or (parent := self._agents.running.get(which)) is None:
            return
        top = self._agents.root(which)
        log.info("session %s: not opened, it is a sub-agent running under %s", which, parent)
        raise SessionUnavailable(
            f"session {which} is a sub-agent that runs now, in a turn of session {parent}; "
            f"follow it from session {top}, whose clients see its progress and answer its "
            "approvals, and open it once its task is done"
        )

    async def _serve(
        self,
        session: Session,
        live: _Live,
        servers: Sequence[McpServer],
        *,
        task_status: trio.TaskStatus[SessionHandle],
    ) -> None:
        """Supervise one session actor, and the MCP servers it was given, which stop with it:
        its failure closes that session alone, and is forgotten, so the next client to ask
        for the session opens it again."""
        try:
            with live.scope:
                async with self._tools(servers, session.cwd) as (port, given):
                    if given:
                        await _record(session, given)
                    actor = self._actor(session, _Hooks(self, live), port)
                    await actor.run(task_status=task_status)
        except SessionFailed as e:
            log.error("%s; it is closed, every other session goes on", e)  # noqa: TRY400 - no bug
            self._forget_failed(live)
        else:  # stopped, its log closed: before anyone waiting for it may open it again
            if live.discard_if_empty:
                await self._discard_if_empty(live)
        finally:
            # Its actor closes the log when it stops; one cancelled before its actor ran (the
            # client that asked for it left while its tools started) would hold it, and its
            # lock, for as long as loopd runs: closing twice is nothing.
            session.close()
            live.done.set()

    async def _discard_if_empty(self, live: _Live) -> None:
        """Remove a session its clients left holding nothing (a chat quit before its first
        message): it would only fill the lists. Only where the client that made it asked
        (`discard_if_empty`): an editor's session is prompted later, maybe by another
        process (acpx makes a session with one and prompts with the next)."""
        for session in live.ids:
            try:
                if await self.store.discard_if_empty(session):
                    log.info("session %s: removed, it holds nothing", session)
            except StoreError as e:
                log.warning("session %s holds nothing, and stays: %s", session, e)

    def _forget_failed(self, live: _Live) -> None:
        for session in live.ids:
            if self._by_id.get(session) is live:
                del self._by_id[session]
        if live.handle is not None and self._by_handle.get(live.handle) is live:
            del self._by_handle[live.handle]

    def detach(self, handle: SessionHandle) -> None:
        """A client left the session of `handle`."""
        if (live := self._by_handle.get(handle)) is not None:
            live.clients -= 1
            if live.clients == 0 and not live.idle:  # its turn runs for nobody
                self._nursery.start_soon(self._left, handle)
            self.close_if_unused(live)

    async def _left(self, handle: SessionHandle) -> None:
        with suppress(SessionUnavailable):  # it stopped meanwhile
            await handle.left()

    def close_if_unused(self, live: _Live) -> None:
        if live.clients > 0 or not live.idle or live.handle is None:
            return
        for session in live.ids:
            del self._by_id[session]
            self._pending[session] = live.done  # reopened once its log is closed
            self._nursery.start_soon(self._forget, session, live.done)
        del self._by_handle[live.handle]
        live.scope.cancel()

    async def _forget(self, session: str, done: trio.Event) -> None:
        await done.wait()
        if self._pending.get(session) is done:
            del self._pending[session]

    def renamed(self, live: _Live, old: str, new: str) -> None:
        live.ids.discard(old)
        self._by_id.pop(old, None)
        live.ids.add(new)
        self._by_id[new] = live

    async def sessions(self) -> Listing:
        """Every session, oldest first, and the logs that do not read; the sub-agents a crash
        cut off closed first."""
        listing = await self.store.listing()
        if await self._close_cut_off(listing.sessions):
            listing = await self.store.listing()
        for bad in listing.unreadable:  # the person who lists them hears it too
            log.warning("%s is left out of the list of sessions: %s", bad.path, bad.reason)
        return listing

    async def _close_cut_off(self, infos: list[SessionInfo]) -> bool:
        """Close the logs of sub-agents whose turn was open when loopd stopped, as their
        parent's opening would: a parent may never be opened again, and the listing read
        every log already. True if one was closed."""
        closed = False
        for info in infos:
            if not info.open_turn or info.parent is None or info.id in self._by_id:
                continue
            if info.id in self._pending:
                continue
            done = self._pending[info.id] = trio.Event()  # a client that asks for it waits
            try:
                with await self.store.open(info.id) as child:
                    closed |= await close_interrupted(self.store, child)
            except SessionLocked:
                pass  # its parent's turn runs it now, or its parent's opening closes it
            except StoreError as e:
                log.warning("sub-agent session %s: its interrupted turn stays open: %s", info.id, e)
            finally:
                del self._pending[info.id]
                done.set()
        return closed


async def _record(session: Session, given: tuple[GivenServer, ...]) -> None:
    """Write which servers the session was given; a log that cannot take it is not opened."""
    try:
        await session.append(McpServersRecord(servers=given))
    except StoreError as e:
        session.close()
        why = f"session {session.id} cannot be opened: {fault_of(e)[1]}"
        log.warning("%s", why)
        raise SessionUnavailable(why) from None


async def close_interrupted(store: Store, session: Session) -> bool:
    """Close the turn loopd stopped in, if the log shows one, and the logs of the sub-agents
    it had started (each as interrupted; none runs again). True if there was one."""
    if not turn_open(session):
        return False
    infos = [i for i in await store.sessions() if i.parent == session.id]
    children: dict[str, tuple[int, str]] = {}
    for info in infos:
        header = await store.header(info.id)
        if header.call_id is not None and header.call is not None:
            children[header.call_id] = (header.call, info.id)
    await close_interrupted_turn(session, children)
    log.warning("the last turn of session %s was interrupted; its log is closed", session.id)
    for info in infos:
        if not info.open_turn:
            continue  # closed already: opened itself, or listed since
        try:
            with await store.open(info.id) as child:
                await close_interrupted(store, child)
        except SessionLocked:
            continue  # held in this loopd (a person went on in it, or a listing closes it)
    return True
