"""Store figures: opening (replaying) a 10,000-record session, one append with fsync, and the
longest stall of a stream beside the open of a 100,000-record session.

Each is set beside a baseline measured in the same run on the same files: the open against
`json.loads` of every line (the least any reader does), the append against a bare
`os.write` + `os.fsync` of the same line (the least any durable log does), the stall against
the same log read whole in a worker thread, as `Store.open` read it before it read in slices.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

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
from loopd.session.store import Store, parse_log

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
    a worker thread; each the median over `LONG_OPENS` opens, alternating."""
    with await store.create(make_baseline()) as session:
        pass
    with session.path.open("ab") as f:
        f.write(b"".join(dump(r) for r in conversation(LONG)))

    async def sliced() -> None:
        with await store.open(session.id):
            pass

    async def whole() -> None:
        data = session.path.read_bytes()
        await trio.to_thread.run_sync(parse_log, session.path, data, session.id)

    gaps: dict[str, list[float]] = {"sliced": [], "whole": []}
    for _ in range(LONG_OPENS):
        for name, read in (("sliced", sliced), ("whole", whole)):
            gaps[name].append(await _longest_gap(read))
    sliced_ms = statistics.median(gaps["sliced"]) * 1000
    whole_ms = statistics.median(gaps["whole"]) * 1000
    return {"median_ms": sliced_ms, "baseline_median_ms": whole_ms, "ratio": sliced_ms / whole_ms}


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
                f"{s['median_ms']:.0f} ms",
                f"the log read whole in a worker thread: {s['baseline_median_ms']:.0f} ms",
                f"{s['ratio']:.2f}x",
            )
        ]
        if s
        else []
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
