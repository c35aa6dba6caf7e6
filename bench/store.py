"""Store figures: opening (replaying) a 10,000-record session, one append with fsync, and the
longest stall of a stream beside the open of a 100,000-record session (with CPython's own
garbage collection, and with loopd's, which holds full collections back while an answer
streams: `loopd.collector`).

Each is set beside a baseline measured in the same run on the same files: the open against
`json.loads` of every line (the least any reader does), the append against a bare
`os.write` + `os.fsync` of the same line (the least any durable log does), the stall against
the same log read whole in a worker thread, as `Store.open` read it before it read in slices.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from loopd.collector import collect_when_quiet, streaming
from loopd.infer import Timings, ToolCall
from loopd.session.baseline import make_baseline
from loopd.session.records import (
    AssistantRecord,
    Record,
    ToolResultRecord,
    UsageRecord,
    UserRecord,
    dump,
)
from loopd.session.store import Session, Store, parse_log

RECORDS = 10_000
OPENS = 7
APPENDS = 200
LONG = 100_000
LONG_OPENS = 3


def conversation(n: int) -> list[Record]:
    """A realistic mix: user, assistant with a tool call, result, usage; repeated."""
    t = Timings(cache_n=1200, prompt_n=40, prompt_ms=80.5, predicted_n=60, predicted_ms=600.1)
    call = ToolCall(
        id="call_1",
        name="call_tool",
        arguments='{"name": "read_file", "arguments": {"path": "notes/today.md"}}',
    )
    cycle: list[Record] = [
        UserRecord(content="What is in my notes for today? " * 3),
        AssistantRecord(content=None, reasoning_content="Let me look. " * 5, tool_calls=(call,)),
        UsageRecord(timings=t),
        ToolResultRecord(call=1, tool_call_id="call_1", name="read_file", content="- x\n" * 60),
        AssistantRecord(content="Your notes say: " + "x " * 80),
        UsageRecord(timings=t),
    ]
    return [cycle[i % len(cycle)] for i in range(n)]


def _ms(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {"median_ms": statistics.median(ordered) * 1000, "p99_ms": p99 * 1000}


async def _measure(directory: Path) -> dict[str, Any]:
    store = Store(directory)
    with await store.create(make_baseline()) as session:
        for record in conversation(RECORDS):
            await session.append(record)
    path = session.path

    opens, parses = [], []
    for _ in range(OPENS):
        start = time.perf_counter()
        with await store.open(session.id):
            pass
        opens.append(time.perf_counter() - start)
        start = time.perf_counter()
        for line in path.read_bytes().splitlines():
            json.loads(line)
        parses.append(time.perf_counter() - start)

    appends, bare = [], []
    line = dump(UserRecord(content="a typical user message of a sentence or two " * 2))
    raw = directory / "bare.log"
    fd = os.open(raw, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with await store.open(session.id) as reopened:
        for _ in range(APPENDS):
            start = time.perf_counter()
            await reopened.append(
                UserRecord(content="a typical user message of a sentence or two " * 2)
            )
            appends.append(time.perf_counter() - start)
            start = time.perf_counter()
            os.write(fd, line)
            os.fsync(fd)
            bare.append(time.perf_counter() - start)
    os.close(fd)
    stalls = await _stalls(store)
    open_ms, parse_ms = _ms(opens), _ms(parses)
    append_ms, bare_ms = _ms(appends), _ms(bare)
    return {
        "open_10k": {
            **open_ms,
            "baseline_median_ms": parse_ms["median_ms"],
            "ratio": open_ms["median_ms"] / parse_ms["median_ms"],
            "bytes": path.stat().st_size,
        },
        "append_fsync": {
            **append_ms,
            "baseline_median_ms": bare_ms["median_ms"],
            "baseline_p99_ms": bare_ms["p99_ms"],
            "ratio": append_ms["median_ms"] / bare_ms["median_ms"],
        },
        "stall_100k": stalls,
    }


async def _stalls(store: Store) -> dict[str, float]:
    """The longest gap between two passes of a task beside the open of a `LONG`-record
    session (the stream of another session stops as long), against the same log read whole in
    a worker thread; each the median over `LONG_OPENS` opens, alternating. Apart: the gap
    while that session, closed, is freed."""
    with await store.create(make_baseline()) as session:
        pass
    with session.path.open("ab") as f:
        f.write(b"".join(dump(r) for r in conversation(LONG)))
    kept: list[object] = []  # what was read, freed after the gap's measure

    async def sliced() -> None:
        kept.append(await store.open(session.id))

    async def whole() -> None:
        data = session.path.read_bytes()
        kept.append(await trio.to_thread.run_sync(parse_log, session.path, data, session.id))

    async def freed() -> None:
        await trio.lowlevel.checkpoint()  # the task beside runs first
        opened = kept.pop()
        assert isinstance(opened, Session)  # noqa: S101 - what `sliced` kept
        opened.close()
        del opened

    reads = (("sliced", sliced), ("held_back", sliced), ("whole", whole))
    gaps: dict[str, list[float]] = {name: [] for name in ("sliced", "held_back", "whole", "freed")}
    for _ in range(LONG_OPENS):
        for name, read in reads:
            gc.collect()  # each starts from the same heap
            if name != "held_back":
                gaps[name].append(await _longest_gap(read))
                for opened in kept:
                    if isinstance(opened, Session):
                        opened.close()
                kept.clear()
                continue
            async with trio.open_nursery() as nursery:  # as the daemon runs, the stream counted
                await nursery.start(collect_when_quiet)
                with streaming():
                    gaps[name].append(await _longest_gap(read))
                    gaps["freed"].append(await _longest_gap(freed))
                nursery.cancel_scope.cancel()
    ms = {name: statistics.median(g) * 1000 for name, g in gaps.items()}
    return {
        "median_ms": ms["held_back"],
        "cpython_gc_median_ms": ms["sliced"],
        "baseline_median_ms": ms["whole"],
        "ratio": ms["held_back"] / ms["whole"],
        "freed_median_ms": ms["freed"],
    }


async def _longest_gap(read: Callable[[], Awaitable[None]]) -> float:
    gaps, done = [0.0], False

    async def beside() -> None:
        last = time.perf_counter()
        while not done:
            await trio.lowlevel.checkpoint()
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(beside)
        await read()
        done = True
    return max(gaps)


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        return trio.run(_measure, Path(tmp))


def rows(figures: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    o, a = figures["open_10k"], figures["append_fsync"]
    s = figures.get("stall_100k")
    stall = (
        [
            (
                "longest stall of a stream beside the open of a 100,000-record session",
                f"{s['median_ms']:.1f} ms" + _cpython(s),
                f"the log read whole in a worker thread: {s['baseline_median_ms']:.0f} ms",
                f"{s['ratio']:.2f}x",
            )
        ]
        if s
        else []
    )
    if s and "freed_median_ms" in s:
        stall.append(
            (
                "longest stall of a stream while that session, closed, is freed",
                f"{s['freed_median_ms']:.1f} ms",
                "",
                "",
            )
        )
    return [
        (
            "open a 10,000-record session",
            f"{o['median_ms']:.0f} ms (p99 {o['p99_ms']:.0f})",
            f"json.loads per line: {o['baseline_median_ms']:.0f} ms",
            f"{o['ratio']:.2f}x",
        ),
        (
            "one append with fsync",
            f"{a['median_ms']:.2f} ms (p99 {a['p99_ms']:.2f})",
            f"os.write + fsync: {a['baseline_median_ms']:.2f} ms",
            f"{a['ratio']:.2f}x",
        ),
        *stall,
    ]


def _cpython(stall: dict[str, float]) -> str:
    """The same open under CPython's own full collections, where the run measured it."""
    if (ms := stall.get("cpython_gc_median_ms")) is None:
        return ""
    return f" (with CPython's own full collections: {ms:.0f} ms)"
