"""Where a session went on: the chain of `continued` records, from a session to the newest one
its conversation went on in (a rewind's fork, a compaction's continuation, and so on).

An editor knows a session by the id it began with; a rewind or a compaction goes on in a new
session, and the old log's last `continued` record names it. Following the chain is the
client's choice (`hello`'s and `open_session`'s `follow`): a terminal client reopening an old
session by its id gets that session itself.
"""

from __future__ import annotations

import logging

import trio
from pydantic import ValidationError

from loopd.session.records import RECORD, ContinuedRecord
from loopd.session.store import Session, Store, StoreError, UnknownSession

__all__ = ["continued_as", "newest", "newest_now", "record_went_on"]

log = logging.getLogger(__name__)

_KIND = b'"kind":"continued"'
"""How a `continued` record's line says its kind: never inside a string, where the quotes are
escaped."""


def continued_as(store: Store, session: str) -> str | None:
    """The session `session` went on in last (its log's last `continued` record), or None.
    Raises `UnknownSession` where there is no such log (or `session` is no id), `OSError`
    where it cannot be read."""
    try:
        data = store.path_of(session).read_bytes()
    except FileNotFoundError:
        raise UnknownSession(f"no session {session} in {store.directory}") from None
    at = data.rfind(_KIND)
    if at < 0:
        return None
    start, end = data.rfind(b"\n", 0, at) + 1, data.find(b"\n", at)
    if end < 0:
        return None  # a torn last line: it was never written whole
    try:
        record = RECORD.validate_json(data[start:end])
    except ValidationError:
        return None
    return record.session if isinstance(record, ContinuedRecord) else None


def newest_now(store: Store, session: str) -> str:
    """The last session of `session`'s chain that has a log: `session` itself where it went on
    nowhere (or is no session: opening it says so). A chain that comes back on itself (a log
    edited so) ends before it repeats; one that names a session whose log is gone (or cannot
    be read) ends at the session that names it."""
    chain = [session]
    while True:
        try:
            after = continued_as(store, chain[-1])
        except (UnknownSession, OSError) as e:
            if len(chain) > 1:
                log.warning("session %s went on in %s, which cannot be read: %s", *chain[-2:], e)
                chain.pop()
            return chain[-1]
        if after is None or after in chain:
            return chain[-1]
        chain.append(after)


async def newest(store: Store, session: str) -> str:
    """`newest_now`, read off the event loop."""
    return await trio.to_thread.run_sync(newest_now, store, session)


async def record_went_on(old: Session, record: ContinuedRecord) -> None:
    """Append `record` to `old`'s log: where its conversation went on. A log that cannot take
    it is logged and left so: the new session stands, and only a client that follows `old`
    misses it."""
    try:
        await old.append(record)
    except StoreError as e:
        log.warning(
            "session %s could not record that it went on in %s: %s", old.id, record.session, e
        )
