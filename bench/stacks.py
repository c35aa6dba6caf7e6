"""`just bench stacks`: what each HTTP stack costs loopd on the way to and through a streamed
completion and a small JSON request against the real llama-server, as a ratio of the two.

The two stacks: httpx (one pooled `AsyncClient`, its SSE read as `aiter_lines`), and loopd's own
request over h11 (`loopd.infer._stream`: a connection of its own per request, its head written
at once, its lines split without copies). Both send the same bytes to the same `/completion`
(a cached prompt, `ignore_eos`), in rounds, each side first as often. The server runs in its own
process, so the client's CPU time (`time.process_time`) is the stack's own work whatever the
server's noise: per request from streams of one token, per chunk from the difference to streams
of `LONG` tokens. Wall times to the head and to the first event are given beside it. The JSON
request is `/tokenize` of a short text: httpx on its kept-alive connection against h11 on a new
one.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import trio

from loopd.infer._stream import post, request
from loopd.server_proc import LaunchSpec, managed_server

ROUNDS = 10
"""Even: each side goes first as often."""
LONG = 32
TLS = httpx.create_ssl_context()


def _body(tokens: int) -> bytes:
    body = {
        "prompt": "Count from one to a hundred, in words.",
        "n_predict": tokens,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": True,
        "id_slot": 0,
    }
    return json.dumps(body).encode()


Timed = tuple[float, float, float, int]
"""CPU seconds, wall seconds to the head, to the first event, and the events read."""


async def _h11_stream(url: httpx.URL, body: bytes) -> Timed:
    cpu, start = time.process_time(), time.perf_counter()
    stream = await post(url, body, connect_timeout=5, tls=TLS)
    try:
        await stream.read_head()
        head = time.perf_counter()
        first, events = 0.0, 0
        while (data := await stream.event_data()) is not None:
            first = first or time.perf_counter()
            events += 1
            if json.loads(data).get("stop"):
                break
    finally:
        await stream.aclose()
    return time.process_time() - cpu, head - start, first - start, events


async def _httpx_stream(http: httpx.AsyncClient, url: httpx.URL, body: bytes) -> Timed:
    cpu, start = time.process_time(), time.perf_counter()
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    async with http.stream("POST", url, content=body, headers=headers) as response:
        head = time.perf_counter()
        first, events = 0.0, 0
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            first = first or time.perf_counter()
            events += 1
            if json.loads(line[5:]).get("stop"):
                break
    return time.process_time() - cpu, head - start, first - start, events


async def _h11_json(url: httpx.URL, body: bytes) -> tuple[float, float]:
    cpu, start = time.process_time(), time.perf_counter()
    status, answer = await request(b"POST", url, body, connect_timeout=5, tls=TLS)
    if status != 200 or not json.loads(answer)["tokens"]:
        raise RuntimeError(f"/tokenize answered {status}: {answer!r:.200}")
    return time.process_time() - cpu, time.perf_counter() - start


async def _httpx_json(http: httpx.AsyncClient, url: httpx.URL, body: bytes) -> tuple[float, float]:
    cpu, start = time.process_time(), time.perf_counter()
    response = await http.post(url, content=body, headers={"Content-Type": "application/json"})
    if response.status_code != 200 or not response.json()["tokens"]:
        raise RuntimeError(f"/tokenize answered {response.status_code}: {response.text:.200}")
    return time.process_time() - cpu, time.perf_counter() - start


async def _rounds(
    h11_side: Callable[[], Awaitable[Any]], httpx_side: Callable[[], Awaitable[Any]]
) -> tuple[list[Any], list[Any]]:
    h11_runs, httpx_runs = [], []
    for n in range(ROUNDS):
        if n % 2:
            httpx_runs.append(await httpx_side())
            h11_runs.append(await h11_side())
        else:
            h11_runs.append(await h11_side())
            httpx_runs.append(await httpx_side())
    return h11_runs, httpx_runs


def _median(runs: list[Any], index: int) -> float:
    return float(statistics.median(r[index] for r in runs))


async def measure(binary: Path, model: Path) -> dict[str, Any]:
    spec = LaunchSpec(binary=binary, model=model, n_ctx=2048, threads=1)
    with tempfile.TemporaryDirectory() as tmp:
        async with (
            managed_server(spec, Path(tmp) / "llama.log") as server,
            httpx.AsyncClient(timeout=300, trust_env=False, verify=TLS) as http,
        ):
            completion = httpx.URL(server.url + "/completion")
            tokenize = httpx.URL(server.url + "/tokenize")
            short, long = _body(1), _body(LONG)
            await _h11_stream(completion, long)  # the prompt into the slot's cache
            await _httpx_stream(http, completion, short)  # httpx's connection pool warm

            h11_short, httpx_short = await _rounds(
                lambda: _h11_stream(completion, short),
                lambda: _httpx_stream(http, completion, short),
            )
            h11_long, httpx_long = await _rounds(
                lambda: _h11_stream(completion, long), lambda: _httpx_stream(http, completion, long)
            )
            words = json.dumps({"content": "What is the capital of France?"}).encode()
            h11_json, httpx_json = await _rounds(
                lambda: _h11_json(tokenize, words), lambda: _httpx_json(http, tokenize, words)
            )

    def side(short: list[Timed], long: list[Timed], small: list[Any]) -> dict[str, float]:
        chunks = _median(long, 3) - _median(short, 3)
        return {
            "request_cpu_ms": _median(short, 0) * 1000,
            "chunk_cpu_us": (_median(long, 0) - _median(short, 0)) / chunks * 1e6,
            "head_ms": _median(short, 1) * 1000,
            "first_event_ms": _median(short, 2) * 1000,
            "json_cpu_ms": _median(small, 0) * 1000,
            "json_ms": _median(small, 1) * 1000,
        }

    h11 = side(h11_short, h11_long, h11_json)
    httpx_ = side(httpx_short, httpx_long, httpx_json)
    return {
        "rounds": ROUNDS,
        "tokens": LONG,
        "h11": h11,
        "httpx": httpx_,
        "ratio": {k: httpx_[k] / h11[k] for k in h11},
    }


def table(f: dict[str, Any]) -> list[str]:
    names = {
        "request_cpu_ms": "CPU per streamed request (ms)",
        "chunk_cpu_us": "CPU per streamed chunk (µs)",
        "head_ms": "to the answer's head (ms)",
        "first_event_ms": "to the first event (ms)",
        "json_cpu_ms": "CPU per JSON request (ms)",
        "json_ms": "JSON request, wall (ms)",
    }
    rows = ["| figure | h11 (loopd) | httpx | httpx / h11 |", "| --- | --- | --- | --- |"]
    for key, name in names.items():
        rows.append(
            f"| {name} | {f['h11'][key]:.3f} | {f['httpx'][key]:.3f} | {f['ratio'][key]:.2f}x |"
        )
    return rows


if __name__ == "__main__":
    figures = trio.run(
        measure, Path(os.environ["LOOPD_LLAMA_SERVER"]), Path(os.environ["LOOPD_MODEL"])
    )
    json.dump(figures, sys.stdout, indent=2)
    print("\n" + "\n".join(table(figures)))
