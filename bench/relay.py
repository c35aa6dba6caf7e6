"""Figure 4: events per second from a fast llama-server to a socket client, through loopd,
against a plain httpx SSE reader of the same stream.

The stand-in server streams 50,000 pieces as fast as it can (the scripted fake of the tests,
over real HTTP on loopback).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio
from httpx_sse import aconnect_sse

from support.daemon import Daemon
from support.fake_llama import FakeLlama, Reply
from support.replay import ReplayServer

PIECES = 50_000
# Room for the whole stream, so the figure measures speed, not the drop of a slow client.
CHANNEL = "subscriber_buffer = 100000\n"
LOOP = "[loop]\nmax_tokens = 100000\n"


async def measure() -> dict[str, Any]:
    # Numbered, so that loopd's `repetition_cap` does not take the stream for a loop.
    words = " ".join(f"t{n}" for n in range(PIECES))
    fake = FakeLlama([Reply(content=words), Reply(content=words)])
    server = ReplayServer([fake, fake])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        direct = await _direct(server.url)
        with tempfile.TemporaryDirectory() as tmp:
            d = Daemon(Path(tmp) / "loopd", server.url, CHANNEL)
            d.config.write_text(d.config.read_text() + LOOP)
            await d.start()
            try:
                client = await d.connect()
                start = time.perf_counter()
                got = await client.turn("relay", "go")
                through = (
                    sum(line["type"] == "event" for line in got),
                    time.perf_counter() - start,
                )
            finally:
                await d.kill()
                await d.close_clients()
        nursery.cancel_scope.cancel()
    return {
        "pieces": PIECES,
        "direct_events_per_s": direct[0] / direct[1],
        "loopd_events_per_s": through[0] / through[1],
        "ratio": (through[0] / through[1]) / (direct[0] / direct[1]),
    }


async def _direct(url: str) -> tuple[int, float]:
    body = {"messages": [{"role": "user", "content": "go"}], "stream": True}
    count = 0
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        start = time.perf_counter()
        async with aconnect_sse(http, "POST", "/v1/chat/completions", json=body) as source:
            async for event in source.aiter_sse():
                if event.data == "[DONE]":
                    break
                count += 1
    return count, time.perf_counter() - start
