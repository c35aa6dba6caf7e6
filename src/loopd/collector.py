"""CPython's full garbage collections, held back to moments when no answer streams.

A full collection walks every object the process holds, with the GIL held: with long sessions
in memory (100,000 records are a few million objects) each one stops every stream for a tenth
of a second and more. CPython sets one off whenever the objects that outlived the young
collections have grown by a quarter, as they do in bursts while a long log is read, so opening
a long session stalled every other session's answer several times over. loopd keeps CPython's
young collections (cheap: they walk only what was made since the last) and makes the full ones
itself (`collect_when_quiet`): once as many young collections have passed as CPython waits
for, at a moment when no answer streams (`streaming`); however busy, once one has been held
back `LONGEST_DEFERRAL`, so that cycles of garbage still go.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import trio

__all__ = ["CHECK_EVERY", "LONGEST_DEFERRAL", "collect_when_quiet", "streaming"]

log = logging.getLogger(__name__)

CHECK_EVERY = 1.0
"""Seconds between two looks at whether a full collection is due and the moment quiet."""
LONGEST_DEFERRAL = 600.0
"""Seconds a due full collection waits for a moment without a stream, at most: agents that
stream without a pause still have their cycles of garbage collected, every ten minutes."""
_NEVER = 2**31 - 1
"""A threshold CPython's count never reaches: no full collection of its own."""


class _Streams:
    """How many answers stream now, in this process."""

    open = 0


@contextmanager
def streaming() -> Iterator[None]:
    """An answer streams (from its request to its end): `collect_when_quiet` makes no full
    collection meanwhile, unless one is overdue."""
    _Streams.open += 1
    try:
        yield
    finally:
        _Streams.open -= 1


async def collect_when_quiet(
    check_every: float = CHECK_EVERY,
    longest: float = LONGEST_DEFERRAL,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Make CPython's full collections from here on (started: CPython makes none of its own),
    at quiet moments (see the module), until cancelled; CPython's own thresholds come back
    then."""
    young, middle, full_after = gc.get_threshold()
    gc.set_threshold(young, middle, _NEVER)
    due_since: float | None = None
    try:
        task_status.started()
        while True:
            await trio.sleep(check_every)
            if gc.get_count()[2] <= full_after:  # CPython would not make one yet either
                continue
            now = trio.current_time()
            due_since = now if due_since is None else due_since
            if _Streams.open and now - due_since < longest:
                continue
            started = trio.current_time()
            found = gc.collect()
            log.debug(
                "a full collection (%d unreachable) in %.0f ms, held back %.0f s",
                found,
                (trio.current_time() - started) * 1000,
                now - due_since,
            )
            due_since = None
    finally:
        gc.set_threshold(young, middle, full_after)
