"""Figures 1 and 2: tokens processed per request against the minimum, for loopd and a peer.

One real llama-server (the bundled one, one slot) holds the scripted conversation of
conversation.py twice: through loopd (restarted after turn 4), then, on a fresh server, through
pydantic-ai (its history saved and loaded after turn 4). For every request, the minimum is the
tokens of its prompt that the slot did not hold (the previous prompt and the tokens generated
then, less the last), from the server's own figures; processed is the server's `prompt_n`. The
limit of processed / minimum is 1.0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio
from conversation import MAX_TOKENS, RESTART_AFTER, SYSTEM, TURNS

from loopd.infer import Timings, slot_tokens
from loopd.server_proc import LaunchSpec, managed_server
from loopd.session.baseline import messages
from loopd.session.records import AssistantRecord, UsageRecord
from loopd.session.store import Store
from support.daemon import Daemon

HERE = Path(__file__).resolve().parent
PEER = "pydantic-ai-slim[openai]==2.68.0"


async def _loopd_run(url: str, home: Path) -> list[dict[str, Any]]:
    d = Daemon(home, url, history="exact", session=f'system_prompt = "{SYSTEM}"\n')
    d.config.write_text(
        d.config.read_text() + f"[loop]\nmax_tokens = {MAX_TOKENS}\n"
        "[server.sampling]\ntemperature = 0\n"
    )
    await d.start()
    try:
        client = await d.connect()
        for number, text in enumerate(TURNS, start=1):
            await client.turn(f"t{number}", text)
            if number == RESTART_AFTER:
                await d.stop()
                await d.close_clients()
                await d.start()
                client = await d.connect()
    finally:
        await d.kill()
        await d.close_clients()
    store = Store(home / "sessions")
    header, records, _ = store.read(store.latest() or "")
    exchanges = []
    for index, record in enumerate(records):
        if isinstance(record, AssistantRecord):
            usage = next(r for r in records[index:] if isinstance(r, UsageRecord))
            body = {
                "messages": messages(header.baseline, records[:index]),
                "tools": list(header.baseline.tools),
            }
            exchanges.append(
                {"body": body, "timings": usage.timings and usage.timings.model_dump()}
            )
    return exchanges


def _peer_run(url: str, out: Path) -> list[dict[str, Any]]:
    uv = os.environ.get("UV", "uv")
    subprocess.run(
        [uv, "run", "--quiet", "--with", PEER, "python", str(HERE / "peer.py"), url, str(out)],
        check=True,
        cwd=HERE.parent,
        timeout=600,
    )
    exchanges: list[dict[str, Any]] = json.loads(out.read_text())
    return exchanges


def _minima(exchanges: list[dict[str, Any]]) -> list[int]:
    """Tokens of each request that the slot did not already hold: its whole prompt less the
    previous prompt and the tokens generated then (less the last, never evaluated)."""
    minima, previous = [], None
    for exchange in exchanges:
        t = Timings.model_validate(exchange["timings"])
        total = t.prompt_tokens
        # The server always evaluates at least one token again.
        minima.append(max(1, total - (slot_tokens(previous) if previous else 0)))
        previous = t
    return minima


def _rows(exchanges: list[dict[str, Any]], minima: list[int]) -> list[dict[str, Any]]:
    rows = []
    for number, (exchange, minimum) in enumerate(zip(exchanges, minima, strict=True), start=1):
        processed = exchange["timings"]["prompt_n"]
        rows.append(
            {
                "request": number,
                "processed": processed,
                "minimum": minimum,
                "ratio": processed / minimum,
            }
        )
    return rows


async def measure(binary: Path, model: Path) -> dict[str, Any]:
    spec = LaunchSpec(binary=binary, model=model, n_ctx=4096, threads=2)
    with tempfile.TemporaryDirectory() as tmp:
        async with managed_server(spec, Path(tmp) / "llama-1.log") as server:
            loopd = await _loopd_run(server.url, Path(tmp) / "loopd")
        async with managed_server(spec, Path(tmp) / "llama-2.log") as server:
            peer = await trio.to_thread.run_sync(_peer_run, server.url, Path(tmp) / "peer.json")
    result = {}
    for name, exchanges in (("loopd", loopd), ("peer", peer)):
        rows = _rows(exchanges, _minima(exchanges))
        processed, minimum = sum(r["processed"] for r in rows), sum(r["minimum"] for r in rows)
        result[name] = {
            "requests": rows,
            "processed": processed,
            "minimum": minimum,
            "ratio": processed / minimum,
        }
    return result


def table(figures: dict[str, Any]) -> list[str]:
    loopd, peer = figures["loopd"], figures["peer"]
    lines = [
        "| request | loopd processed / minimum | pydantic-ai processed / minimum |",
        "| --- | --- | --- |",
    ]
    for a, b in zip(loopd["requests"], peer["requests"], strict=False):
        lines.append(
            f"| {a['request']} | {a['processed']} / {a['minimum']} = {a['ratio']:.2f} "
            f"| {b['processed']} / {b['minimum']} = {b['ratio']:.2f} |"
        )
    lines.append(
        f"| **all** | {loopd['processed']} / {loopd['minimum']} = **{loopd['ratio']:.2f}** "
        f"| {peer['processed']} / {peer['minimum']} = **{peer['ratio']:.2f}** |"
    )
    return lines


if __name__ == "__main__":  # PYTHONPATH=tests:bench, as `just bench` sets it
    print(json.dumps(trio.run(measure, Path(sys.argv[1]), Path(sys.argv[2])), indent=1))
