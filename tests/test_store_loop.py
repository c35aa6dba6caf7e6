"""Logs read off trio's thread: a long log opens in slices that every other task runs
between, and opening a session (`latest`, a turn interrupted with its sub-agents) reads no log
in trio's own thread. Counted, never timed: the figure is bench/store.py's."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio

from loopd.actors import open_core
from loopd.infer import Client
from loopd.session.baseline import make_baseline
from loopd.session.records import AssistantRecord, Record, UserRecord, dump
from loopd.session.store import READ_SLICE, ParentCall, Store
from support.fake_llama import FakeLlama
from support.replay import ReplayServer
from support.steps import counted_steps
from test_actors import config

RECORDS = 100_000


async def long_session(store: Store, records: int) -> str:
    """A session of `records` records, written as one piece (appending each would take
    minutes)."""
    with await store.create(make_baseline()) as session:
        pass
    cycle: list[Record] = [
        UserRecord(content="What is in my notes for today?"),
        AssistantRecord(content="Your notes say: buy milk, call the plumber."),
    ]
    with session.path.open("ab") as log:
        log.write(b"".join(dump(cycle[i % 2]) for i in range(records)))
    return session.id


async def test_a_100000_record_session_opens_in_slices_a_stream_beside_it_runs_between(
    tmp_path: Path,
) -> None:
    """Validating a log holds the GIL: read whole, trio's thread stopped for all of it."""
    store = Store(tmp_path)
    session_id = await long_session(store, RECORDS)
    stretches: set[int] = set()
    opened = False

    async def stream() -> None:  # a task beside the open: which of its stretches each pass follows
        while not opened:
            stretches.add(steps.count)
            await trio.lowlevel.checkpoint()

    with counted_steps() as steps:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            with await store.open(session_id) as session:
                opened = True
    assert len(session.records) == RECORDS
    # A slice that a worker thread finished before trio's next pass may go unseen: half.
    assert len(stretches) > RECORDS // READ_SLICE // 2


_watched: list[tuple[str, int, list[str]]] = []
"""While a test watches: the store's folder, trio's thread, and the logs opened in it."""


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event != "open" or not _watched or not isinstance(args[0], str | Path):
        return
    folder, thread, opened = _watched[0]
    path = str(args[0])
    if path.startswith(folder) and path.endswith(".jsonl") and threading.get_ident() == thread:
        opened.append(path)


sys.addaudithook(_audit)  # for good, in this process: idle while no test watches


@contextmanager
def logs_opened_in_this_thread(store: Store) -> Iterator[list[str]]:
    """The logs of `store` opened in this thread (trio's) while the block runs."""
    opened: list[str] = []
    _watched.append((str(store.directory), threading.get_ident(), opened))
    try:
        yield opened
    finally:
        _watched.clear()


async def test_opening_latest_with_an_interrupted_sub_agent_reads_no_log_in_trios_thread(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    server = ReplayServer([FakeLlama([])])
    await nursery.start(server.run)
    store = Store(tmp_path / "sessions")
    with await store.create(make_baseline()) as parent:
        await parent.append(UserRecord(content="delegate the notes"))  # loopd stopped in it
    call = ParentCall(parent.id, 1, "call_1")
    with await store.create(make_baseline(), parent=call) as child:
        await child.append(UserRecord(content="read the notes"))
    async with Client(server.url) as client, open_core(config(tmp_path), store, [client]) as core:
        with logs_opened_in_this_thread(store) as opened:
            _, session_id = await core.sessions.attach("latest")
    assert session_id == parent.id
    assert [r.kind for r in store.read(child.id)[1]][-1] == "turn_end"  # closed: its log read
    assert opened == []
