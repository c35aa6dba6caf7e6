"""The session actor: owns one live conversation (its log, its turns, its subscribers). Everything
reaches it through its inbox (`_session_inbox`): messages to send, cancels, history pages,
status, subscriptions, approval decisions and undos. Turns run one at a time, in order, in a task of
its own, each on a slot lent by the slot pool (`_pool`); every event of a turn is published,
tagged with the turn, to whoever subscribed.

Fan-out goes through one bounded channel per subscriber, filled with `send_nowait`: a
subscriber that falls behind is dropped (marked `lagged`, its channel closed), never the turn.
The log on disk is the truth; a dropped client can read it again.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import trio

from loopd.calls import approval_needed
from loopd.changes import UndoRefused, undo
from loopd.compact import Compactor, SummaryFailed, continued_baseline
from loopd.events import Compacting, SessionContinued, TurnEvent
from loopd.exact import past_reasoning
from loopd.inbox import reply_error, reply_value
from loopd.infer import InferError, Queued, slot_tokens
from loopd.records import Baseline, FailureKind, UndoRecord, UsageRecord
from loopd.slots import SlotFiles
from loopd.store import Session, Store, StoreError
from loopd.tools import PortHandle
from loopd.turn import InferFailed, Runtime, SessionFull, TurnError, TurnOutcome, run_turn

from ._agents import Agents
from ._errors import (
    Busy,
    CannotUndo,
    DuplicateTurn,
    SessionError,
    SessionFailed,
    SessionUnavailable,
)
from ._pool import Lease, PoolHandle
from ._session_inbox import (
    HISTORY_PAGE,
    Cancel,
    Compact,
    History,
    HistoryPage,
    Published,
    Send,
    SessionHandle,
    SessionMessage,
    SessionStatus,
    Status,
    Subscribe,
    Subscription,
    SubscriptionItem,
    TurnDone,
    TurnFailed,
    Undo,
    Unsubscribe,
)

__all__ = ["SessionActor"]

log = logging.getLogger(__name__)

SAVE_AFTER_IDLE = 0.5
"""Seconds without a message after a turn before the slot is saved (`[slots] save = "turn"`)."""


class SessionHooks:
    """What the actor tells whoever keeps the live sessions (`_registry`); nothing by default."""

    def idle(self) -> None:
        """No turn runs or waits."""

    def busy(self) -> None:
        """A turn was queued."""

    def renamed(self, old: str, new: str) -> None:
        """The conversation goes on in session `new` (a compaction)."""


@dataclass
class _Message:
    turn: str
    content: str | None
    """The user's message; None: a compaction."""
    thinking: bool | None = None

    @classmethod
    def of(cls, message: Send | Compact) -> _Message:
        if isinstance(message, Compact):
            return cls(message.turn, None)
        return cls(message.turn, message.content, message.thinking)


class SessionActor:
    """Start it with `nursery.start(actor.run)`, which gives its handle."""

    def __init__(  # noqa: PLR0913 - the actor's whole world
        self,
        session: Session,
        *,
        store: Store,
        baseline: Callable[[], Baseline],
        runtime: Runtime,
        port: PortHandle,
        pool: PoolHandle,
        files: SlotFiles,
        compactor: Compactor,
        queue_limit: int,
        agents: Agents | None = None,
        hooks: SessionHooks | None = None,
    ) -> None:
        self.session, self.store, self.baseline = session, store, baseline
        self.agents = agents
        self.runtime, self.port, self.queue_limit = runtime, port, queue_limit
        self.pool, self.files, self.compactor = pool, files, compactor
        self.hooks = hooks or SessionHooks()
        self._queue: deque[_Message] = deque()
        self._wake = trio.Event()
        self._subscribers: list[Subscription] = []
        self._running: tuple[str, trio.CancelScope] | None = None
        self._stop = trio.CancelScope()
        """Cancelled when the session fails: the actor stops, and `run` raises the failure."""
        self._failure: SessionFailed | None = None

    async def serve(self, inbox: trio.MemoryReceiveChannel[SessionMessage]) -> None:
        """Answer messages until cancelled; `run` closes the inbox, answering what is left."""
        async for message in inbox:
            try:
                await self._take(message)
            except SessionError as e:
                reply_error(message.reply, e)
            except UndoRefused as e:
                reply_error(message.reply, CannotUndo(str(e)))
            except StoreError as e:  # the log could not be written: that request fails
                reply_error(message.reply, SessionUnavailable(str(e)))
            except trio.Cancelled:
                # The actor stops with this message in hand: its asker must not wait forever.
                # (One answered already keeps that answer: its reply channel holds one.)
                reply_error(message.reply, SessionUnavailable(self._closed_because()))
                raise

    async def _take(self, message: SessionMessage) -> None:
        if isinstance(message, Send | Compact):
            reply_value(message.reply, self._submit(_Message.of(message)))
        elif isinstance(message, Cancel):
            reply_value(message.reply, self._cancel(message.turn))
        elif isinstance(message, History):
            reply_value(message.reply, self._history(message.start, message.end))
        elif isinstance(message, Status):
            reply_value(message.reply, await self._status())
        elif isinstance(message, Subscribe):
            subscription = Subscription(message.buffer)
            self._subscribers.append(subscription)
            reply_value(message.reply, subscription)
        elif isinstance(message, Undo):
            reply_value(message.reply, await self._undo(message.call))
        elif isinstance(message, Unsubscribe):
            message.subscription.close()
            if message.subscription in self._subscribers:
                self._subscribers.remove(message.subscription)
            reply_value(message.reply, None)
        else:
            session = message.session or self.session.id
            mine = session == self.session.id or (
                self.agents is not None and self.agents.root(session) == self.session.id
            )
            decided = mine and await self.port.decide(session, message.call, message.decision)
            reply_value(message.reply, decided)

    def _submit(self, message: _Message) -> int:
        running = self._running[0] if self._running else None
        if message.turn == running or any(m.turn == message.turn for m in self._queue):
            raise DuplicateTurn(message.turn)
        # The head of the queue runs as soon as the turn task takes it: it is not waiting.
        waiting = len(self._queue) if self._running else max(0, len(self._queue) - 1)
        if waiting >= self.queue_limit:
            raise Busy(f"{waiting} messages are already waiting for the running turn")
        position = len(self._queue) + (self._running is not None)
        self._queue.append(message)
        self._wake.set()
        self.hooks.busy()
        return position

    def _cancel(self, turn: str) -> bool:
        if self._running and self._running[0] == turn:
            self._running[1].cancel()
            return True
        for message in self._queue:
            if message.turn == turn:
                self._queue.remove(message)
                self._publish(Published(turn, TurnFailed("cancelled", "cancelled before it ran")))
                return True
        return False

    async def _undo(self, call: int | None) -> UndoRecord:
        if self._running is not None or self._queue:
            raise Busy("a turn is running: undo once it has ended")
        hands = self.runtime.hands
        if hands is None:
            raise CannotUndo("loopd changes no files here ([tools] roots is empty)")
        record = await undo(self.session, hands, call)
        log.info("session %s: undid calls %s in %s", self.session.id, record.calls, record.paths)
        return record

    def _history(self, start: int | None, end: int | None) -> HistoryPage:
        records = self.session.records
        begin = start or 0
        first = begin if begin >= 0 else max(0, len(records) + begin)  # negative: from the end
        stop = len(records) if end is None else min(end, len(records))
        page = records[first : min(stop, first + HISTORY_PAGE)]
        return HistoryPage(self.session.id, first, page)

    async def _status(self) -> SessionStatus:
        session, usage = self.session, self.session.last_usage()
        return SessionStatus(
            session=session.id,
            running=self._running[0] if self._running else None,
            queued=tuple(m.turn for m in self._queue),
            turns=session.turns,
            last_usage=usage,
            context=slot_tokens(usage.timings) if usage and usage.timings else None,
            past_reasoning=past_reasoning(session.records),
            pending=await self._pending(),
        )

    async def _pending(self) -> tuple[Published, ...]:
        if self._running is None:
            return ()
        turn = self._running[0]
        pending = [approval_needed(a) for a in await self.port.pending(self.session.id)]
        for child in self.agents.under(self.session.id) if self.agents else ():
            pending += [approval_needed(a, child) for a in await self.port.pending(child)]
        return tuple(Published(turn, event) for event in pending)

    def _publish(self, message: SubscriptionItem) -> None:
        self._subscribers = [s for s in self._subscribers if s.offer(message)]

    async def run_turns(self) -> None:
        """Take messages in order and run their turns, until cancelled."""
        while True:
            if not self._queue:
                self.hooks.idle()
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            await self._turn(self._queue.popleft())
            if not self._queue and self.files.save_when == "turn":
                await self._save_when_idle()

    async def _save_when_idle(self) -> None:
        """Save the slot once no message came for a moment: a message that comes first runs
        first, and the save waits for the next quiet moment after it. A slot that went to
        another session meanwhile was saved then."""
        self._wake = trio.Event()
        with trio.move_on_after(SAVE_AFTER_IDLE):
            await self._wake.wait()
            return
        async with self.pool.lease(self.session.id, hot_only=True) as lease:
            if lease is not None:
                await self.files.save(lease.slot, self.session.id)

    async def _turn(self, message: _Message) -> None:
        def on_event(event: TurnEvent) -> None:
            self._publish(Published(message.turn, event))

        with trio.CancelScope() as scope:
            self._running = (message.turn, scope)
            try:
                async with self._slot(on_event) as lease:
                    outcome = await self._on(lease, message, on_event)
                self._publish(Published(message.turn, TurnDone(outcome)))
            except TurnError as e:
                kind: FailureKind = "infer" if isinstance(e, InferFailed) else e.reason
                self._publish(Published(message.turn, TurnFailed(kind, str(e))))
            except InferError as e:  # a compaction a client asked for
                self._publish(Published(message.turn, TurnFailed("infer", str(e))))
            except SummaryFailed as e:
                self._publish(Published(message.turn, TurnFailed("error", str(e))))
            except StoreError as e:
                # The log cannot be written: the session cannot go on. It closes; its
                # supervisor (the registry) says so, and every other session goes on.
                self._fail(message.turn, SessionFailed.of(self.session.id, e))
            except Exception as e:
                # A bug in a turn ends that turn (its log closed as `error`), never the actor:
                # the next message is served.
                log.exception("turn %s failed", message.turn)
                failure = TurnFailed("error", f"loopd failed: {type(e).__name__}: {e}")
                self._publish(Published(message.turn, failure))
            finally:
                self._running = None
        if scope.cancelled_caught:
            self._publish(
                Published(message.turn, TurnFailed("cancelled", "the turn was cancelled"))
            )

    def _closed_because(self) -> str:
        if self._failure is None:
            return "the session was closed"
        return f"{self._failure}; open it again (open_session) once that is fixed"

    def _fail(self, turn: str, failure: SessionFailed) -> None:
        """End the session: its clients hear why, then each of its turns ends, the running
        one and those that wait, none of which will run."""
        self._publish(failure)
        self._publish(Published(turn, TurnFailed("error", failure.message)))
        for waiting in self._queue:
            not_run = TurnFailed("error", f"not run, the session failed: {failure.message}")
            self._publish(Published(waiting.turn, not_run))
        self._queue.clear()
        self._failure = failure
        self._stop.cancel()

    @asynccontextmanager
    async def _slot(self, on_event: Callable[[TurnEvent], None]) -> AsyncIterator[Lease]:
        """A slot for the turn; while every slot runs a turn, the client hears it waits."""
        # Which server saved its slot file: a read of the note, worth it only with several.
        prefer = self.files.server_of(self.session.id) if self.pool.servers > 1 else None
        async with self.pool.lease(self.session.id, prefer=prefer, wait=False) as lease:
            if lease is not None:
                yield lease
                return
        on_event(Queued())
        async with self.pool.lease(self.session.id, prefer=prefer) as lease:
            assert lease is not None  # noqa: S101 - a waiting lease always comes
            yield lease

    async def _on(
        self, lease: Lease, message: _Message, on_event: Callable[[TurnEvent], None]
    ) -> TurnOutcome:
        """The message's turn on the slot `lease` lends; the slot is left holding the
        session's cache, as far as the session knows it."""
        session, start = self.session, len(self.session.records)
        try:
            await self.pool.prepare(lease, self.files, session)
            if message.content is None:
                return await self._compact(lease, on_event)
            return await self._answer(lease, message.content, message.thinking, on_event)
        finally:
            if lease.tokens and not lease.hot:
                _check_restore(session, start, lease.tokens)
            usage = self.session.last_usage()
            lease.owner = self.session.id
            lease.tokens = slot_tokens(usage.timings) if usage and usage.timings else None

    async def _answer(
        self,
        lease: Lease,
        content: str,
        thinking: bool | None,
        on_event: Callable[[TurnEvent], None],
    ) -> TurnOutcome:
        """One turn; where the context is full and `[session] on_full = "continue"`, the
        session is compacted and the message answered in the session that continues it."""
        exact = self.runtime.exact
        runtime = replace(
            self.runtime,
            inference=lease.slot,
            slot=lease.slot.number,
            exact=exact.on(lease.slot.client) if exact else None,  # the templates of its server
        )

        def delegating(runtime: Runtime) -> Runtime:
            """Its `delegate` calls start sub-agents of the session as it is now."""
            if self.agents is None:
                return runtime
            return replace(runtime, delegate=self.agents.for_turn(self.session, runtime))

        try:
            return await run_turn(
                self.session, delegating(runtime), content, on_event, thinking=thinking
            )
        except SessionFull as full:
            # A session holding nothing but this message has nothing to compact.
            if self.compactor.on_full != "continue" or self.session.turns <= 1:
                raise
            try:
                await self._compact(lease, on_event)
            except (InferError, SummaryFailed) as e:
                raise SessionFull(f"{full}; continuing in a new session failed: {e}") from e
        return await run_turn(
            self.session, delegating(runtime), content, on_event, thinking=thinking
        )

    async def _compact(self, lease: Lease, on_event: Callable[[TurnEvent], None]) -> TurnOutcome:
        """Summarise the session and go on in a new one that continues it. The summary runs on
        a slot of no session where one is idle, so the old session's slot keeps its cache; on
        the session's own slot otherwise, once that cache is saved."""
        old = self.session
        async with self.pool.lease(None, wait=False) as side:
            if side is not None:
                await self.pool.prepare(side, self.files, None)
            else:
                log.info(
                    "no slot is free for session %s: the summary is written on its own slot, "
                    "its cache saved first",
                    old.id,
                )
                await self.files.save(lease.slot, old.id)
            slot = (side or lease).slot
            on_event(Compacting(session=old.id, slot=slot.number))
            summary = await self.compactor.summarize(old.records, slot, on_event)
        with trio.CancelScope(shield=True):  # the new session whole, or not at all
            new = await self.store.create(
                continued_baseline(self.baseline(), summary.text),
                continues=old.id,
                grants=old.granted,
                cwd=old.cwd,
            )
            self.session = new
            old.close()
            await new.append(summary.record(old.id, slot.number))
            self.hooks.renamed(old.id, new.id)
            if side is not None:  # the old session's cache, for a return to it
                await self.files.save(lease.slot, old.id)
        log.info("session %s continues %s from a summary", new.id, old.id)
        on_event(SessionContinued(previous=old.id, session=new.id, summary=summary.text))
        return TurnOutcome(summary.text, UsageRecord(timings=summary.completion.timings))

    async def run(
        self, *, task_status: trio.TaskStatus[SessionHandle] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve the session (and the sessions that continue it) until cancelled; the actor
        closes its session when it stops. Raises `SessionFailed` when its log could not be
        written (its clients were told)."""
        # Unbounded, and safe so: every sender waits for its answer (`ask`), so what waits in
        # it is at most one message per client task, and clients are bounded
        # (`[channel] max_clients`).
        send, receive = trio.open_memory_channel[SessionMessage](math.inf)
        handle = SessionHandle(send)
        try:
            with self._stop:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.run_turns)
                    nursery.start_soon(self.serve, receive)
                    task_status.started(handle)
        finally:
            handle.closed_because = self._closed_because()
            _close_inbox(receive, handle.closed_because)
            for subscription in self._subscribers:
                subscription.close()
            self.session.close()
        if self._failure is not None:
            raise self._failure


def _close_inbox(inbox: trio.MemoryReceiveChannel[SessionMessage], why: str) -> None:
    """Answer what waits unread, then close: with no checkpoint between the two, no asker is
    left waiting for an answer that never comes (a later one finds the inbox closed)."""
    while True:
        try:
            message = inbox.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            break
        reply_error(message.reply, SessionUnavailable(why))
    inbox.close()


def _check_restore(session: Session, start: int, restored: int) -> None:
    """Say why, when the first request after a restore found less than the file held (its
    loss is recorded by the turn)."""
    usage = next((r for r in session.records[start:] if isinstance(r, UsageRecord)), None)
    if usage and usage.timings and usage.timings.cache_n < restored:
        log.warning(
            "session %s: its slot file restored %d tokens, and llama-server reused %d of them. "
            "A model with a sliding window (Gemma 3 and 4, gpt-oss) keeps only the window "
            "unless llama-server runs with --swa-full (the embedded one does)",
            session.id,
            restored,
            usage.timings.cache_n,
        )
