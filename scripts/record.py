"""Record real exchanges with llama-server into `recordings/`, for the replay tests.

Each scenario starts the bundled llama-server (built by `just setup`) with the flags it needs,
sends its requests, and writes the requests with the raw responses. Re-run it after upgrading
llama-server to see what changed:

    python scripts/record.py              all scenarios
    python scripts/record.py plain ...    only these
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import assets  # beside this script, so on sys.path when it runs
import httpx
import trio

from loopd.infer import BUDGET_MESSAGE
from loopd.server_proc import LaunchSpec, free_port, managed_server, start_server, stop
from loopd.session import baseline

ROOT = Path(__file__).resolve().parent.parent

RECORDINGS = ROOT / "recordings"
TEMPLATES = ROOT / "tests" / "templates"
QWEN = TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja"
QWQ = TEMPLATES / "Qwen-QwQ-32B.jinja"
DROPPED_HEADERS = {"date", "content-length", "transfer-encoding", "keep-alive", "connection"}
# Greedy decoding, so a re-recording changes only when llama-server or the model does.
GREEDY = {"temperature": 0, "seed": 1}

TOOLS = list(baseline.TOOLS)  # the two tools every session of loopd offers
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "messages": messages,
        "stream": True,
        "id_slot": 0,
        "cache_prompt": True,
        "return_progress": True,
        "stream_options": {"include_usage": True},
        **GREEDY,
        **extra,
    }


async def exchange(http: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> dict[str, Any]:
    async with http.stream("POST", f"{url}/v1/chat/completions", json=payload) as r:
        raw = b"".join([piece async for piece in r.aiter_raw()])
    headers = [[k, v] for k, v in r.headers.items() if k.lower() not in DROPPED_HEADERS]
    # The chunks name the model by the path it was loaded from; keep only the file name.
    text = raw.decode().replace(str(assets.MODEL_PATH), assets.MODEL_FILE)
    return {
        "request": {"method": "POST", "path": "/v1/chat/completions", "body": payload},
        "response": {"status": r.status_code, "headers": headers, "body": text},
    }


def answer_of(recorded: dict[str, Any]) -> str:
    chunks = [
        json.loads(line[6:])
        for line in recorded["response"]["body"].splitlines()
        if line.startswith("data: {")
    ]
    return "".join(
        c.get("delta", {}).get("content") or "" for chunk in chunks for c in chunk["choices"]
    )


@dataclass(frozen=True)
class Scenario:
    what: str
    requests: Callable[[httpx.AsyncClient, str], Awaitable[list[dict[str, Any]]]]
    n_ctx: int = 2048
    template: Path | None = None


async def plain(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    user = {"role": "user", "content": "Say hello in five words."}
    return [await exchange(http, url, body([SYSTEM, user], max_tokens=24))]


async def second_turn(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    first = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    one = await exchange(http, url, body(first, max_tokens=16))
    second = [
        *first,
        {"role": "assistant", "content": answer_of(one)},
        {"role": "user", "content": "Name another one."},
    ]
    return [one, await exchange(http, url, body(second, max_tokens=16))]


async def context_full(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    user = {"role": "user", "content": "word " * 400}
    return [await exchange(http, url, body([SYSTEM, user], max_tokens=8))]


def _prefill(name: str, start: str) -> list[dict[str, Any]]:
    return [
        SYSTEM,
        {"role": "user", "content": "Which tool can read a file? Then read notes.txt."},
        {"role": "assistant", "content": f'<tool_call>\n{{"name": "{name}", "arguments": {start}'},
    ]


async def find_tool(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    # SmolLM2 rambles on after a call; a stop string ends it where the call is still whole.
    messages = _prefill("find_tool", '{"query": "read')
    return [await exchange(http, url, body(messages, tools=TOOLS, max_tokens=24, stop=['"']))]


async def call_tool(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    messages = _prefill("call_tool", '{"name": "read_file", "arguments": {"path": "')
    return [await exchange(http, url, body(messages, tools=TOOLS, max_tokens=24, stop=['"']))]


# With these shorter tool descriptions, SmolLM2's greedy output after the call does not match
# the template's format, and llama-server's parser fails in the middle of the stream.
RAMBLING_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t} for k, t in properties.items()},
                "required": list(properties),
            },
        },
    }
    for name, description, properties in [
        (
            "find_tool",
            "Find tools for a task. Returns names, descriptions and argument schemas.",
            {"query": "string"},
        ),
        (
            "call_tool",
            "Call a tool found with find_tool, with its arguments as an object.",
            {"name": "string", "arguments": "object"},
        ),
    ]
]


async def stream_error(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    messages = _prefill("find_tool", '{"query": "')
    return [await exchange(http, url, body(messages, tools=RAMBLING_TOOLS, max_tokens=24))]


async def reasoning_cap(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    user = {"role": "user", "content": "Why is the sky blue?"}
    payload = body(
        [SYSTEM, user],
        max_tokens=40,
        reasoning_budget_tokens=20,
        reasoning_budget_message=BUDGET_MESSAGE,
    )
    return [await exchange(http, url, payload)]


async def reasoning_long(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    user = {"role": "user", "content": "Why is the sky blue?"}
    return [await exchange(http, url, body([SYSTEM, user], max_tokens=40))]


SCENARIOS = {
    "plain": Scenario("a plain streamed answer", plain),
    "second_turn": Scenario("two turns on one slot, the second extending the first", second_turn),
    "context_full": Scenario("a prompt larger than the context (-c 256)", context_full, 256),
    "find_tool": Scenario(
        "a find_tool call (Qwen2.5 template, prefilled <tool_call>)", find_tool, template=QWEN
    ),
    "call_tool": Scenario(
        "a call_tool call (Qwen2.5 template, prefilled <tool_call>)", call_tool, template=QWEN
    ),
    "stream_error": Scenario(
        "an error inside the stream: the tool-call parser fails on output "
        "that does not match the template's format",
        stream_error,
        template=QWEN,
    ),
    "reasoning_cap": Scenario(
        "reasoning with reasoning_budget_tokens 20 (QwQ template)", reasoning_cap, template=QWQ
    ),
    "reasoning_long": Scenario(
        "reasoning with no budget (QwQ template)", reasoning_long, template=QWQ
    ),
}


# Bad servers cannot be had from a healthy one: these are made from the real `plain` recording,
# changed as each one says, in the same format.
def _with(plain: dict[str, Any], **response: Any) -> dict[str, Any]:
    return {"request": plain["request"], "response": {**plain["response"], **response}}


def _events(plain: dict[str, Any]) -> list[str]:
    return [e for e in plain["response"]["body"].split("\n\n") if e]


DERIVED: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "garbage": (
        "an HTML page with status 200 instead of an event stream",
        lambda p: _with(
            p, headers=[["content-type", "text/html"]], body="<html><body>Welcome</body></html>"
        ),
    ),
    "bad_chunk": (
        "the plain answer with its third event's JSON cut short",
        lambda p: _with(
            p, body="\n\n".join([*_events(p)[:2], _events(p)[2][:40], *_events(p)[3:]]) + "\n\n"
        ),
    ),
    "no_done": (
        "the plain answer without its final `data: [DONE]`",
        lambda p: _with(p, body="\n\n".join(_events(p)[:-1]) + "\n\n"),
    ),
    "cut": (
        "the plain answer's first four events, then the connection drops",
        lambda p: _with(p, body="\n\n".join(_events(p)[:4]) + "\n\n", replay={"cut": True}),
    ),
    "error_500_text": (
        "a 500 whose body is plain text, as a proxy in front might send",
        lambda p: _with(
            p, status=500, headers=[["content-type", "text/plain"]], body="upstream crashed"
        ),
    ),
}


def write_derived() -> None:
    plain = json.loads((RECORDINGS / "plain.json").read_text())["exchanges"][0]
    for name, (what, make) in DERIVED.items():
        write(name, what, [make(plain)], made_by_hand=True)


def spec(n_ctx: int, template: Path | None) -> LaunchSpec:
    return LaunchSpec(
        binary=assets.server_path(),
        model=assets.MODEL_PATH,
        n_ctx=n_ctx,
        threads=2,
        chat_template_file=template,
    )


def write(
    name: str, what: str, exchanges: list[dict[str, Any]], *, made_by_hand: bool = False
) -> None:
    if made_by_hand:
        source = f"Made by scripts/record.py from the real recording plain.json: {what}."
    else:
        source = (
            f"Recorded from llama-server ({assets.LLAMA_PACKAGE}) with {assets.MODEL_FILE} on "
            f"the CPU by scripts/record.py: {what}. Model paths are cut to the file name."
        )
    path = RECORDINGS / f"{name}.json"
    path.write_text(json.dumps({"source": source, "exchanges": exchanges}, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


async def record(name: str, scenario: Scenario, logs: Path) -> None:
    async with (
        managed_server(spec(scenario.n_ctx, scenario.template), logs / f"{name}.log") as server,
        httpx.AsyncClient(timeout=120) as http,
    ):
        write(name, scenario.what, await scenario.requests(http, server.url))


async def record_loading(logs: Path) -> None:
    """Ask before the model is loaded: llama-server listens first and answers 503 meanwhile."""
    port = free_port()
    payload = body([SYSTEM, {"role": "user", "content": "Hi"}], max_tokens=4)
    process = (await start_server(spec(2048, None), port, logs / "loading.log")).process
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            for _ in range(2000):
                try:
                    got = await exchange(http, f"http://127.0.0.1:{port}", payload)
                except httpx.TransportError:
                    await trio.sleep(0.001)
                    continue
                if got["response"]["status"] == 503:
                    write("loading_503", "a request sent while the model was loading", [got])
                    return
                break
        print("loading_503: the model loaded before a 503 could be caught", file=sys.stderr)
    finally:
        await stop(process)


async def main_async(names: list[str]) -> None:
    logs = ROOT / ".cache" / "record-logs"
    logs.mkdir(parents=True, exist_ok=True)
    for name in names or [*SCENARIOS, "loading_503"]:
        if name == "loading_503":
            await record_loading(logs)
        else:
            await record(name, SCENARIOS[name], logs)
    if not names or "plain" in names:
        write_derived()


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("names", nargs="*", help=f"of: {', '.join([*SCENARIOS, 'loading_503'])}")
    names = args.parse_args().names
    unknown = set(names) - {*SCENARIOS, "loading_503"}
    if unknown:
        args.error(f"no such scenario: {', '.join(sorted(unknown))}")
    trio.run(main_async, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
