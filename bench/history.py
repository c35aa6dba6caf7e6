"""`just bench history`: time to first token against the length of the history, through loopd
and sent directly, and what loopd adds to it.

For each model and size, one llama-server holds a session whose first message is a document of
that many tokens: SmolLM2-135M (its 8,192-token training context is the most llama-server gives
a slot), and Gemma 3 270M ($LOOPD_SWA_MODEL; sliding-window attention, 32k context, a template
with other delimiters), when it is there. Then, in rounds, each side first as often: a
question through `loopd serve` and the socket (its time to the first content event); the very
request body loopd sends for such a question, built beforehand from the session's log
(`ExactHistory.next_prompt`, `PromptRequest`) and sent straight to `/completion` with httpx;
and that body again with the rendering loopd checks its guess by asked beside it, as loopd asks
it (`loopd.turn.guess`). Before each, the slot is set back to what the log holds (the history
and the last answer, as loopd's next request expects to find it), so all process the same
tokens. What loopd adds is the difference of the times, round by round, in all and outside the
server's prompt time; the third side splits the latter into what the check's rendering costs
the server and what is loopd's own.
For reference (SmolLM2 only), the whole history sent as messages to the chat endpoint, which
renders and tokenizes it all again.
Last, without the server's noise: loopd restarted on the same session and its very request sent
directly, both against `instant.py`, which answers each request as the real server first did,
after a fixed time to the first token; the difference is loopd's own work.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio

from loopd.canonical import canonical
from loopd.config import LoopConfig
from loopd.infer import Client, Generation, PromptPiece, PromptRequest
from loopd.server_proc import LaunchSpec, managed_server
from loopd.session.baseline import make_baseline, messages
from loopd.session.records import Baseline, Record, UsageRecord, UserRecord
from loopd.session.store import Store
from loopd.turn.exact import ExactHistory
from support.daemon import Daemon, LineClient


@dataclass(frozen=True)
class Model:
    name: str
    sizes: tuple[int, ...]
    rounds: int
    """A multiple of three: each side goes first as often (the machine is warmer or colder
    for it)."""
    instant_rounds: int
    """Rounds against a server that answers at once (`instant.py`): even, for the same."""
    messages: bool
    """Also send the history as messages to the chat endpoint (not for Gemma: where its
    rendering parts from the slot early, each such request processes the long history again,
    minutes at 28,000 tokens on two cores)."""


# llama-server caps a slot at the model's training context (8,192 for SmolLM2; 32,768 for
# Gemma 3 270M), so the longest history that fits, with room for the questions, is about 7,000
# (28,000) tokens.
SMOLLM2 = Model("SmolLM2-135M", (1_000, 3_000, 7_000), 9, 20, messages=True)
GEMMA3 = Model("Gemma 3 270M", (2_000, 14_000, 28_000), 6, 20, messages=False)
MAX_TOKENS = 8
SAMPLING = {"temperature": 0, "ignore_eos": True}
# About one token per word of this text for SmolLM2's and Gemma's tokenizers.
WORDS = "the quick brown fox jumps over a lazy dog while seven birds sing".split()  # noqa: SIM905


def document(tokens: int) -> str:
    words = [WORDS[i % len(WORDS)] for i in range(tokens)]
    return "Read this and wait for my questions.\n" + " ".join(words)


def patient_daemon(home: Path, url: str, server: str = "", slots: str = "") -> Daemon:
    """loopd on `url`, token-exact, answers of `MAX_TOKENS` at temperature 0, and time for a
    long document's first request (minutes on two cores); `server`: more [server] lines,
    `slots`: the [slots] table's."""
    d = Daemon(home, url, history="exact", slots=slots)
    config = d.config.read_text().replace(
        "[server]\n", f"[server]\nread_timeout = 3600\nqueue_timeout = 3600\n{server}", 1
    )
    d.config.write_text(
        config + f"[loop]\nmax_tokens = {MAX_TOKENS}\nturn_timeout = 3600\n"
        "[server.sampling]\ntemperature = 0\nignore_eos = true\n"
    )
    return d


async def read_document(client: LineClient, tokens: int) -> None:
    """A first turn whose message is a document of about `tokens` tokens."""
    done = await client.turn("doc", document(tokens), timeout=3600)
    if done[-1]["type"] != "turn_done":
        raise RuntimeError(f"the document's turn failed: {done[-1]}")


async def loopds_request(
    exact: ExactHistory, baseline: Baseline, records: list[Record], question: str
) -> tuple[bytes, bytes, Callable[[], Awaitable[object]] | None]:
    """The very request body loopd sends for `question` after `records`, built beforehand; one
    that leaves the slot holding what that request expects to find there (all of it but the
    text after the last answer), generating one token, which it does not keep; and the check
    loopd sends beside it, where it guessed the rendering (`loopd.turn.guess`)."""
    after = [*records, UserRecord(content=question)]
    built = await exact.next_prompt(baseline, after, thinking=True)

    def body(prompt: Sequence[PromptPiece], max_tokens: int) -> bytes:
        generation = Generation(
            thinking_cap=LoopConfig().thinking_cap, max_tokens=max_tokens, sampling=SAMPLING
        )
        return PromptRequest(prompt=prompt, format=built.format, generation=generation).body()

    return body(built.pieces, MAX_TOKENS), body(built.pieces[:-1], 1), built.check


async def beside_check(
    http: httpx.AsyncClient, body: bytes, check: Callable[[], Awaitable[object]]
) -> tuple[float, dict[str, Any]]:
    """`first_content` of `body`, with the rendering loopd checks its guess by asked beside
    it, as loopd does: what that rendering costs the server is the difference."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(check)
        return await first_content(http, "/completion", body)


GONE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""What a request on a connection the server had closed meets, as the pool took it up."""


async def first_content(
    http: httpx.AsyncClient, path: str, body: bytes
) -> tuple[float, dict[str, Any]]:
    """Seconds to the first content; and the server's `timings`, read to the end."""
    try:
        return await _first_content_once(http, path, body)
    except GONE:
        # llama-server closes the connection after a stream, and a kept-alive one after 5 idle
        # seconds; the pool may not have seen it yet. loopd's client retries the same way.
        return await _first_content_once(http, path, body)


async def _first_content_once(
    http: httpx.AsyncClient, path: str, body: bytes
) -> tuple[float, dict[str, Any]]:
    start, first = time.perf_counter(), None
    timings: dict[str, Any] = {}
    headers = {"Content-Type": "application/json"}  # as loopd sends it
    async with http.stream("POST", path, content=body, headers=headers) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            # Leading whitespace is not an answer yet (loopd's parser, like the server's, starts
            # content at the first visible character): both sides measure the same moment.
            text = chunk.get("content") or "".join(
                (c.get("delta") or {}).get("content") or "" for c in chunk.get("choices", [])
            )
            if first is None and text.strip():
                first = time.perf_counter() - start
            timings = chunk.get("timings") or timings
    return (first if first is not None else time.perf_counter() - start), timings


async def through_loopd(client: Any, turn: str) -> float:
    start = time.perf_counter()
    await client.send({"type": "send", "id": turn, "content": f"Question {turn}: and now?"})
    first = None
    while (line := await client.receive()) is not None:
        if first is None and line["type"] == "event" and line["event"]["kind"] == "content":
            first = time.perf_counter()
        if line["type"] in ("turn_done", "turn_failed"):
            break
    return (first or time.perf_counter()) - start


async def _size(binary: Path, model: Path, which: Model, tokens: int, tmp: Path) -> dict[str, Any]:
    spec = LaunchSpec(binary=binary, model=model, n_ctx=tokens + 4096, threads=2)
    async with managed_server(spec, tmp / f"llama-{tokens}.log") as server:
        d = patient_daemon(tmp / f"loopd-{tokens}", server.url)
        await d.start()
        loopd_ms, direct_ms, checked_ms, chat_ms = [], [], [], []
        server_ms, direct_server_ms, checked_server_ms = [], [], []
        try:
            client = await d.connect()
            await read_document(client, tokens)  # the history, processed once
            await client.turn("warm", "Question w: and now?")  # loopd keeps its rendering
            store = Store(d.home / "sessions")
            async with (
                httpx.AsyncClient(base_url=server.url, timeout=3600) as http,
                Client(server.url) as llama,
            ):
                exact = ExactHistory(llama)
                chats: list[bytes] = []
                header, records, _ = store.read(store.latest() or "")
                await loopds_request(exact, header.baseline, records, "?")  # a rendering kept
                for n in range(which.rounds):
                    header, records, _ = store.read(store.latest() or "")
                    question = f"Question d{n}: and now?"
                    same, reset, check = await loopds_request(
                        exact, header.baseline, records, question
                    )
                    if check is None:
                        raise RuntimeError("the bench's request was not guessed")
                    chat = {
                        "messages": [
                            *messages(header.baseline, records),
                            {"role": "user", "content": f"Question m{n}: and now?"},
                        ],
                        "tools": list(make_baseline().tools),
                        "stream": True,
                        "id_slot": 0,
                        "cache_prompt": True,
                        "max_tokens": MAX_TOKENS,
                        **SAMPLING,
                    }
                    sides = ("loopd", "direct", "checked")
                    for who in sides[n % 3 :] + sides[: n % 3]:  # each goes first as often
                        await first_content(http, "/completion", reset)
                        if who == "loopd":
                            loopd_ms.append(1000 * await through_loopd(client, f"q{n}"))
                        elif who == "direct":
                            took, seen = await first_content(http, "/completion", same)
                            direct_ms.append(1000 * took)
                            direct_server_ms.append(seen.get("prompt_ms", 0.0))
                        else:
                            took, seen = await beside_check(http, same, check)
                            checked_ms.append(1000 * took)
                            checked_server_ms.append(seen.get("prompt_ms", 0.0))
                    if which.messages:
                        chats.append(canonical(chat))
                # Afterwards, not in between: the chat endpoint's rendering of the history is
                # not the slot's tokens, so a request after it would pay for what it changed.
                for body in chats:
                    took, _ = await first_content(http, "/v1/chat/completions", body)
                    chat_ms.append(1000 * took)
            # The server's own prompt time on each of loopd's requests, beside the direct ones':
            # the same request should cost the server the same.
            _, records, _ = store.read(store.latest() or "")
            timings = [r.timings for r in records if isinstance(r, UsageRecord) and r.timings]
            server_ms = [t.prompt_ms for t in timings[2:]]  # not the document's, not "warm"
        finally:
            await d.kill()
            await d.close_clients()
        instant = await _instant(d.home, server.url, which.instant_rounds)
    loopd, direct = statistics.median(loopd_ms), statistics.median(direct_ms)
    return {
        "model": which.name,
        "tokens": tokens,
        "loopd_ms": loopd,
        "direct_ms": direct,
        # What loopd adds, round by round (all processed the same tokens): in all, and outside
        # the server's prompt time (its noise, tens of ms on two cores, taken out; but so is
        # what loopd's work beside the request costs the prompt, seen in the prompt times).
        "added_ms": _added(loopd_ms, server_ms, direct_ms, direct_server_ms),
        "added_total_ms": statistics.median(
            a - b for a, b in zip(loopd_ms, direct_ms, strict=True)
        ),
        # Of that, the rendering loopd checks its guess by (the server's work beside the
        # request), and the rest: loopd's own.
        "check_ms": _added(checked_ms, checked_server_ms, direct_ms, direct_server_ms),
        "own_ms": _added(loopd_ms, server_ms, checked_ms, checked_server_ms),
        "server_ms": statistics.median(server_ms),
        "direct_server_ms": statistics.median(direct_server_ms),
        "checked_server_ms": statistics.median(checked_server_ms),
        "messages_ms": statistics.median(chat_ms) if chat_ms else None,
        "ratio": loopd / direct,
        # Against a server that answers at once: what loopd's own work adds, without the
        # server's noise or the check's cost on its cores.
        "instant_loopd_ms": statistics.median(instant[0]),
        "instant_direct_ms": statistics.median(instant[1]),
        "instant_added_ms": statistics.median(a - b for a, b in zip(*instant, strict=True)),
    }


INSTANT_PROMPT_TIME = 0.02
"""A short prompt's time to first token on a GPU: long enough for the check and the fsync
loopd does beside its request, as on any real server."""


async def _instant(home: Path, upstream: str, rounds: int) -> tuple[list[float], list[float]]:
    """Time to first content through loopd (restarted on the same session) and of its very
    request sent directly, both against `InstantServer` in front of `upstream`: each request
    is asked of `upstream` once, beforehand, then answered at once."""
    loopd_ms: list[float] = []
    direct_ms: list[float] = []
    async with instant_server(upstream, INSTANT_PROMPT_TIME) as url:
        # It keeps no slot files: a save half a second after a turn (when the bench's own
        # requests took longer) would be a request the bench did not build.
        d = patient_daemon(home, url, slots='save = "never"')
        await d.start()
        try:
            client = await d.connect()
            await client.turn("instant", "Question w: and now?")  # loopd keeps its rendering
            store = Store(home / "sessions")
            async with (
                httpx.AsyncClient(base_url=url, timeout=3600) as http,
                # `/missed` is answered on a connection kept alive: asked on `http`, it would
                # hand the direct request a connection made beforehand, which loopd's request,
                # like any after a stream, never has.
                httpx.AsyncClient(base_url=url, timeout=3600) as counts,
                httpx.AsyncClient(base_url=upstream, timeout=3600) as real,
                Client(url) as llama,
            ):
                exact = ExactHistory(llama)
                header, records, _ = store.read(store.latest() or "")
                await loopds_request(exact, header.baseline, records, "?")  # a rendering kept
                for n in range(rounds):
                    header, records, _ = store.read(store.latest() or "")
                    same, reset, check = await loopds_request(
                        exact, header.baseline, records, f"Question i{n}: and now?"
                    )
                    if check is None:
                        raise RuntimeError("the bench's request was not guessed")
                    await first_content(real, "/completion", reset)  # the slot as the log holds
                    await first_content(http, "/completion", same)  # asked for real, once
                    await check()
                    missed = await _missed(counts)
                    for who in ("loopd", "direct") if n % 2 else ("direct", "loopd"):
                        if who == "loopd":
                            loopd_ms.append(1000 * await through_loopd(client, f"i{n}"))
                        else:
                            direct_ms.append(
                                1000 * (await first_content(http, "/completion", same))[0]
                            )
                    if await _missed(counts) != missed:
                        raise RuntimeError("loopd sent a request the bench did not build")
        finally:
            await d.kill()
            await d.close_clients()
    return loopd_ms, direct_ms


async def _missed(http: httpx.AsyncClient) -> int:
    """How many requests `InstantServer` had to ask upstream for. It closes a connection after
    a stream, as llama-server does, and the pool may not have seen that yet: tried again once."""
    try:
        return int((await http.get("/missed")).json())
    except GONE:
        return int((await http.get("/missed")).json())


@asynccontextmanager
async def instant_server(upstream: str, prompt_time: float) -> AsyncIterator[str]:
    """`instant.py` in front of `upstream`, a process of its own; its URL."""
    script = Path(__file__).with_name("instant.py")
    process = await trio.lowlevel.open_process(
        [sys.executable, str(script), upstream, "--prompt-time", str(prompt_time)],
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None  # noqa: S101 - piped above
        said = b""
        while not said.endswith(b"\n"):
            if not (more := await process.stdout.receive_some()):
                raise RuntimeError("the instant server ended before it said its URL")
            said += more
        yield said.decode().strip()
    finally:
        process.kill()
        await process.wait()


def _added(a: list[float], a_server: list[float], b: list[float], b_server: list[float]) -> float:
    """What side `a` adds to side `b` outside the server's prompt time, round by round."""
    return statistics.median(
        (x - x_server) - (y - y_server)
        for x, x_server, y, y_server in zip(a, a_server, b, b_server, strict=True)
    )


async def measure(binary: Path, model: Path, swa_model: Path | None = None) -> dict[str, Any]:
    models = [(SMOLLM2, model), *([(GEMMA3, swa_model)] if swa_model else [])]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [
            await _size(binary, path, which, tokens, Path(tmp))
            for which, path in models
            for tokens in which.sizes
        ]
    return {"rows": rows}


def table(f: dict[str, Any]) -> list[str]:
    head = (
        "| model | history (tokens) | through loopd (server's prompt time) | direct `/completion` "
        "(server's prompt time) | loopd adds, outside the prompt time: in all (the check's "
        "rendering; loopd's own) | loopd adds in all | history as messages (chat endpoint) "
        "| against a server that answers at once: loopd adds (through loopd; direct) |"
    )
    return [
        head,
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {r.get('model', SMOLLM2.name)} | {r['tokens']:,} "
            f"| {r['loopd_ms']:.0f} ms ({r['server_ms']:.0f}) "
            f"| {r['direct_ms']:.0f} ms ({r['direct_server_ms']:.0f}) | {r['added_ms']:.1f} ms "
            f"({_parts(r)}) | {_ms(r.get('added_total_ms'))} | {_ms(r.get('messages_ms'))} "
            f"| {_at_once(r)} |"
            for r in f["rows"]
        ),
    ]


def _parts(r: dict[str, Any]) -> str:
    if "own_ms" not in r:
        return "-"
    return f"{r['check_ms']:.1f}; {r['own_ms']:.1f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _at_once(r: dict[str, Any]) -> str:
    if "instant_added_ms" not in r:
        return "-"
    return (
        f"{r['instant_added_ms']:.1f} ms ({r['instant_loopd_ms']:.1f}; "
        f"{r['instant_direct_ms']:.1f})"
    )
