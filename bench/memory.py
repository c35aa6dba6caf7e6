"""Figure 6: the daemon's resident memory at rest, after 1,000 turns against the fake server,
with 50 sessions live (a client in each, one turn each) and once those clients have left
(their sessions closed), beside a bare Python process that imports the same packages (the
floor)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from support.daemon import Daemon
from support.fake_llama import FakeLlama, Reply
from support.replay import ReplayServer

TURNS = 1_000
SESSIONS = 50


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def floor_mib() -> float:
    code = (
        "import os, loopd.daemon, loopd.channel, mcp, pydantic, httpx, trio; "
        "print(open(f'/proc/{os.getpid()}/status').read())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


async def measure() -> dict[str, Any]:
    fake = FakeLlama([Reply(content="A short answer of a few words.")] * (TURNS + SESSIONS))
    server = ReplayServer([fake] * (TURNS + SESSIONS))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        with tempfile.TemporaryDirectory() as tmp:
            # The scripted server keeps no slot files.
            d = Daemon(Path(tmp) / "loopd", server.url, slots='save = "never"')
            await d.start()
            try:
                if d.process is None:
                    raise RuntimeError("loopd did not start")
                at_rest = rss_mib(d.process.pid)
                client = await d.connect()
                for n in range(TURNS):
                    await client.turn(f"t{n}", f"message {n}")
                after = rss_mib(d.process.pid)
                others = [await d.connect() for _ in range(SESSIONS)]
                for n, other in enumerate(others):
                    await other.send({"type": "hello", "session": "new"})
                    await other.until("welcome")
                    await other.turn(f"s{n}", f"message {n}")
                live = rss_mib(d.process.pid)
                for other in others:
                    await other.aclose()
                await trio.sleep(1)  # the sessions nobody is in stop
                left = rss_mib(d.process.pid)
            finally:
                await d.kill()
                await d.close_clients()
        nursery.cancel_scope.cancel()
    return {
        "at_rest_mib": at_rest,
        "after_turns_mib": after,
        "turns": TURNS,
        "sessions": SESSIONS,
        "live_sessions_mib": live,
        "sessions_left_mib": left,
        "python_floor_mib": await trio.to_thread.run_sync(floor_mib),
    }
