"""`just bench history`: time to first token against the length of the history, through loopd
and sent directly, and loopd's own share of it.

For each size, one llama-server (SmolLM2-135M, whose 8,192-token training context is the most
llama-server gives a slot) holds a session whose first message is a document of that many
tokens. Then, in pairs, alternating which goes first: a question through `loopd serve` and the
socket (its time to the first content event), and the very request loopd would send for such a
question, built beforehand from the session's log (`ExactHistory.next_prompt`) and sent
straight to `/completion` with httpx; and, for reference, the whole history sent as messages to
the chat endpoint, which renders and tokenizes it all again. Each request processes only its
question: the history is cached.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loopd.baseline import make_baseline, messages
from loopd.exact import ExactHistory
from loopd.infer import Client
from loopd.records import UsageRecord, UserRecord
from loopd.server_proc import LaunchSpec, managed_server
from loopd.store import Store
from support.daemon import Daemon

# llama-server caps a slot at the model's training context (8,192 for SmolLM2), so the
# longest history that fits, with room for the questions, is about 7,000 tokens.
SIZES = (1_000, 3_000, 7_000)
PAIRS = 5
MAX_TOKENS = 8
SAMPLING = {"temperature": 0, "ignore_eos": True}
# About one token per word of this text for SmolLM2's tokenizer.
WORDS = "the quick brown fox jumps over a lazy dog while seven birds sing".split()  # noqa: SIM905


def _document(tokens: int) -> str:
    words = [WORDS[i % len(WORDS)] for i in range(tokens)]
    return "Read this and wait for my questions.\n" + " ".join(words)


async def _first_content(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> float:
    start = time.perf_counter()
    async with http.stream("POST", path, json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            # Leading whitespace is not an answer yet (loopd's parser, like the server's, starts
            # content at the first visible character): both sides measure the same moment.
            text = chunk.get("content") or "".join(
                (c.get("delta") or {}).get("content") or "" for c in chunk.get("choices", [])
            )
            if text.strip():
                return time.perf_counter() - start
    return time.perf_counter() - start


async def _through_loopd(client: Any, turn: str) -> float:
    start = time.perf_counter()
    await client.send({"type": "send", "id": turn, "content": f"Question {turn}: and now?"})
    first = None
    while (line := await client.receive()) is not None:
        if first is None and line["type"] == "event" and line["event"]["kind"] == "content":
            first = time.perf_counter()
        if line["type"] in ("turn_done", "turn_failed"):
            break
    return (first or time.perf_counter()) - start


async def _size(binary: Path, model: Path, tokens: int, tmp: Path) -> dict[str, Any]:
    spec = LaunchSpec(binary=binary, model=model, n_ctx=tokens + 4096, threads=2)
    async with managed_server(spec, tmp / f"llama-{tokens}.log") as server:
        d = Daemon(tmp / f"loopd-{tokens}", server.url, history="exact")
        # The document's first request takes minutes on two cores.
        config = d.config.read_text().replace(
            "[server]\n", "[server]\nread_timeout = 3600\nqueue_timeout = 3600\n", 1
        )
        d.config.write_text(
            config + f"[loop]\nmax_tokens = {MAX_TOKENS}\nturn_timeout = 3600\n"
            "[server.sampling]\ntemperature = 0\nignore_eos = true\n"
        )
        await d.start()
        loopd_ms, direct_ms, chat_ms, server_ms = [], [], [], []
        try:
            client = await d.connect()
            # The history, processed once.
            done = await client.turn("doc", _document(tokens), timeout=3600)
            if done[-1]["type"] != "turn_done":
                raise RuntimeError(f"the document's turn failed: {done[-1]}")
            store = Store(d.home / "sessions")
            async with (
                httpx.AsyncClient(base_url=server.url, timeout=3600) as http,
                Client(server.url) as llama,
            ):
                exact = ExactHistory(llama)
                chats: list[dict[str, Any]] = []
                for pair in range(PAIRS):
                    header, records, _ = store.read(store.latest() or "")
                    # The very prompt loopd would send for this question, built beforehand.
                    question = f"Question d{pair}: and now?"
                    after = [*records, UserRecord(content=question)]
                    built = await exact.next_prompt(header.baseline, after, thinking=True)
                    same = {
                        "prompt": built.pieces,
                        "stream": True,
                        "id_slot": 0,
                        "cache_prompt": True,
                        "n_predict": MAX_TOKENS,
                        **SAMPLING,
                    }
                    chat = {
                        "messages": [
                            *messages(header.baseline, records),
                            {"role": "user", "content": f"Question m{pair}: and now?"},
                        ],
                        "tools": list(make_baseline().tools),
                        "stream": True,
                        "id_slot": 0,
                        "cache_prompt": True,
                        "max_tokens": MAX_TOKENS,
                        **SAMPLING,
                    }
                    order = ("loopd", "direct") if pair % 2 == 0 else ("direct", "loopd")
                    for who in order:
                        if who == "loopd":
                            loopd_ms.append(1000 * await _through_loopd(client, f"q{pair}"))
                        else:
                            direct_ms.append(1000 * await _first_content(http, "/completion", same))
                    chats.append(chat)
                # Afterwards, not in between: the chat endpoint's rendering of the history is
                # not the slot's tokens, so a request after it would pay for what it changed.
                for chat in chats:
                    took = await _first_content(http, "/v1/chat/completions", chat)
                    chat_ms.append(1000 * took)
            # The server's own time on each of loopd's prompts: what is left of loopd's time
            # to the first token is loopd's (and the socket's) own share.
            _, records, _ = store.read(store.latest() or "")
            timings = [r.timings for r in records if isinstance(r, UsageRecord) and r.timings]
            server_ms = [t.prompt_ms for t in timings[1:]]  # the document's is not one of them
        finally:
            await d.kill()
            await d.close_clients()
    loopd, direct = statistics.median(loopd_ms), statistics.median(direct_ms)
    share = statistics.median(t - s for t, s in zip(loopd_ms, server_ms, strict=True))
    return {
        "tokens": tokens,
        "loopd_ms": loopd,
        "direct_ms": direct,
        "share_ms": share,
        "messages_ms": statistics.median(chat_ms),
        "ratio": loopd / direct,
    }


async def measure(binary: Path, model: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        rows = [await _size(binary, model, tokens, Path(tmp)) for tokens in SIZES]
    return {"rows": rows}


def table(f: dict[str, Any]) -> list[str]:
    head = (
        "| history (tokens) | through loopd | direct `/completion` | ratio | loopd's share "
        "(its time to first token less the server's prompt time) | history as messages "
        "(chat endpoint) |"
    )
    return [
        head,
        "| --- | --- | --- | --- | --- | --- |",
        *(
            f"| {r['tokens']:,} | {r['loopd_ms']:.0f} ms | {r['direct_ms']:.0f} ms "
            f"| {r['ratio']:.2f}x | {r['share_ms']:.0f} ms | {r['messages_ms']:.0f} ms |"
            for r in f["rows"]
        ),
    ]
