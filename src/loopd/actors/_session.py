"""The session actor: owns the session, runs one turn at a time in order, and publishes every
event, tagged with its turn, to whoever subscribed.

Fan-out goes through one bounded channel per subscriber, filled with `send_nowait`: a
subscriber that falls behind is dropped (marked `lagged`, its channel closed), never the turn.
The log on disk is the truth; a dropped client can read it again.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import trio

from loopd.events import TurnEvent
from loopd.store import Session, StoreError
from loopd.turn import InferFailed, Runtime, TurnError, TurnOutcome, run_turn

__all__ = ["Busy", "Published", "SessionActor", "Subscription", "TurnDone", "TurnFailed"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnDone:
    outcome: TurnOutcome


@dataclass(frozen=True)
class TurnFailed:
    kind: str
    """`turn_limit`, `session_full`, `infer`, `cancelled` or `error`."""
    message: str


@dataclass(frozen=True)
class Published:
    turn: str
    """The id the client gave the message that started the turn."""
    item: TurnEvent | TurnDone | TurnFailed


class Subscription:
    def __init__(self, buffer: int) -> None:
        self._send, self.receive = trio.open_memory_channel[Published](buffer)
        self.lagged = False
        """Set when it fell behind and was dropped."""

    def offer(self, message: Published) -> bool:
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


class Busy(Exception):
    """Too many messages are already waiting."""


@dataclass(frozen=True)
class _Message:
    turn: str
    content: str
    thinking: bool | None = None


class SessionActor:
    def __init__(self, session: Session, runtime: Runtime, queue_limit: int) -> None:
        self.session = session
        self.runtime = runtime
        self.queue_limit = queue_limit
        self._queue: deque[_Message] = deque()
        self._wake = trio.Event()
        self._subscribers: list[Subscription] = []
        self._running: tuple[str, trio.CancelScope] | None = None

    @property
    def running(self) -> str | None:
        return self._running[0] if self._running else None

    @property
    def queued(self) -> list[str]:
        return [m.turn for m in self._queue]

    def submit(self, turn: str, content: str, thinking: bool | None = None) -> int:
        """Queue a user message; its position (0: runs next). Raises `Busy` when full."""
        # The head of the queue runs as soon as the actor takes it: it is not waiting.
        waiting = len(self._queue) if self._running else max(0, len(self._queue) - 1)
        if waiting >= self.queue_limit:
            raise Busy(f"{waiting} messages are already waiting for the running turn")
        position = len(self._queue) + (self._running is not None)
        self._queue.append(_Message(turn, content, thinking))
        self._wake.set()
        return position

    def cancel(self, turn: str) -> bool:
        """Cancel a running or waiting turn; False when there is no such turn."""
        if self._running and self._running[0] == turn:
            self._running[1].cancel()
            return True
        for message in self._queue:
            if message.turn == turn:
                self._queue.remove(message)
                self._publish(Published(turn, TurnFailed("cancelled", "cancelled before it ran")))
                return True
        return False

    def replace_session(self, session: Session) -> Session:
        """Turns go to `session` from now on; the old one is returned, for the caller to close."""
        if self._running or self._queue:
            raise Busy("a turn is running or waiting")
        old, self.session = self.session, session
        return old

    def subscribe(self, buffer: int) -> Subscription:
        subscription = Subscription(buffer)
        self._subscribers.append(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        subscription.close()
        if subscription in self._subscribers:
            self._subscribers.remove(subscription)

    def _publish(self, message: Published) -> None:
        self._subscribers = [s for s in self._subscribers if s.offer(message)]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Take messages in order and run their turns, until cancelled."""
        task_status.started()
        try:
            while True:
                if not self._queue:
                    self._wake = trio.Event()
                    await self._wake.wait()
                    continue
                await self._turn(self._queue.popleft())
        finally:
            for subscription in self._subscribers:
                subscription.close()

    async def _turn(self, message: _Message) -> None:
        def on_event(event: TurnEvent) -> None:
            self._publish(Published(message.turn, event))

        with trio.CancelScope() as scope:
            self._running = (message.turn, scope)
            try:
                session = self.session
                outcome = await run_turn(
                    session, self.runtime, message.content, on_event, thinking=message.thinking
                )
                self._publish(Published(message.turn, TurnDone(outcome)))
            except TurnError as e:
                kind = "infer" if isinstance(e, InferFailed) else e.reason
                self._publish(Published(message.turn, TurnFailed(kind, str(e))))
            except StoreError as e:
                log.exception("the session log could not be written")
                self._publish(Published(message.turn, TurnFailed("error", str(e))))
                raise
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
