"""Full garbage collections held back while an answer streams (`loopd.collector`): opening a
100,000-record session beside a stream makes none, where CPython's own thresholds make some
(each one a stall of every stream: bench/store.py's figure); a held-back one is made once no
answer streams, or once overdue however busy. Counted with `gc.callbacks`, never timed."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio

from loopd.collector import collect_when_quiet, streaming
from loopd.session.store import Store
from test_store_loop import RECORDS, long_session

QUICK = 0.01
"""The collector's look, often, so that the tests wait little."""
FULL_AFTER = gc.get_threshold()[2]
"""CPython's: the young collections it waits for before a full one (the collector, running,
sets its own out of reach)."""


@contextmanager
def full_collections() -> Iterator[list[int]]:
    """The full collections made while in the block (one entry each)."""
    made: list[int] = []

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 2:
            made.append(1)

    gc.callbacks.append(seen)
    try:
        yield made
    finally:
        gc.callbacks.remove(seen)


def make_one_due() -> None:
    """As many young collections as CPython waits for before a full one."""
    for _ in range(FULL_AFTER + 1):
        gc.collect(1)


async def test_a_long_session_opened_beside_a_stream_sets_off_no_full_collection(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    store = Store(tmp_path)
    session_id = await long_session(store, RECORDS)
    gc.collect()
    with full_collections() as made, await store.open(session_id):
        pass
    assert made, "CPython's own thresholds made no full collection: the test shows nothing"

    await nursery.start(collect_when_quiet, QUICK)
    gc.collect()
    with full_collections() as made, streaming():
        with await store.open(session_id) as session:
            assert len(session.records) == RECORDS
        await trio.sleep(3 * QUICK)  # due by now, and held back while the stream goes on
    assert made == []


async def test_a_held_back_collection_is_made_once_no_answer_streams(
    nursery: trio.Nursery,
) -> None:
    await nursery.start(collect_when_quiet, QUICK)
    with full_collections() as made:
        with streaming():
            make_one_due()
            await trio.sleep(5 * QUICK)
            assert made == []
        await trio.sleep(5 * QUICK)
    assert made == [1]


async def test_an_overdue_collection_is_made_however_busy(nursery: trio.Nursery) -> None:
    await nursery.start(collect_when_quiet, QUICK, 3 * QUICK)
    with full_collections() as made, streaming():
        make_one_due()
        await trio.sleep(10 * QUICK)
    assert made == [1]


async def test_cpythons_thresholds_come_back_when_it_stops() -> None:
    before = gc.get_threshold()
    async with trio.open_nursery() as nursery:
        await nursery.start(collect_when_quiet, QUICK)
        assert gc.get_threshold()[2] > before[2]
        nursery.cancel_scope.cancel()
    assert gc.get_threshold() == before
