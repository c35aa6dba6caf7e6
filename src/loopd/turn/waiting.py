"""A turn waits for its llama-server rather than fail while the server cannot take a request
yet: it loads its model (503), it is being restarted, or no connection can be made. A model
of tens of gigabytes loads for a minute or more, longer than any fixed count of retries would
cover, so the bound is the turn's own deadline, and a cancel ends the wait at once (it is a
`trio.sleep`). Only a try that passed no output on is tried again: after output, a second try
would say it twice.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from loopd.backoff import Backoff
from loopd.infer import ConnectError, ConnectionLost, HttpError, InferError
from loopd.wire.events import WaitingForServer, WaitReason

__all__ = ["ServerWait", "wait_reason"]


def wait_reason(error: InferError) -> WaitReason | None:
    """Why the server could not take a request, when waiting may mend it; None otherwise. A
    lost connection is one: the server died under the request, or a kept-alive connection
    was stale (the caller tries again only where no output had been passed on)."""
    if isinstance(error, ConnectError | ConnectionLost):
        return "restarting" if isinstance(error, ConnectError) and error.down else "unreachable"
    if isinstance(error, HttpError) and error.status == 503:
        return "loading"
    return None


class ServerWait:
    """The waits of one request: a backoff between tries, and an event for clients when the
    wait begins or its reason changes (not on every try: a long load would flood them)."""

    def __init__(self, backoff: Backoff, on_event: Callable[[WaitingForServer], None]) -> None:
        self.backoff, self.on_event = backoff, on_event
        self.tries = 0
        self.last: WaitingForServer | None = None
        """What the last wait was for; None before any."""

    async def after(self, reason: WaitReason, error: InferError) -> None:
        """`error` kept the server from taking the request: say so, then wait for the next
        try."""
        waiting = WaitingForServer(reason=reason, detail=str(error))
        if self.last is None or self.last.reason != reason:
            self.on_event(waiting)
        self.last = waiting
        self.tries += 1
        await trio.sleep(self.backoff.delay(self.tries))

    def why(self) -> str:
        """What the request was waiting for, for a turn that ran out of time meanwhile."""
        if self.last is None:
            return ""
        return f" while waiting for llama-server ({self.last.reason}): {self.last.detail}"
