"""One-for-one restarts with a bound, as Erlang/OTP's supervisors do them, for the actors loopd
cannot serve without (the slot pool, the tool port) and for each MCP source.

An actor runs its inbox loop as a `life`: a bug (any `Exception`) ends that life, the actor
answers the requests the failure caught with `ActorFailed`, and `supervised` logs it and starts
the next life on the same inbox, so every handle stays valid. What the next life keeps of the
state is each actor's choice (see each). Failing more than `Restarts.most` times within
`Restarts.within` seconds means the fault does not pass: the actor gives up, and loopd stops
saying why (`Restarts.gave_up`). Cancellation is no failure: it ends the actor as it is.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from loopd.groups import innermost

__all__ = ["RESTARTS", "ActorFailed", "GaveUp", "Restarts", "short", "supervised"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restarts:
    """How often an actor may fail and start again."""

    most: int = 5
    """Restarts within `within` seconds; one failure more and the actor gives up."""
    within: float = 60.0
    gave_up: Callable[[str], Awaitable[None]] | None = None
    """Told why when an actor gives up, and stops loopd; None: `GaveUp` is raised instead."""


RESTARTS = Restarts()
"""Five in a minute: a bug that some request trips now and then is survived; one that every
message trips is not, and stops loopd within a second instead of failing forever."""


class ActorFailed(Exception):
    """The actor that held this request failed: the request was not done; it may be sent
    again, to the actor restarted."""

    @classmethod
    def of(cls, actor: str, error: BaseException) -> ActorFailed:
        return cls(f"{actor} failed ({short(error)}) while it held this request: send it again")


class GaveUp(Exception):
    """An actor failed more often than its `Restarts` allow; the message names it and the
    error."""


async def supervised(actor: str, life: Callable[[], Awaitable[None]], restarts: Restarts) -> None:
    """Run `life` until it returns or is cancelled, again each time it raises, until it has
    failed more than `restarts` allow: then tell `restarts.gave_up` and wait for loopd to stop,
    or raise `GaveUp`."""
    failures: deque[float] = deque()
    while True:
        try:
            await life()
        except Exception as error:
            now = trio.current_time()
            failures.append(now)
            while now - failures[0] > restarts.within:
                failures.popleft()
            if len(failures) > restarts.most:
                why = (
                    f"{actor} failed {len(failures)} times within {restarts.within:g} s, "
                    f"the last time with {short(error)}"
                )
                log.exception("%s; it is not started again", why)
                if restarts.gave_up is None:
                    raise GaveUp(why) from error
                await restarts.gave_up(why)
                # loopd stops: the inbox stays open until every actor is cancelled together.
                await trio.sleep_forever()
            log.exception(
                "%s failed, and starts again (%d of %d restarts within %g s)",
                actor,
                len(failures),
                restarts.most,
                restarts.within,
            )
        else:
            return


def short(error: BaseException) -> str:
    """An error as one line: its type and its message, cut to 300 characters."""
    error = innermost(error)
    return f"{type(error).__name__}: {error}"[:300]
