"""A turn waits for its llama-server rather than fail while the server cannot take a request yet:
it loads its model (503), it is being restarted, or no connection can be made. A model of tens
of gigabytes loads for a minute or more, longer than any fixed count of retries would cover, so
the bound is the turn's own deadline, and a cancel ends the wait at once (it is a `trio.sleep`);
only a server that has not answered once since loopd started (most likely a wrong URL) is given
up on sooner, after `NEVER_REACHED_WAIT`. Only a try that passed no output on is tried again:
after output, a second try would say it twice. Where loopd has several servers, a request its
server cannot take goes to another that can take it now rather than wait (the turn's
`Runtime.elsewhere`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from loopd.backoff import Backoff
from loopd.infer import ConnectError, ConnectionLost, HttpError, InferError
from loopd.wire.events import WaitingForServer, WaitReason

__all__ = ["NEVER_REACHED_WAIT", "Elsewhere", "NeverReached", "ServerWait", "wait_reason"]

T = TypeVar("T")

Elsewhere = Callable[[WaitReason, InferError], Awaitable[T | None]]
"""Moves the request to another server that can take it now (why its own could not, and the
error): what the request goes on with there; None where no other server can take it."""


def wait_reason(error: InferError) -> WaitReason | None:
    """Why the server could not take a request, when waiting may mend it; None otherwise. A
    lost connection is one: the server died under the request, or a kept-alive connection
    was stale (the caller tries again only where no output had been passed on)."""
    if isinstance(error, ConnectError | ConnectionLost):
        return "restarting" if isinstance(error, ConnectError) and error.down else "unreachable"
    if isinstance(error, HttpError) and error.status == 503:
        return "loading"
    return None


NEVER_REACHED_WAIT = 10.0
"""Seconds a turn waits for a server that has not answered once since loopd started before it
fails: such a server is far more often a wrong `[server] url` than one on its way up, and a
script or a person should hear so within seconds, not at the turn's deadline. (A server that
answered before is waited for up to the deadline: it restarts or loads its model.)"""


class NeverReached(InferError):
    """The request's server has not answered once since loopd started, for longer than
    `NEVER_REACHED_WAIT`."""


class ServerWait:
    """The waits of one request: a backoff between tries, and an event for clients when the
    wait begins or its reason changes (not on every try: a long load would flood them)."""

    def __init__(self, backoff: Backoff, on_event: Callable[[WaitingForServer], None]) -> None:
        self.backoff, self.on_event = backoff, on_event
        self.tries = 0
        self.last: WaitingForServer | None = None
        """What the last wait was for; None before any."""
        self.since: float | None = None
        """When the request first could not reach a server that never answered (trio's clock)."""

    async def after(
        self, reason: WaitReason, error: InferError, elsewhere: Elsewhere[T] | None = None
    ) -> T | None:
        """`error` kept the server from taking the request: where `elsewhere` moves it to
        another server, what it goes on with there (to be tried at once); else say so, wait
        for the next try, and None."""
        # Not at a first lost connection: it may be a kept-alive one the server had closed,
        # the server fine and holding the session's cache, as the next try tells.
        if elsewhere and (self.tries or not isinstance(error, ConnectionLost)):
            moved = await elsewhere(reason, error)
            if moved is not None:
                self.tries, self.last = 0, None  # the new server's waits are its own
                return moved
        waiting = WaitingForServer(reason=reason, detail=str(error))
        if self.last is None or self.last.reason != reason:
            self.on_event(waiting)
        self.last = waiting
        self.tries += 1
        await trio.sleep(self.backoff.delay(self.tries))
        return None

    def never_reached(
        self, reason: WaitReason, error: InferError, reached: bool
    ) -> NeverReached | None:
        """Why the request stops waiting, where its server has not answered once since loopd
        started (`reached`: it has) and it has waited `NEVER_REACHED_WAIT` for it; else None."""
        if reason != "unreachable" or reached:
            self.since = None
            return None
        now = trio.current_time()
        self.since = now if self.since is None else self.since
        if now - self.since < NEVER_REACHED_WAIT:
            return None
        return NeverReached(
            f"{error}; it has not answered once since loopd started: is [server] url right? "
            "(`loopd check-config` tries it)"
        )

    def gone(self) -> str:
        """Why a request that had to wait may find less in the cache than the last left."""
        last = f" ({self.last.reason}: {self.last.detail})" if self.last else ""
        return (
            f"the server was away while the turn waited for it{last}; a server that "
            "restarted keeps no cache"
        )

    def why(self) -> str:
        """What the request was waiting for, for a turn that ran out of time meanwhile."""
        if self.last is None:
            return ""
        return f" while waiting for the server ({self.last.reason}): {self.last.detail}"
