"""The session actor's inbox: its messages, what they answer, and the handle that sends them.

Each `SessionHandle` method is one message and waits for its answer; an error the actor
answers with (a `SessionError`) is raised in the caller.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import trio

from loopd.inbox import Reply, ask, reply_error
from loopd.session.filling import Filling
from loopd.session.records import (
    Decision,
    FailureKind,
    InstructionFile,
    Mode,
    PlanRecord,
    Record,
    UndoRecord,
    UsageRecord,
)
from loopd.tools import ToolEntry
from loopd.turn import TurnOutcome
from loopd.wire.events import TurnEvent
from loopd.wire.proto import HISTORY_PAGE

from ._errors import SessionFailed, SessionUnavailable

__all__ = [
    "HISTORY_PAGE",
    "Fanout",
    "HistoryPage",
    "ModeChanged",
    "ModeState",
    "Published",
    "SessionContext",
    "SessionHandle",
    "SessionMessage",
    "SessionStatus",
    "Subscription",
    "SubscriptionItem",
    "TurnDone",
    "TurnFailed",
    "close_inbox",
]


T = TypeVar("T")


@dataclass(frozen=True)
class TurnDone:
    outcome: TurnOutcome


@dataclass(frozen=True)
class TurnFailed:
    kind: FailureKind
    message: str


@dataclass(frozen=True)
class Published:
    turn: str
    """The id the client gave the message that started the turn."""
    item: TurnEvent | TurnDone | TurnFailed


@dataclass(frozen=True)
class ModeChanged:
    """A client changed the session's mode, thinking or model: every other client hears it."""

    state: ModeState
    by: str | None
    """The client that changed it (its turns' prefix), which has its answer already."""


SubscriptionItem = Published | SessionFailed | ModeChanged
"""What a subscriber hears: a turn's events, a change of the session's mode, and, if its log
fails, the session's end (then the `turn_failed` of each of its turns)."""


class Subscription:
    def __init__(self, buffer: int) -> None:
        self._send, self.receive = trio.open_memory_channel[SubscriptionItem](buffer)
        self.lagged = False
        """Set when it fell behind and was dropped. Written once, by the session actor, just
        before it closes the channel; read by the subscriber only once the channel has ended:
        the close orders the two, so the flag needs no owner of its own."""
        self.direct: Callable[[SubscriptionItem], None] | None = None
        """What the subscriber does with a message, set by it while it reads `receive`: a
        message offered while it waits there, with none before it, is handed to this at once,
        in the sender's task, one pass of trio's loop sooner. It must not block nor raise."""

    def offer(self, message: SubscriptionItem) -> bool:
        waiting = self._send.statistics()
        if self.direct and waiting.tasks_waiting_receive and not waiting.current_buffer_used:
            self.direct(message)
            return True
        try:
            self._send.send_nowait(message)
        except trio.WouldBlock:
            self.lagged = True
            self._send.close()
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False  # the subscriber went away
        return True

    def close(self) -> None:
        self._send.close()


class Fanout:
    """A session's subscribers: each message offered to all, a subscriber that falls behind
    dropped (`Subscription.offer`), never the sender."""

    def __init__(self) -> None:
        self._subscribers: list[Subscription] = []

    def subscribe(self, buffer: int) -> Subscription:
        subscription = Subscription(buffer)
        self._subscribers.append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        subscription.close()
        if subscription in self._subscribers:
            self._subscribers.remove(subscription)

    def publish(self, message: SubscriptionItem) -> None:
        self._subscribers = [s for s in self._subscribers if s.offer(message)]

    def close(self) -> None:
        for subscription in self._subscribers:
            subscription.close()


@dataclass(frozen=True)
class SessionStatus:
    session: str
    running: str | None
    """The turn that runs, if any."""
    queued: tuple[str, ...]
    """Turns waiting behind it, in order."""
    turns: int
    last_usage: UsageRecord | None
    context: int | None
    """Tokens the slot holds for this session after its last request."""
    past_reasoning: int | None
    pending: tuple[Published, ...]
    """Approvals the running turn waits for, as the events that asked for them."""
    plan: PlanRecord | None = None
    """The model's plan, as its last `update_plan` set it."""
    model: str | None = None
    """The model its turns run on (`[models.NAME]`); None: loopd serves one unnamed model."""


@dataclass(frozen=True)
class HistoryPage:
    session: str
    start: int
    records: Sequence[Record]

    @classmethod
    def of(
        cls, session: str, records: Sequence[Record], start: int | None, end: int | None
    ) -> HistoryPage:
        """Records `start` (negative: from the end) to `end`, `HISTORY_PAGE` at most."""
        begin = start or 0
        first = begin if begin >= 0 else max(0, len(records) + begin)
        stop = len(records) if end is None else min(end, len(records))
        return cls(session, first, records[first : min(stop, first + HISTORY_PAGE)])


# -- the inbox -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    turn: str
    content: str
    thinking: bool | None
    reply: Reply[int]


@dataclass(frozen=True)
class Compact:
    turn: str
    reply: Reply[int]


@dataclass(frozen=True)
class Cancel:
    turn: str
    reply: Reply[bool]


@dataclass(frozen=True)
class Left:
    """Every client of the session has gone (`SessionActor._left` says what becomes of its
    turns)."""

    reply: Reply[None]


@dataclass(frozen=True)
class History:
    start: int | None
    end: int | None
    reply: Reply[HistoryPage]


@dataclass(frozen=True)
class Status:
    reply: Reply[SessionStatus]


@dataclass(frozen=True)
class SessionContext:
    """What the session's model sees, and how its slot is filled."""

    session: str
    system: str
    """The system prompt, the `AGENTS.md` block included."""
    instructions: tuple[InstructionFile, ...]
    offered: tuple[dict[str, Any], ...]
    """The tool definitions the model is given (`find_tool`, `call_tool`)."""
    found: tuple[ToolEntry, ...]
    """The tools behind them, that `find_tool` finds."""
    filling: Filling | None


@dataclass(frozen=True)
class ContextQuery:
    reply: Reply[SessionContext]


@dataclass(frozen=True)
class Subscribe:
    buffer: int
    reply: Reply[Subscription]


@dataclass(frozen=True)
class Unsubscribe:
    subscription: Subscription
    reply: Reply[None]


@dataclass(frozen=True)
class Decide:
    call: int
    decision: Decision
    session: str | None
    """A sub-agent's session, for one of its calls; None: this session's."""
    reply: Reply[bool]


@dataclass(frozen=True)
class Undo:
    call: int | None
    reply: Reply[UndoRecord]


@dataclass(frozen=True)
class RewindFiles:
    at: int
    reply: Reply[UndoRecord | None]


@dataclass(frozen=True)
class Continued:
    """Session `parent` went on in `session`, a fork of it at turn `at`'s end (a rewind)."""

    parent: str
    session: str
    at: int
    reply: Reply[None]


@dataclass(frozen=True)
class ModeState:
    """A session's mode, and whether its turns think (`[loop] thinking` where it says none)."""

    session: str
    mode: Mode
    thinking: bool
    model: str | None = None
    """The model its turns run on; None: loopd serves one unnamed model."""
    models: tuple[str, ...] = ()
    """The models it may run on."""


@dataclass(frozen=True)
class SetMode:
    mode: Mode | None
    """None: as it is."""
    thinking: bool | None
    """None: as it is."""
    reply: Reply[ModeState]
    model: str | None = None
    """None: as it is."""
    by: str | None = None
    """The client that asks (its turns' prefix): told of the change by its answer alone."""


SessionMessage = (
    Send
    | Compact
    | Cancel
    | Left
    | History
    | Status
    | ContextQuery
    | Subscribe
    | Unsubscribe
    | Decide
    | Undo
    | RewindFiles
    | Continued
    | SetMode
)


class SessionHandle:
    """What the channel holds: each method is one message to the actor and its answer."""

    def __init__(self, inbox: trio.MemorySendChannel[SessionMessage]) -> None:
        self._inbox = inbox
        self.closed_because = "the session was closed"
        """What a message to an actor that stopped is answered with (`SessionUnavailable`)."""

    async def _ask(self, build: Callable[[Reply[T]], SessionMessage]) -> T:
        try:
            return await ask(self._inbox, build)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise SessionUnavailable(self.closed_because) from None

    async def send(self, turn: str, content: str, thinking: bool | None = None) -> int:
        """Queue a user message; its position (0: runs now). Raises `Busy` when too many wait."""
        return await self._ask(lambda r: Send(turn, content, thinking, r))

    async def compact(self, turn: str) -> int:
        """Queue a compaction (run like a turn, by the id `turn`): the model summarises the
        session and a new one continues from the summary. Its position, as for `send`."""
        return await self._ask(lambda r: Compact(turn, r))

    async def cancel(self, turn: str) -> bool:
        """Cancel a running or waiting turn; False when there is no such turn."""
        return await self._ask(lambda r: Cancel(turn, r))

    async def left(self) -> None:
        """Every client has gone: its turns end, unless one waits for a person's approval."""
        await self._ask(Left)

    async def history(self, start: int | None = None, end: int | None = None) -> HistoryPage:
        """Records of the current session from `start` (negative: from the end) to `end`, at
        most `HISTORY_PAGE` of them."""
        return await self._ask(lambda r: History(start, end, r))

    async def status(self) -> SessionStatus:
        return await self._ask(Status)

    async def context(self) -> SessionContext:
        """What the model sees: its system prompt, instructions and tools, and how full its
        slot is."""
        return await self._ask(ContextQuery)

    async def subscribe(self, buffer: int) -> Subscription:
        return await self._ask(lambda r: Subscribe(buffer, r))

    async def unsubscribe(self, subscription: Subscription) -> None:
        # Shielded, so a leaving client does not leave its channel behind; bounded, for an
        # actor that stopped with the message unread. (A stopped actor has closed every
        # subscription already.)
        gone = (trio.BrokenResourceError, trio.ClosedResourceError, SessionUnavailable)
        with trio.CancelScope(shield=True), trio.move_on_after(1), contextlib.suppress(*gone):
            await self._ask(partial(Unsubscribe, subscription))

    async def undo(self, call: int | None = None) -> UndoRecord:
        """Put back what call `call` (None: the last turn that changed files) changed. Raises
        `Busy` while a turn runs, `CannotUndo` when there is nothing to undo or a file changed
        since."""
        return await self._ask(lambda r: Undo(call, r))

    async def rewind_files(self, at: int) -> UndoRecord | None:
        """Put back what the turns after turn `at` changed, the files as they were at its end
        (None: those turns changed none), when the session can be forked there. Raises `Busy`
        while a turn runs, `CannotFork` when it cannot be forked there, `CannotUndo` when a
        file changed since; nothing is put back then."""
        return await self._ask(lambda r: RewindFiles(at, r))

    async def continued(self, parent: str, session: str, at: int) -> None:
        """Record in `parent`'s log, where it is still this session's, that it went on in
        `session`, its fork at turn `at`'s end (a rewind): an editor reopening it follows."""
        await self._ask(partial(Continued, parent, session, at))

    async def set_mode(
        self,
        mode: Mode | None = None,
        thinking: bool | None = None,
        model: str | None = None,
        by: str | None = None,
    ) -> ModeState:
        """Set the session's mode and whether its turns think (None: as it is), written to its
        log; what they are now. Where they change, the session's other clients than `by` hear
        it (`ModeChanged`)."""
        return await self._ask(lambda r: SetMode(mode, thinking, r, model, by))

    async def decide(self, call: int, decision: Decision, session: str | None = None) -> bool:
        """Answer an approval the running turn waits for, or one of its sub-agents (`session`);
        False when call `call` of that session waits for none."""
        return await self._ask(lambda r: Decide(call, decision, session, r))


def close_inbox(inbox: trio.MemoryReceiveChannel[SessionMessage], why: str) -> None:
    """Answer what waits unread, then close: with no checkpoint between the two, no asker is
    left waiting for an answer that never comes (a later one finds the inbox closed)."""
    while True:
        try:
            message = inbox.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            break
        reply_error(message.reply, SessionUnavailable(why))
    inbox.close()
