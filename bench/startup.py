"""Figure 16: how fast bxctl starts. Whole-process runs of `bxctl --help` and of `bxctl status`
against a running loopd (on a scripted llama-server), each against `python -c pass` with the
same interpreter: medians of RUNS, alternating which goes first.
An editor starts `bxctl acp` and a script `bxctl chat -m` for every turn, so this is paid
each time.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from support.daemon import Daemon
from support.fake_llama import FakeLlama, Reply
from support.replay import ReplayServer

RUNS = 10


def _once(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


async def _pairs(command: list[str]) -> tuple[float, float]:
    """Medians of the command and of `python -c pass`, in seconds."""
    bare = [sys.executable, "-c", "pass"]
    mine, baseline = [], []
    for run in range(RUNS):
        first, second = (command, bare) if run % 2 == 0 else (bare, command)
        a = await trio.to_thread.run_sync(_once, first)
        b = await trio.to_thread.run_sync(_once, second)
        mine.append(a if first is command else b)
        baseline.append(b if first is command else a)
    return statistics.median(mine), statistics.median(baseline)


async def measure() -> dict[str, Any]:
    server = ReplayServer([FakeLlama([Reply(content="fine")])] * 10)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        with tempfile.TemporaryDirectory() as folder:
            d = Daemon(Path(folder), server.url, slots='save = "never"')
            await d.start()
            try:
                bxctl = [sys.executable, "-m", "bxctl", "--config", str(d.config)]
                figures = {}
                for name, args in (("help", ["--help"]), ("status", ["status"])):
                    ms, base = await _pairs([*bxctl, *args])
                    figures[f"{name}_ms"], figures[f"{name}_base_ms"] = ms * 1000, base * 1000
            finally:
                await d.end()
        nursery.cancel_scope.cancel()
    return {**figures, "runs": RUNS}


def table(f: dict[str, Any]) -> list[str]:
    rows = [
        "| | bxctl | `python -c pass` | difference | ratio |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, what in (("help", "`bxctl --help`"), ("status", "`bxctl status`")):
        mine, base = f[f"{name}_ms"], f[f"{name}_base_ms"]
        rows.append(
            f"| {what} | {mine:.0f} ms | {base:.0f} ms | {mine - base:.0f} ms "
            f"| {mine / base:.1f}x |"
        )
    return rows
