"""`just bench vllm`: loopd on a real vLLM (the CPU build, SmolLM2-135M, tests/support/vllm.py)
against clients that talk to vLLM's chat endpoint directly, on the same server in the same run.

Four vLLM servers, one after another: SmolLM2's own chat template (the FLAGS alone; minutes
to start on two cores), then three of llama.cpp's (`--chat-template`, TEMPLATE_ARGS) that
render history differently. On each, loopd (`history = "exact"`, temperature 0) holds a
conversation of TURNS_HERE (bench/conversation.py's first five), restarted after
RESTART_AFTER; then, the prefix cache emptied (`/reset_prefix_cache`), a direct httpx
client holds the same conversation as messages on `/v1/chat/completions` (the same system
prompt and tools, each answer sent back as the content it got). Per request, processed is
`prompt_tokens - cached_tokens`; the minimum is the tokens of its prompt that vLLM could not
hold from the conversation's previous request: `prompt_tokens - cache_limit(previous, this)`,
whole blocks only, and never the prompt's last token (`loopd.infer.cache_limit`). Recomputed:
what that limit allowed and the request did not find.

On the first server also, timed: the time to first token of a question after about 1k and 3k
tokens of history, through loopd and the socket against the same history and a question sent
as messages straight to the chat endpoint (streamed; each side first as often, both after the
history the log held when the round began, so both find it in the cache and compute the
question and the tail of the last block); and 1, 2 and 4 sessions at once through loopd
(`[server] slots = 4`) against as many direct clients, every answer
CONCURRENCY_MAX_TOKENS long (`ignore_eos`), as bench/concurrency.py on llama-server.

The module's name is the package's: the vLLM processes start without this folder on their
PYTHONPATH (`_ENV`), or `import vllm` would find this file.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
from conversation import SYSTEM, TURNS
from history import document

from loopd.config import LoopConfig
from loopd.infer import Timings, cache_limit
from loopd.session.baseline import messages
from loopd.session.records import AssistantRecord, Baseline, CacheLossRecord, UsageRecord
from loopd.session.store import Store
from support.daemon import Daemon, LineClient
from support.vllm import RunningVllm, start_vllm

TURNS_HERE = TURNS[:5]
RESTART_AFTER = 3
"""loopd is stopped and started again after this many turns."""
CACHE_MAX_TOKENS = 32
TEMPLATES = (
    # (file in llama.cpp's models/templates, what it does to history as messages)
    ("Qwen-QwQ-32B.jinja", "drops past reasoning at every request"),
    ("Qwen3.5-4B.jinja", "drops past reasoning at a new user message"),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "drops nothing"),
)
OWN = "SmolLM2 (its own)"

HISTORY_SIZES = (1_000, 3_000)
"""Tokens of history; vLLM here takes 4,096 a request (`--max-model-len`)."""
HISTORY_ROUNDS = 6
"""Even: each side first as often."""
HISTORY_MAX_TOKENS = 8

SESSIONS = (1, 2, 4)
CONCURRENCY_ROUNDS = 4
CONCURRENCY_MAX_TOKENS = 48
TIMEOUT = 600

THINKING = {"enable_thinking": LoopConfig().thinking}
"""`chat_template_kwargs` as loopd renders with (`[loop] thinking`, on by default): the direct
side asks the same of the template (QwQ's closes the reasoning at once where it is not on)."""

TEMPLATE_ARGS = ("-O0",)
"""The servers that only count tokens start without torch.compile: about 40 s instead of
several minutes (vLLM 0.32 compiles anew at every start here, its compile cache failing to
load), and the same tokens; the timed figures are measured on the first, with the FLAGS alone."""

_ENV = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": ""}
"""`/reset_prefix_cache` is served in dev mode only; and no bench/ on the path."""


def daemon(home: Path, url: str, max_tokens: int, sampling: str = "temperature = 0") -> Daemon:
    """loopd on `url` alone (the engine is found from the server), token-exact, four turns at
    once, as tests/test_vllm_loopd.py's `on_vllm`."""
    d = Daemon(home, url, history="exact", session=f'system_prompt = "{SYSTEM}"\n')
    text = d.config.read_text().replace(
        f'url = "{url}"\n', f'url = "{url}"\nsampling = {{ {sampling} }}\nslots = 4\n'
    )
    d.config.write_text(text + f"[loop]\nmax_tokens = {max_tokens}\nturn_timeout = {TIMEOUT}\n")
    return d


async def reset_cache(http: httpx.AsyncClient) -> None:
    response = await http.post("/reset_prefix_cache")
    response.raise_for_status()


async def new_session(client: LineClient, session: str = "new") -> str:
    await client.send({"type": "hello", "session": session})
    line = (await client.until("welcome"))[-1]
    return str(line["session"])


def _read(d: Daemon, session: str) -> tuple[Baseline, list[Any]]:
    header, records, _ = Store(d.home / "sessions").read(session)
    return header.baseline, list(records)


# --- 1. tokens processed against the minimum -------------------------------------------------


def figures(timings: list[Timings]) -> dict[str, Any]:
    """Per request: processed, and the block-grained minimum after the request before."""
    rows, previous = [], None
    for t in timings:
        limit = cache_limit(previous, t) if previous else 0
        rows.append(
            {
                "prompt": t.prompt_tokens,
                "cached": t.cached,
                "processed": t.prompt_n,
                "limit": limit,
                "minimum": t.prompt_tokens - limit,
                "recomputed": max(0, limit - t.cached),
            }
        )
        previous = t
    processed = sum(r["processed"] for r in rows)
    minimum = sum(r["minimum"] for r in rows)
    return {
        "requests": rows,
        "processed": processed,
        "minimum": minimum,
        "recomputed": sum(r["recomputed"] for r in rows),
        "ratio": processed / minimum if minimum else 0.0,
        # The first request computes the system prompt and tools, alike on both sides.
        "later_processed": sum(r["processed"] for r in rows[1:]),
        "later_minimum": sum(r["minimum"] for r in rows[1:]),
    }


async def loopd_conversation(server: RunningVllm, home: Path) -> dict[str, Any]:
    d = daemon(home, server.url, CACHE_MAX_TOKENS)
    failed: list[str] = []
    await d.start()
    try:
        client = await d.connect()
        session = await new_session(client)
        for n, text in enumerate(TURNS_HERE, start=1):
            done = await client.turn(f"t{n}", text, timeout=TIMEOUT)
            if done[-1]["type"] != "turn_done":
                failed.append(f"turn {n}: {done[-1].get('kind')}: {done[-1].get('message')}")
            if n == RESTART_AFTER:
                await d.stop()
                await d.close_clients()
                await d.start()
                client = await d.connect()
                await new_session(client, session)
    finally:
        await d.end()
    baseline, records = _read(d, session)
    timings = [r.timings for r in records if isinstance(r, UsageRecord) and r.timings]
    losses = [
        {"expected": r.expected, "cached": r.cached, "reason": r.reason}
        for r in records
        if isinstance(r, CacheLossRecord)
    ]
    answers = [
        f"{r.reasoning_content or ''} {r.content or ''}"
        for r in records
        if isinstance(r, AssistantRecord)
    ]
    return {
        **figures(timings),
        "session": session,
        "losses": losses,
        "failed": failed,
        "answers": answers,
        "reasoning": sum(
            bool(r.reasoning_content) for r in records if isinstance(r, AssistantRecord)
        ),
        "_baseline": baseline,
    }


async def direct_conversation(
    server: RunningVllm, http: httpx.AsyncClient, baseline: Baseline
) -> dict[str, Any]:
    """The same turns as messages, each answer sent back as the content it got."""
    sent = messages(baseline, [])
    timings, answers = [], []
    for text in TURNS_HERE:
        sent.append({"role": "user", "content": text})
        body = {
            "model": server.model,
            "messages": sent,
            "tools": list(baseline.tools),
            "tool_choice": "none",  # rendered all the same; "auto" needs a tool parser
            "chat_template_kwargs": THINKING,
            "max_tokens": CACHE_MAX_TOKENS,
            "temperature": 0,
        }
        response = await http.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        answer = response.json()
        timings.append(_timings(answer["usage"]))
        content = answer["choices"][0]["message"].get("content") or ""
        answers.append(content)
        sent.append({"role": "assistant", "content": content})
    return {**figures(timings), "answers": answers}


def _timings(usage: dict[str, Any]) -> Timings:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Timings(
        cache_n=cached,
        prompt_n=usage["prompt_tokens"] - cached,
        prompt_ms=0,
        predicted_n=usage["completion_tokens"],
        predicted_ms=0,
        block=32,
    )


async def cache_row(server: RunningVllm, name: str, note: str, tmp: Path) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
        await reset_cache(http)
        try:
            loopd = await loopd_conversation(server, tmp / f"loopd-{name}")
        except (RuntimeError, AssertionError, trio.BrokenResourceError) as e:
            # The row says so and keeps the end of loopd's log (its folder is temporary).
            log = (tmp / f"loopd-{name}" / "loopd.log").read_text(errors="replace")[-2000:]
            return {"template": name, "note": note, "error": f"{e!r}"[:300], "log": log}
        await reset_cache(http)
        direct = await direct_conversation(server, http, loopd.pop("_baseline"))
    alike = sum(
        _words(a) == _words(b) for a, b in zip(loopd["answers"], direct["answers"], strict=False)
    )
    return {
        "template": name,
        "note": note,
        "loopd": loopd,
        "direct": direct,
        "answers_alike": alike,
    }


def _words(answer: str) -> list[str]:
    """An answer's words, its reasoning's delimiters aside: loopd keeps the reasoning apart,
    the chat endpoint (no reasoning parser) sends it as content."""
    return answer.replace("<think>", " ").replace("</think>", " ").split()


# --- 2. time to first token after a long history ---------------------------------------------


async def _through_loopd(client: LineClient, turn: str, text: str) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    await client.send({"type": "send", "id": turn, "content": text})
    first, done = None, {}
    while (line := await client.receive()) is not None:
        if first is None and line["type"] == "event" and line["event"]["kind"] == "content":
            first = time.perf_counter()
        if line["type"] in ("turn_done", "turn_failed") and line["id"] == turn:
            done = line
            break
    if done.get("type") != "turn_done":
        raise RuntimeError(f"a timed turn through loopd failed: {done}")
    return (first or time.perf_counter()) - start, done


async def _stream_chat(
    http: httpx.AsyncClient, body: dict[str, Any]
) -> tuple[float, dict[str, Any]]:
    """Seconds to the first visible content of a streamed chat request; and its usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start, first = time.perf_counter(), None
    usage: dict[str, Any] = {}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            text = "".join(
                (c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or ()
            )
            # Leading whitespace is not an answer yet (loopd's parser starts content at the
            # first visible character): both sides measure the same moment.
            if first is None and text.strip():
                first = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    return (first if first is not None else time.perf_counter() - start), usage


async def _direct_after(
    http: httpx.AsyncClient,
    model: str,
    history: tuple[list[dict[str, Any]], list[dict[str, Any]]],
    question: str,
    *,
    max_tokens: int = HISTORY_MAX_TOKENS,
) -> tuple[float, dict[str, Any]]:
    """`question` after `history` (its messages and tools), streamed to the chat endpoint."""
    sent, tools = history
    body = {
        "model": model,
        "messages": [*sent, {"role": "user", "content": question}],
        "tools": tools,
        "tool_choice": "none",
        "chat_template_kwargs": THINKING,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return await _stream_chat(http, body)


def _processed(usage: dict[str, Any]) -> int:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return int(usage.get("prompt_tokens", 0)) - cached


async def history_rows(server: RunningVllm, tmp: Path) -> list[dict[str, Any]]:
    d = daemon(tmp / "loopd-history", server.url, HISTORY_MAX_TOKENS)
    rows = []
    await d.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
            for tokens in HISTORY_SIZES:
                print(f"  history {tokens}", file=sys.stderr)
                client = await d.connect()
                session = await new_session(client)
                done = await client.turn("doc", document(tokens), timeout=TIMEOUT)
                if done[-1]["type"] != "turn_done":
                    raise RuntimeError(f"the document's turn failed: {done[-1]}")
                await client.turn("warm", "W: and now?", timeout=TIMEOUT)
                loopd_ms, direct_ms, loopd_new, direct_new, prompts = [], [], [], [], []
                for n in range(HISTORY_ROUNDS):
                    # Both sides ask after the same history: the direct side after what the
                    # log held when the round began, whichever goes first (vLLM keeps it all).
                    # The questions differ from their first token, but the few tokens before
                    # it (the last answer's end, the user's header) are alike: where a block
                    # ends among them, the side that went second would find it, computed by
                    # the first. A request that stops there fills that block for both first.
                    baseline, records = _read(d, session)
                    history = (messages(baseline, records), list(baseline.tools))
                    await _direct_after(http, server.model, history, "Z", max_tokens=1)
                    for who in ("loopd", "direct") if n % 2 == 0 else ("direct", "loopd"):
                        if who == "loopd":
                            question = f"Q{n}: and now?"
                            took, line = await _through_loopd(client, f"q{n}", question)
                            loopd_ms.append(1000 * took)
                            loopd_new.append((line.get("usage") or {}).get("prompt_n") or 0)
                        else:
                            question = f"M{n}: and now?"
                            took, usage = await _direct_after(http, server.model, history, question)
                            direct_ms.append(1000 * took)
                            direct_new.append(_processed(usage))
                            prompts.append(usage.get("prompt_tokens", 0))
                loopd, direct = statistics.median(loopd_ms), statistics.median(direct_ms)
                alike = [
                    a - b
                    for a, b, x, y in zip(loopd_ms, direct_ms, loopd_new, direct_new, strict=True)
                    if x == y
                ]
                rows.append(
                    {
                        "tokens": tokens,
                        "prompt_tokens": statistics.median(prompts),
                        "loopd_ms": loopd,
                        "direct_ms": direct,
                        "ratio": loopd / direct,
                        "added_ms": statistics.median(alike) if alike else None,
                        "alike_rounds": len(alike),
                        "loopd_processed": statistics.median(loopd_new),
                        "direct_processed": statistics.median(direct_new),
                        "rounds": {
                            "loopd_ms": loopd_ms,
                            "direct_ms": direct_ms,
                            "loopd_processed": loopd_new,
                            "direct_processed": direct_new,
                        },
                    }
                )
                await client.aclose()
    finally:
        await d.end()
    return rows


# --- 3. sessions at once ---------------------------------------------------------------------


async def _round_loopd(clients: list[LineClient], tag: str) -> list[float]:
    """Every client sends at once, each in a new session; the time to each one's first token,
    the tokens generated, and the round's wall time last."""
    for client in clients:
        await new_session(client)
    firsts: list[float] = []
    generated = 0
    start = time.perf_counter()

    async def one(n: int, client: LineClient) -> None:
        nonlocal generated
        took, done = await _through_loopd(
            client, f"{tag}-{n}", f"Through loopd {tag}, client {n}: tell me a story."
        )
        firsts.append(took)
        generated += (done.get("usage") or {}).get("predicted_n") or 0

    async with trio.open_nursery() as nursery:
        for n, client in enumerate(clients):
            nursery.start_soon(one, n, client)
    return [*firsts, generated, time.perf_counter() - start]


async def _round_direct(
    http: httpx.AsyncClient, server: RunningVllm, baseline: Baseline, count: int, tag: str
) -> list[float]:
    firsts: list[float] = []
    generated = 0
    start = time.perf_counter()

    async def one(n: int) -> None:
        nonlocal generated
        text = f"Directly {tag}, client {n}: tell me a story."
        body = {
            "model": server.model,
            "messages": [*messages(baseline, []), {"role": "user", "content": text}],
            "tools": list(baseline.tools),
            "tool_choice": "none",
            "chat_template_kwargs": THINKING,
            "max_tokens": CONCURRENCY_MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        took, usage = await _stream_chat(http, body)
        firsts.append(took)
        generated += usage.get("completion_tokens", 0)

    async with trio.open_nursery() as nursery:
        for n in range(count):
            nursery.start_soon(one, n)
    return [*firsts, generated, time.perf_counter() - start]


async def concurrency_rows(server: RunningVllm, tmp: Path) -> list[dict[str, Any]]:
    d = daemon(
        tmp / "loopd-concurrency",
        server.url,
        CONCURRENCY_MAX_TOKENS,
        sampling="temperature = 0, ignore_eos = true",
    )
    rows = []
    await d.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
            warm = await d.connect()
            session = await new_session(warm)
            await warm.turn("warm", "Hello.", timeout=TIMEOUT)  # the system prompt, cached
            baseline, _ = _read(d, session)
            await _round_direct(http, server, baseline, 1, "warm up")
            for count in SESSIONS:
                print(f"  {count} at once", file=sys.stderr)
                clients = [await d.connect() for _ in range(count)]
                loopd, direct = [], []
                for r in range(CONCURRENCY_ROUNDS):
                    tag = f"n{count} r{r}"
                    if r % 2:
                        direct.append(await _round_direct(http, server, baseline, count, tag))
                        loopd.append(await _round_loopd(clients, tag))
                    else:
                        loopd.append(await _round_loopd(clients, tag))
                        direct.append(await _round_direct(http, server, baseline, count, tag))
                rows.append(_concurrency_row(count, loopd, direct))
                for client in clients:
                    await client.aclose()
    finally:
        await d.end()
    return rows


def _concurrency_row(
    count: int, loopd: list[list[float]], direct: list[list[float]]
) -> dict[str, Any]:
    def rate(rounds: list[list[float]]) -> float:
        return statistics.median(r[-2] / r[-1] for r in rounds)

    def firsts(rounds: list[list[float]]) -> list[float]:
        return [1000 * t for r in rounds for t in r[:-2]]

    return {
        "sessions": count,
        "loopd_tokens_per_s": rate(loopd),
        "direct_tokens_per_s": rate(direct),
        "ratio": rate(loopd) / rate(direct),
        "loopd_ttft_ms": statistics.median(firsts(loopd)),
        "direct_ttft_ms": statistics.median(firsts(direct)),
        "ttft_ratio": statistics.median(firsts(loopd)) / statistics.median(firsts(direct)),
        # Where two requests come at once, vLLM often takes the second a step (a prefill)
        # later, through loopd or not: the times gather in two heaps, and the median of a
        # few rounds falls in either. The mean does not jump so.
        "loopd_ttft_mean_ms": statistics.mean(firsts(loopd)),
        "direct_ttft_mean_ms": statistics.mean(firsts(direct)),
        "loopd_tokens": statistics.median(r[-2] for r in loopd),
        "direct_tokens": statistics.median(r[-2] for r in direct),
        "rounds": {"loopd": loopd, "direct": direct},
    }


# --- the run ---------------------------------------------------------------------------------


@asynccontextmanager
async def vllm(
    log_dir: Path, template: Path | None = None, extra_args: tuple[str, ...] = ()
) -> AsyncIterator[RunningVllm]:
    """`start_vllm` (it blocks: in a thread) as an async context."""
    manager = start_vllm(log_dir, chat_template=template, extra_args=extra_args, env=_ENV)
    started = time.monotonic()
    server = await trio.to_thread.run_sync(manager.__enter__)
    print(f"  vLLM up in {time.monotonic() - started:.0f} s", file=sys.stderr)
    try:
        yield server
    finally:
        await trio.to_thread.run_sync(manager.__exit__, None, None, None)


async def measure(templates: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp) / "vllm"
        print(f"  vLLM, {OWN}", file=sys.stderr)
        async with vllm(logs) as server:
            async with httpx.AsyncClient(base_url=server.url) as http:
                result["version"] = (await http.get("/version")).json().get("version")
            result["history"] = await history_rows(server, Path(tmp))
            result["concurrency"] = await concurrency_rows(server, Path(tmp))
            rows = [await cache_row(server, OWN, "the model's own", Path(tmp))]
        for name, note in TEMPLATES:
            print(f"  vLLM, {name}", file=sys.stderr)
            async with vllm(logs, templates / name, TEMPLATE_ARGS) as server:
                rows.append(await cache_row(server, Path(name).stem, note, Path(tmp)))
    result["cache"] = rows
    result.update(
        turns=len(TURNS_HERE),
        restart_after=RESTART_AFTER,
        cache_max_tokens=CACHE_MAX_TOKENS,
        history_rounds=HISTORY_ROUNDS,
        history_max_tokens=HISTORY_MAX_TOKENS,
        concurrency_rounds=CONCURRENCY_ROUNDS,
        concurrency_max_tokens=CONCURRENCY_MAX_TOKENS,
    )
    return result


# --- the tables ------------------------------------------------------------------------------


def _side(f: dict[str, Any]) -> str:
    return f"{f['recomputed']} / {f['processed']} / {f['minimum']} = {f['ratio']:.2f}"


def _mean(r: dict[str, Any], side: str) -> str:
    mean = r.get(f"{side}_ttft_mean_ms")
    return "-" if mean is None else f"{mean:.0f} ms"


def _mean_ratio(r: dict[str, Any]) -> str:
    if "loopd_ttft_mean_ms" not in r:
        return "-"
    return f"{r['loopd_ttft_mean_ms'] / r['direct_ttft_mean_ms']:.2f}"


def _added(r: dict[str, Any]) -> str:
    if r.get("added_ms") is None:
        return "-"
    pairs = r.get("alike_rounds")
    return f"{r['added_ms']:.0f} ms" + (
        f" ({pairs} of {len(r['rounds']['loopd_ms'])})" if pairs is not None else ""
    )


def _over(a: int, b: int) -> str:
    return f"{a / b:.2f}x" if b else "-"


def table(f: dict[str, Any]) -> list[str]:
    lines = [
        (
            f"Tokens processed, {f['turns']} turns, loopd restarted after turn "
            f"{f['restart_after']}, answers of up to {f['cache_max_tokens']} tokens:"
        ),
        "",
        (
            "| chat template | what it does to history | loopd token-exact: recomputed / "
            "processed / minimum = ratio | direct as messages: recomputed / processed / "
            "minimum = ratio | direct ÷ loopd, processed: all (after the first request) "
            "| note |"
        ),
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in f["cache"]:
        if "error" in r:
            lines.append(f"| {r['template']} | {r['note']} | - | - | - | loopd: {r['error']} |")
            continue
        loopd, direct = r["loopd"], r["direct"]
        notes = [
            *([f"{len(loopd['losses'])} cache_loss records"] if loopd["losses"] else []),
            *loopd["failed"],
            *(
                [f"{loopd['reasoning']} of loopd's answers are reasoning"]
                if loopd["reasoning"]
                else []
            ),
            f"answers alike on {r['answers_alike']} of {len(direct['answers'])} turns",
        ]
        lines.append(
            f"| {r['template']} | {r['note']} | {_side(loopd)} | {_side(direct)} "
            f"| {direct['processed'] / loopd['processed']:.2f}x "
            f"({_over(direct['later_processed'], loopd['later_processed'])}) "
            f"| {'; '.join(notes)} |"
        )
    lines += [
        "",
        (
            f"Time to first token after a long history, medians of {f['history_rounds']} "
            f"rounds, answers of {f['history_max_tokens']} tokens:"
        ),
        "",
        (
            "| history (tokens) | prompt (tokens) | through loopd | direct, history as messages "
            "| ratio | loopd adds: median of the pairs that processed as many tokens (pairs) "
            "| tokens processed, loopd / direct (medians) |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {r['tokens']:,} | {r['prompt_tokens']:,.0f} | {r['loopd_ms']:.0f} ms "
            f"| {r['direct_ms']:.0f} ms | {r['ratio']:.2f} | {_added(r)} "
            f"| {r['loopd_processed']:.0f} / {r['direct_processed']:.0f} |"
            for r in f["history"]
        ),
        "",
        (
            f"Sessions at once, medians of {f['concurrency_rounds']} rounds, every answer "
            f"{f['concurrency_max_tokens']} tokens (`ignore_eos`):"
        ),
        "",
        (
            "| sessions at once | through loopd, tokens/s | direct, tokens/s | ratio "
            "| time to first token, loopd: median (mean) | direct: median (mean) "
            "| ratio of medians (of means) |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {r['sessions']} | {r['loopd_tokens_per_s']:.1f} | {r['direct_tokens_per_s']:.1f} "
            f"| {r['ratio']:.2f} | {r['loopd_ttft_ms']:.0f} ms ({_mean(r, 'loopd')}) "
            f"| {r['direct_ttft_ms']:.0f} ms ({_mean(r, 'direct')}) | {r['ttft_ratio']:.2f} "
            f"({_mean_ratio(r)}) |"
            for r in f["concurrency"]
        ),
    ]
    return lines


if __name__ == "__main__":  # PYTHONPATH=tests:bench, as `just bench` sets it
    print(json.dumps(trio.run(measure, Path(sys.argv[1])), indent=1, default=str))
