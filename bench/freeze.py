"""Figure 9: how long a client waits for `status` while a tool call burns its whole deadline
(a regular expression that backtracks exponentially), against the same while loopd is idle.

A scripted llama-server asks for `search_text` with `^(a|aa)+$` over a line of 60 a's and a b
(`[tools] timeout = 3`); a second client asks `status` every 20 ms until the turn ends.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply
from support.replay import ReplayServer

PATTERN = "^(a|aa)+$"
TIMEOUT = 3
INTERVAL = 0.02


async def measure() -> dict[str, Any]:
    arguments = {"name": "search_text", "arguments": {"pattern": PATTERN, "regex": True}}
    fake = FakeLlama(
        [Reply(tool_calls=(("c1", "call_tool", json.dumps(arguments)),)), Reply(content="done")]
    )
    server = ReplayServer([fake] * 4)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        with tempfile.TemporaryDirectory() as tmp:
            notes = Path(tmp) / "notes"
            notes.mkdir()
            (notes / "a.md").write_text("a" * 60 + "b\n")
            d = Daemon(Path(tmp) / "loopd", server.url)
            d.config.write_text(
                d.config.read_text() + f'[tools]\nroots = ["{notes}"]\ntimeout = {TIMEOUT}\n'
            )
            await d.start()
            try:
                asker = await d.connect()
                for _ in range(10):  # warm-up: the first answers pay for imports and caches
                    await _status_ms(asker)
                idle = [await _status_ms(asker) for _ in range(100)]
                runner = await d.connect()
                await runner.send({"type": "send", "id": "t1", "content": "search"})
                await runner.until("event")  # the turn is on
                busy: list[float] = []
                async with trio.open_nursery() as polling:

                    async def poll() -> None:
                        while True:
                            busy.append(await _status_ms(asker))
                            await trio.sleep(INTERVAL)

                    polling.start_soon(poll)
                    await runner.until("turn_done", timeout=TIMEOUT + 30)
                    polling.cancel_scope.cancel()
            finally:
                await d.kill()
                await d.close_clients()
        nursery.cancel_scope.cancel()
    return {
        "idle_median_ms": statistics.median(idle),
        "idle_worst_ms": max(idle),
        "busy_median_ms": statistics.median(busy),
        "busy_worst_ms": max(busy),
        "answers_while_busy": len(busy),
        "ratio_median": statistics.median(busy) / statistics.median(idle),
        "ratio_worst": max(busy) / max(idle),
    }


async def _status_ms(client: LineClient) -> float:
    start = time.perf_counter()
    await client.send({"type": "status"})
    await client.until("status")
    return (time.perf_counter() - start) * 1000


def table(f: dict[str, Any]) -> list[str]:
    return [
        "| `status` answered | median | worst |",
        "| --- | --- | --- |",
        f"| loopd idle | {f['idle_median_ms']:.2f} ms | {f['idle_worst_ms']:.2f} ms |",
        (
            f"| while the regex runs ({f['answers_while_busy']} answers) "
            f"| {f['busy_median_ms']:.2f} ms | {f['busy_worst_ms']:.2f} ms |"
        ),
        f"| ratio | {f['ratio_median']:.1f}x | {f['ratio_worst']:.1f}x |",
    ]
