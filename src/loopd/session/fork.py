"""Forks: a new session whose history is another's up to the end of one of its turns.

The fork's log starts with the parent's records up to that turn's end, copied unchanged after
its own header (which names the parent and the turn: `forked_from`, `at`), but for the
parent's `continued` records, which say where the parent went on and are its alone; the
parent's log is only read. Its requests are the parent's, token for token, up to there: its
first one extends the prefix the parent's slot held, so the slot pool serves it from the
parent's cache (`cache_source`: for a fork of a fork that has made no request yet, the cache
of the nearest session up the chain that has) and it costs only its new message.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from loopd.session.records import (
    ContinuedRecord,
    Record,
    SessionHeader,
    TurnEndRecord,
    UsageRecord,
    UserRecord,
)
from loopd.session.store import Fork, Session, Store, StoreError

__all__ = ["ForkRefused", "cache_source", "fork", "fork_end", "fork_point"]

log = logging.getLogger(__name__)


class ForkRefused(Exception):
    """The session cannot be forked there; the message says why. Nothing was written."""


def fork_end(session: str, records: Sequence[Record], at: int | None) -> tuple[int, int]:
    """The turn to fork `session` at (`at`, else its latest) and how many of its `records`
    the fork keeps: those up to that turn's end. Raises `ForkRefused`."""
    turns = sum(isinstance(r, UserRecord) for r in records)
    turn = turns if at is None else at
    if turns == 0:
        raise ForkRefused(f"session {session} has no turn yet to fork at")
    if not 1 <= turn <= turns:
        raise ForkRefused(f"session {session} has turns 1 to {turns}: there is no turn {turn}")
    users = 0
    for number, record in enumerate(records, start=1):
        users += isinstance(record, UserRecord)
        if users == turn and isinstance(record, TurnEndRecord):
            return turn, number
    raise ForkRefused(f"turn {turn} of session {session} is still running: fork it once it ends")


def fork_point(header: SessionHeader, records: Sequence[Record], at: int | None) -> tuple[int, int]:
    """As `fork_end`, for the session of `header`; a sub-agent's session is refused too."""
    if header.parent is not None:
        raise ForkRefused(
            f"session {header.id} is a sub-agent's: fork the session it works for "
            f"({header.parent}) instead"
        )
    return fork_end(header.id, records, at)


async def fork(store: Store, parent: str, at: int | None) -> str:
    """A new session, the fork of `parent` at the end of its turn `at` (its latest when None),
    closed again: its id. Raises `ForkRefused`, or the store's `UnknownSession` or
    `StoreError`."""
    header, records, _ = await store.load(parent)
    turn, kept = fork_point(header, records, at)
    # Where the parent went on is not where the fork goes on.
    copied = [r for r in records[:kept] if not isinstance(r, ContinuedRecord)]
    with await store.create(
        header.baseline,
        grants=frozenset(header.grants),
        cwd=Path(header.cwd) if header.cwd else None,
        instructions=header.instructions,
        mode=header.mode,
        thinking=header.thinking,
        fork=Fork(parent, turn, copied),
    ) as session:
        log.info("session %s: the fork of session %s at turn %d", session.id, parent, turn)
        return session.id


async def cache_source(store: Store, session: Session) -> str | None:
    """The session whose cache a fork's next request extends, until the fork has made a
    request of its own: its parent, or, where the parent is a fork that has made none either
    (a fork of a fork made before its first turn), the nearest session up the chain that has:
    only its cache holds those tokens. None for any other session; a parent whose log is gone
    is taken as it is (its slot or slot file may still hold them)."""
    header, records = session.header, session.records
    source = None
    seen = {session.id}  # a log edited into a loop of forks ends the walk
    while (parent := _uncached_parent(header, records)) is not None and parent not in seen:
        source = parent
        seen.add(parent)
        try:
            header, records, _ = await store.load(parent)
        except StoreError:
            break
    return source


def _uncached_parent(header: SessionHeader, records: Sequence[Record]) -> str | None:
    """The session a fork was made of, while the fork has made no request of its own."""
    parent, at = header.forked_from, header.at
    if parent is None or at is None:
        return None
    try:
        _, kept = fork_end(parent, records, at)
    except ForkRefused:
        return None
    own = records[kept:]
    return None if any(isinstance(r, UsageRecord) for r in own) else parent
