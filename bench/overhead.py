"""Figure 3: one request through the socket and loopd against the same request sent to
llama-server directly with loopd's own client (`loopd.infer.Client`), in pairs, alternating
which goes first.

Each pair asks two new questions on the same cached system prompt, the same words after a first
letter of their own (`Questions`), so both requests process their whole question, of the same
number of tokens, and nothing else: loopd starts a new session for each. PAIRS is odd and the
order alternates. Time to first token is measured from sending to the first content piece;
total to the end of the answer.
"""

from __future__ import annotations

import itertools
import statistics
import string
import tempfile
import time
from pathlib import Path
from typing import Any

from loopd.config import LoopConfig
from loopd.infer import ChatRequest, Client, Content, Generation
from loopd.server_proc import LaunchSpec, managed_server
from loopd.session.baseline import make_baseline, messages
from loopd.session.records import UserRecord
from support.daemon import Daemon

PAIRS = 9
MAX_TOKENS = 24
# Every answer runs to MAX_TOKENS, so total times compare like with like.
SAMPLING = {"temperature": 0, "ignore_eos": True}


async def _through_loopd(client: Any, text: str) -> tuple[float, float]:
    await client.send({"type": "new_session"})
    await client.until("welcome")
    start = time.perf_counter()
    await client.send({"type": "send", "id": text, "content": text})
    first = None
    while (line := await client.receive()) is not None:
        if first is None and line["type"] == "event" and line["event"]["kind"] == "content":
            first = time.perf_counter()
        if line["type"] == "turn_done":
            break
    end = time.perf_counter()
    return (first or end) - start, end - start


class Questions:
    """Questions that differ from each of the last 25 asked in their first token and have as
    many tokens as each other: a question through loopd and its direct twin must process the
    same work (worded "Through loopd, ..." against "Directly, ...", loopd's had a token more,
    a few milliseconds more of prompt on two cores, put down to loopd)."""

    def __init__(self) -> None:
        self._letters = itertools.cycle(string.ascii_uppercase)

    def __call__(self, rest: str) -> str:
        return f"{next(self._letters)} {rest}"

    @staticmethod
    async def check(llama: Client, rest: str) -> None:
        """Every first letter before `rest` makes as many tokens on this server's model."""
        counts = set()
        for letter in string.ascii_uppercase:
            answer = await llama.post_json("/tokenize", {"content": f"{letter} {rest}"})
            counts.add(len(answer["tokens"]))
        if len(counts) != 1:
            raise RuntimeError(f"the questions' lengths differ: {sorted(counts)} tokens")


def first_turn_request(text: str, max_tokens: int, slot: int = 0) -> ChatRequest:
    """The very request loopd sends for a session's first turn, `text`: the same messages,
    tools, caps and sampling (`SAMPLING`: every answer runs to `max_tokens`)."""
    baseline = make_baseline()
    return ChatRequest(
        messages(baseline, [UserRecord(content=text)]),
        tools=list(baseline.tools),
        generation=Generation(
            slot=slot,
            max_tokens=max_tokens,
            thinking_cap=LoopConfig().thinking_cap,
            sampling=SAMPLING,
        ),
    )


async def _direct(llama: Client, text: str) -> tuple[float, float]:
    request = first_turn_request(text, MAX_TOKENS)
    first: list[float] = []
    start = time.perf_counter()

    def on_event(event: object) -> None:
        if isinstance(event, Content) and not first:
            first.append(time.perf_counter())

    await llama.chat(request, on_event)
    end = time.perf_counter()
    return (first[0] if first else end) - start, end - start


async def measure(binary: Path, model: Path) -> dict[str, Any]:
    spec = LaunchSpec(binary=binary, model=model, n_ctx=4096, threads=2)
    with tempfile.TemporaryDirectory() as tmp:
        async with managed_server(spec, Path(tmp) / "llama.log") as server:
            d = Daemon(Path(tmp) / "loopd", server.url, history="exact")
            d.config.write_text(
                d.config.read_text() + f"[loop]\nmax_tokens = {MAX_TOKENS}\n"
                "[server.sampling]\ntemperature = 0\nignore_eos = true\n"
            )
            await d.start()
            ratios_ttft, ratios_total, rows = [], [], []
            try:
                client = await d.connect()
                async with Client(server.url) as llama:
                    await _direct(llama, "warm up")  # the system prompt into the cache
                    questions = Questions()
                    await Questions.check(llama, "question 0: name a number.")
                    for n in range(PAIRS):
                        # Each differs from the other right after the cached system prompt, so
                        # both process their whole question, whichever went first.
                        via_loopd = questions(f"question {n}: name a number.")
                        direct_question = questions(f"question {n}: name a number.")
                        if n % 2:
                            direct = await _direct(llama, direct_question)
                            loopd = await _through_loopd(client, via_loopd)
                        else:
                            loopd = await _through_loopd(client, via_loopd)
                            direct = await _direct(llama, direct_question)
                        rows.append({"loopd": loopd, "direct": direct})
                        ratios_ttft.append(loopd[0] / direct[0])
                        ratios_total.append(loopd[1] / direct[1])
            finally:
                await d.kill()
                await d.close_clients()
    return {
        "pairs": rows,
        "ttft_ratio": statistics.median(ratios_ttft),
        "total_ratio": statistics.median(ratios_total),
        "loopd_ttft_ms": statistics.median(r["loopd"][0] for r in rows) * 1000,
        "direct_ttft_ms": statistics.median(r["direct"][0] for r in rows) * 1000,
    }
