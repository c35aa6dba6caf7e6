"""The session actor: owns one live conversation (its log, its turns, its subscribers). Everything
reaches it through its inbox (`_session_inbox`): messages to send, cancels, history pages,
status, subscriptions, approval decisions, undos and modes. Turns run one at a time, in order,
in a task of its own, each on a slot lent by the slot pool (`_pool`); every event of a turn is
published, tagged with the turn, to whoever subscribed.

Fan-out goes through one bounded channel per subscriber, filled with `send_nowait`: a
subscriber that falls behind is dropped (marked `lagged`, its channel closed), never the turn.
A subscriber that waits for its next message, with none queued, is handed it at once
(`Subscription.direct`).
The log on disk is the truth; a dropped client can read it again.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable

import trio

from loopd.inbox import reply_error, reply_value
from loopd.infer import slot_tokens
from loopd.session.compact import Compactor
from loopd.session.continued import record_went_on
from loopd.session.filling import filling
from loopd.session.fork import ForkRefused, fork_point
from loopd.session.records import Baseline, ContinuedRecord, ModeRecord, UndoRecord
from loopd.session.store import Session, Store, StoreError
from loopd.supervise import ActorFailed, short
from loopd.tools import PortHandle
from loopd.turn import Runtime
from loopd.turn.calls import approval_needed
from loopd.turn.changes import Hands, UndoRefused, undo, undo_after
from loopd.wire.events import TurnEvent

from ._agents import Agents
from ._compaction import Compaction
from ._errors import (
    Busy,
    CannotFork,
    CannotUndo,
    DuplicateTurn,
    SessionError,
    SessionFailed,
    SessionUnavailable,
)
from ._models import Models
from ._on_slot import Message, SlotTurns
from ._pool import PoolHandle
from ._session_inbox import (
    Cancel,
    Compact,
    ContextQuery,
    Continued,
    Fanout,
    History,
    HistoryPage,
    Left,
    ModeChanged,
    ModeState,
    Published,
    RewindFiles,
    Send,
    SessionContext,
    SessionHandle,
    SessionMessage,
    SessionStatus,
    SetMode,
    Status,
    Subscribe,
    TurnFailed,
    Undo,
    Unsubscribe,
    close_inbox,
)
from ._slots import SlotFiles

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

    def followed(self) -> bool:
        """Some client is in the session now."""
        return True


def _message(message: Send | Compact) -> Message:
    if isinstance(message, Compact):
        return Message(message.turn, None)
    return Message(message.turn, message.content, message.thinking)


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
        models: Models | None = None,
    ) -> None:
        self.agents, self.runtime, self.port, self.queue_limit = agents, runtime, port, queue_limit
        self.files = files
        self.hooks = hooks or SessionHooks()
        self.models = models or Models()
        compaction = Compaction(store, baseline, pool, files, compactor, self.models)
        self.turns = SlotTurns(
            session, runtime, pool, files, compaction, agents, self.hooks.renamed, self.models
        )
        self._queue: deque[Message] = deque()
        self._wake = trio.Event()
        self._fanout = Fanout()
        self._running: tuple[str, trio.CancelScope] | None = None
        self._handed_over: str | None = None
        """The turn its clients left while it waited for an approval: it runs to its end."""
        self._stop = trio.CancelScope()
        """Cancelled when the session fails: the actor stops, and `run` raises the failure."""
        self._failure: SessionFailed | None = None

    @property
    def session(self) -> Session:
        """Its session: the one it opened, or the one that continues it after a compaction."""
        return self.turns.session

    async def serve(self, inbox: trio.MemoryReceiveChannel[SessionMessage]) -> None:
        """Answer messages until cancelled; `run` closes the inbox, answering what is left."""
        async for message in inbox:
            try:
                await self._take(message)
            except SessionError as e:
                reply_error(message.reply, e)
            except UndoRefused as e:
                reply_error(message.reply, CannotUndo(str(e)))
            except ForkRefused as e:
                reply_error(message.reply, CannotFork(str(e)))
            except StoreError as e:  # the log could not be written: that request fails
                reply_error(message.reply, SessionUnavailable(str(e)))
            except ActorFailed as e:  # the port failed on it, and restarts: the asker hears it
                reply_error(message.reply, e)
            except Exception as e:  # a bug answering it: that request fails, the session goes on
                log.exception("session %s: answering %s failed", self.session.id, message)
                reply_error(message.reply, ActorFailed.of(f"session {self.session.id}", e))
            except trio.Cancelled:
                # The actor stops with this message in hand: its asker must not wait forever.
                # (One answered already keeps that answer: its reply channel holds one.)
                reply_error(message.reply, SessionUnavailable(self._closed_because()))
                raise

    async def _take(self, message: SessionMessage) -> None:  # noqa: C901, PLR0912 - one a message
        if isinstance(message, Send | Compact):
            reply_value(message.reply, self._submit(_message(message)))
        elif isinstance(message, Cancel):
            reply_value(message.reply, self._cancel(message.turn))
        elif isinstance(message, Left):
            await self._left()
            reply_value(message.reply, None)
        elif isinstance(message, History):
            page = HistoryPage.of(self.session.id, self.session.records, message.start, message.end)
            reply_value(message.reply, page)
        elif isinstance(message, Status):
            reply_value(message.reply, await self._status())
        elif isinstance(message, ContextQuery):
            reply_value(message.reply, self._context())
        elif isinstance(message, Subscribe):
            reply_value(message.reply, self._fanout.subscribe(message.buffer))
        elif isinstance(message, Undo):
            reply_value(message.reply, await self._undo(message.call))
        elif isinstance(message, RewindFiles):
            fork_point(self.session.header, self.session.records, message.at)
            reply_value(message.reply, await undo_after(self.session, self._hands(), message.at))
        elif isinstance(message, Continued):
            await self._continued(message)
            reply_value(message.reply, None)
        elif isinstance(message, SetMode):
            reply_value(message.reply, await self._set_mode(message))
        elif isinstance(message, Unsubscribe):
            self._fanout.unsubscribe(message.subscription)
            reply_value(message.reply, None)
        else:
            session = message.session or self.session.id
            mine = session == self.session.id or (
                self.agents is not None and self.agents.root(session) == self.session.id
            )
            decided = mine and await self.port.decide(session, message.call, message.decision)
            reply_value(message.reply, decided)

    async def _continued(self, message: Continued) -> None:
        # A compaction since the fork was made closed that log: it says where it went on.
        if message.parent == self.session.id:
            record = ContinuedRecord(session=message.session, by="rewind", at=message.at)
            await record_went_on(self.session, record)

    def _submit(self, message: Message) -> int:
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
                self._fanout.publish(
                    Published(turn, TurnFailed("cancelled", "cancelled before it ran"))
                )
                return True
        return False

    async def _left(self) -> None:
        """Every client has gone: nobody reads the running turn's answer, and the slot it
        holds is wanted by whoever comes next, so it is cancelled (recorded as a cancelled
        turn) and the messages that wait are dropped. A turn that waits for a person's
        approval is the exception: a script that exits on such a call (`bxctl chat -m`, exit
        6) leaves it to `bxctl approve`, so it is handed over and runs to its end within its
        limits (the approval's timeout first), whoever comes and goes meanwhile."""
        if self.hooks.followed() or self._running is None:
            return  # a client came back meanwhile, or nothing runs
        turn = self._running[0]
        if turn == self._handed_over:
            return
        if await self._pending():
            self._handed_over = turn
            log.info(
                "session %s: its clients left turn %s waiting for approval", self.session.id, turn
            )
            return
        if self.hooks.followed():  # a client came while the approvals were asked for
            return
        for waiting in self._queue:
            left = TurnFailed("cancelled", "not run: every client of the session left")
            self._fanout.publish(Published(waiting.turn, left))
        self._queue.clear()
        log.info("session %s: every client left; its turn %s is cancelled", self.session.id, turn)
        self._running[1].cancel()

    async def _undo(self, call: int | None) -> UndoRecord:
        record = await undo(self.session, self._hands(), call)
        log.info("session %s: undid calls %s in %s", self.session.id, record.calls, record.paths)
        return record

    def _hands(self) -> Hands:
        """What puts files back, while no turn runs."""
        if self._running is not None or self._queue:
            raise Busy("a turn is running: put files back once it has ended")
        hands = self.runtime.hands
        if hands is None or not hands.roots.within(self.session.cwd).roots:
            raise CannotUndo(
                "loopd changes no files in this session ([tools] roots is empty, and the "
                "session has no folder of its own)"
            )
        return hands

    async def _set_mode(self, message: SetMode) -> ModeState:
        """Write the session's new mode to its log, if it changes; a running turn's next tool
        call is decided by it, its next turn thinks by it and runs on its model (`UnknownModel`
        where loopd serves none of that name)."""
        session, mode, thinking = self.session, message.mode, message.thinking
        if message.model not in {None, session.model} and self._running is not None:
            # The turn's next request would render with the new model's template and go to
            # the old model's slot.
            raise Busy("a turn runs: change the model once it has ended")
        record = ModeRecord(
            mode=session.own_mode if mode is None else mode,
            thinking=session.thinking if thinking is None else thinking,
            model=session.model if message.model is None else self.models.checked(message.model),
        )
        changed = (record.mode, record.thinking, record.model) != (
            session.own_mode,
            session.thinking,
            session.model,
        )
        if changed:
            await session.append(record)
            log.info(
                "session %s: mode %s, thinking %s, model %s",
                session.id,
                record.mode,
                record.thinking,
                record.model,
            )
        think = self.runtime.loop.thinking if session.thinking is None else session.thinking
        models = self.models
        state = ModeState(session.id, session.mode, think, models.of(session), models.names)
        if changed:  # the session's other clients (another editor, a chat) show it too
            self._fanout.publish(ModeChanged(state, message.by))
        return state

    async def _status(self) -> SessionStatus:
        session, usage = self.session, self.session.last_usage()
        return SessionStatus(
            session=session.id,
            running=self._running[0] if self._running else None,
            queued=tuple(m.turn for m in self._queue),
            turns=session.turns,
            last_usage=usage,
            context=slot_tokens(usage.timings) if usage and usage.timings else None,
            past_reasoning=session.state.past_reasoning,
            pending=await self._pending(),
            plan=session.state.plan,
            model=self.models.of(session),
        )

    def _context(self) -> SessionContext:
        session = self.session
        instructions = session.header.instructions
        return SessionContext(
            session=session.id,
            system=session.baseline.system,
            instructions=instructions.files if instructions else (),
            offered=session.baseline.tools,
            found=tuple(e for e in self.runtime.registry.entries() if e.available),
            filling=filling(session.records),
        )

    async def _pending(self) -> tuple[Published, ...]:
        if self._running is None:
            return ()
        turn = self._running[0]
        pending = [approval_needed(a) for a in await self.port.pending(self.session.id)]
        for child in self.agents.under(self.session.id) if self.agents else ():
            pending += [approval_needed(a, child) for a in await self.port.pending(child)]
        return tuple(Published(turn, event) for event in pending)

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
        await self.turns.save()

    async def _turn(self, message: Message) -> None:
        def on_event(event: TurnEvent) -> None:
            self._fanout.publish(Published(message.turn, event))

        with trio.CancelScope() as scope:
            self._running = (message.turn, scope)
            try:
                ended = await self.turns.ended(message, on_event)
            except SessionFailed as failure:
                # Its supervisor (the registry) says so; every other session goes on.
                self._fail(message.turn, failure)
                return
            finally:
                self._running = None
            self._fanout.publish(Published(message.turn, ended))
        if scope.cancelled_caught:
            cancelled = TurnFailed("cancelled", "the turn was cancelled")
            self._fanout.publish(Published(message.turn, cancelled))

    def _closed_because(self) -> str:
        if self._failure is None:
            return "the session was closed"
        return f"{self._failure}; open it again (open_session) once that is fixed"

    def _fail(self, turn: str | None, failure: SessionFailed) -> None:
        """End the session: its clients hear why, then each of its turns ends, the running
        one (`turn`, if one ran) and those that wait, none of which will run."""
        self._fanout.publish(failure)
        if turn is not None:
            self._fanout.publish(Published(turn, TurnFailed("error", failure.message)))
        for waiting in self._queue:
            not_run = TurnFailed("error", f"not run, the session failed: {failure.message}")
            self._fanout.publish(Published(waiting.turn, not_run))
        self._queue.clear()
        self._failure = failure
        self._stop.cancel()

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
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self.run_turns)
                        nursery.start_soon(self.serve, receive)
                        task_status.started(handle)
                except Exception as e:  # a bug past the guards of a turn and of a message
                    log.exception("session %s: its actor failed", self.session.id)
                    self._fail(
                        None, SessionFailed(self.session.id, "error", f"loopd failed: {short(e)}")
                    )
        finally:
            handle.closed_because = self._closed_because()
            close_inbox(receive, handle.closed_because)
            self._fanout.close()
            self.session.close()
        if self._failure is not None:
            raise self._failure
