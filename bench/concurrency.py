"""Figure 13: several conversations at once, through loopd, against the same number of clients
sending the same requests straight to the same llama-server (the limit of that server).

One llama-server with four slots (SmolLM2-135M, two threads). For N = 1, 2 and 4, in rounds:
N clients each send a question at the same moment, through loopd (each in a new session, so
loopd's request is a first turn: the baseline's messages and tools, `history = "template"`),
or directly with that very request body on slot n. Every answer runs to MAX_TOKENS
(`ignore_eos`), so both sides generate the same tokens, and every question is the same words
after a first letter of its own (`overhead.Questions`), so both sides process as many prompt
tokens. The rounds alternate which side goes first. Aggregate generated tokens per second
over each round's wall time, and the median time to first token.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from overhead import Questions, first_turn_request

from loopd.infer import Client, Content
from loopd.server_proc import LaunchSpec, managed_server
from support.daemon import Daemon, LineClient

SESSIONS = (1, 2, 4)
ROUNDS = 6
MAX_TOKENS = 48


async def _round_through_loopd(
    clients: list[LineClient], tag: str, questions: Questions
) -> list[float]:
    """Every client sends at once; the time to each one's first token, and the round's wall
    time last."""
    for client in clients:
        await client.send({"type": "new_session"})
        await client.until("welcome")
    firsts: list[float] = []
    start = time.perf_counter()

    async def one(n: int, client: LineClient) -> None:
        text = questions(f"{tag}, client {n}: tell me a story.")
        sent = time.perf_counter()
        await client.send({"type": "send", "id": f"{tag}-{n}", "content": text})
        first = None
        while (line := await client.receive()) is not None:
            if first is None and line["type"] == "event" and line["event"]["kind"] == "content":
                first = time.perf_counter() - sent
            if line["type"] in ("turn_done", "turn_failed"):
                break
        firsts.append(first or float("nan"))

    async with trio.open_nursery() as nursery:
        for n, client in enumerate(clients):
            nursery.start_soon(one, n, client)
    return [*firsts, time.perf_counter() - start]


async def _round_direct(llama: Client, count: int, tag: str, questions: Questions) -> list[float]:
    firsts: list[float] = []
    start = time.perf_counter()

    async def one(n: int) -> None:
        text = questions(f"{tag}, client {n}: tell me a story.")
        request = first_turn_request(text, MAX_TOKENS, slot=n)
        first: list[float] = []
        sent = time.perf_counter()

        def on_event(event: object) -> None:
            if isinstance(event, Content) and not first:
                first.append(time.perf_counter() - sent)

        await llama.chat(request, on_event)
        firsts.append(first[0] if first else float("nan"))

    async with trio.open_nursery() as nursery:
        for n in range(count):
            nursery.start_soon(one, n)
    return [*firsts, time.perf_counter() - start]


async def measure(binary: Path, model: Path) -> dict[str, Any]:
    spec = LaunchSpec(binary=binary, model=model, n_ctx=2048, parallel=4, threads=2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        async with managed_server(spec, Path(tmp) / "llama.log") as server:
            # Without slot files: neither side saves what a new session's slot held.
            d = Daemon(Path(tmp) / "loopd", server.url, slots='save = "never"')
            d.config.write_text(
                d.config.read_text() + f"[loop]\nmax_tokens = {MAX_TOKENS}\n"
                "[server.sampling]\ntemperature = 0\nignore_eos = true\n"
            )
            await d.start()
            try:
                async with Client(server.url) as llama:
                    questions = Questions()
                    await Questions.check(llama, "n1 r0, client 0: tell me a story.")
                    # The system prompt, every slot.
                    await _round_direct(llama, 4, "warm up", questions)
                    for count in SESSIONS:
                        clients = [await d.connect() for _ in range(count)]
                        loopd, direct = [], []
                        for r in range(ROUNDS):
                            tag = f"n{count} r{r}"
                            if r % 2:
                                direct.append(await _round_direct(llama, count, tag, questions))
                                loopd.append(await _round_through_loopd(clients, tag, questions))
                            else:
                                loopd.append(await _round_through_loopd(clients, tag, questions))
                                direct.append(await _round_direct(llama, count, tag, questions))
                        rows.append(_row(count, loopd, direct))
                        for client in clients:
                            await client.aclose()
            finally:
                await d.kill()
                await d.close_clients()
    return {"rows": rows, "max_tokens": MAX_TOKENS, "rounds": ROUNDS}


def _row(count: int, loopd: list[list[float]], direct: list[list[float]]) -> dict[str, Any]:
    def rate(rounds: list[list[float]]) -> float:
        return statistics.median(count * MAX_TOKENS / r[-1] for r in rounds)

    def ttft(rounds: list[list[float]]) -> float:
        return statistics.median(t for r in rounds for t in r[:-1]) * 1000

    return {
        "sessions": count,
        "loopd_tokens_per_s": rate(loopd),
        "direct_tokens_per_s": rate(direct),
        "ratio": rate(loopd) / rate(direct),
        "loopd_ttft_ms": ttft(loopd),
        "direct_ttft_ms": ttft(direct),
    }


def table(f: dict[str, Any]) -> list[str]:
    head = (
        "| sessions at once | through loopd, tokens/s | direct, tokens/s | ratio "
        "| time to first token, loopd | direct |"
    )
    rows = [
        f"| {r['sessions']} | {r['loopd_tokens_per_s']:.1f} | {r['direct_tokens_per_s']:.1f} "
        f"| {r['ratio']:.2f} | {r['loopd_ttft_ms']:.0f} ms | {r['direct_ttft_ms']:.0f} ms |"
        for r in f["rows"]
    ]
    return [head, "| --- | --- | --- | --- | --- | --- |", *rows]
