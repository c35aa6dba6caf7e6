"""`just bench templates`: every chat template llama.cpp ships, token-exact history against
history as messages, on the same real server and model.

For each template in llama.cpp's `models/templates` (the source `just setup` builds), one
llama-server (SmolLM2-135M, `--chat-template-file`) holds a scripted conversation through loopd
with `history = "exact"`: three user turns, the first with a find_tool -> call_tool chain (the
model made to call, see tests/support/prefill.py), the session reopened from its log by a new
client after the first. Its figures are the server's own timings.

The same conversation sent as messages (what pydantic-ai and other clients send, and loopd's
`history = "template"`) is then played on the same server, request by request: the prompt
each request would have, by the server's own /apply-template and /tokenize, against what the
slot would hold (the previous such prompt, then the tokens the model generated). Same answers,
same tool calls, so the two columns differ only by how history is sent.

Per request, the minimum is the tokens of its prompt that the slot did not hold; recomputed is
what the slot held and the request did not find in the cache.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio

from loopd.baseline import TOOLS, make_baseline, messages
from loopd.exact import ExactHistory
from loopd.infer import ChatFormat, Client, FormatError, InferError, Timings, slot_tokens
from loopd.records import AssistantRecord, Record, UsageRecord
from loopd.server_proc import LaunchSpec, managed_server
from support.conversation import SYSTEM, conversation
from support.prefill import prefills

TURNS = ("What do my notes say?", "Thanks. Anything else?", "Say goodbye.")


def _figures(timings: list[Timings]) -> dict[str, Any]:
    processed = minimum = recomputed = 0
    previous: Timings | None = None
    for t in timings:
        held = slot_tokens(previous) if previous else 0
        processed += t.prompt_n
        minimum += max(1, t.cache_n + t.prompt_n - held)
        recomputed += max(0, held - t.cache_n)
        previous = t
    return {
        "requests": len(timings),
        "processed": processed,
        "minimum": minimum,
        "recomputed": recomputed,
        "ratio": processed / minimum if minimum else 0.0,
    }


def _used(records: list[Record]) -> list[Timings]:
    return [r.timings for r in records if isinstance(r, UsageRecord) and r.timings]


async def _as_messages(url: str, records: list[Record], fmt: ChatFormat | None) -> list[Timings]:
    """The figures the same conversation would have had with history sent as messages."""
    baseline = make_baseline(SYSTEM)
    make_prefill = prefills(fmt) if fmt and fmt.tool_call else None
    timings: list[Timings] = []
    slot: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for at, record in enumerate(records):
            if not isinstance(record, AssistantRecord) or record.tokens is None:
                continue
            body = {"messages": messages(baseline, records[:at]), "tools": list(TOOLS)}
            prompt = (await http.post("/apply-template", json=body)).json()["prompt"]
            prefill = make_prefill(records[:at])[0] if make_prefill and record.tool_calls else ""
            tokens = await _tokenize(http, prompt, special=True)
            cached = min(_shared(slot, tokens), len(tokens) - 1)
            answer = await _tokenize(http, prefill, special=False) if prefill else []
            generated = [*answer, *(t for t in record.tokens if isinstance(t, int))]
            timings.append(
                Timings(
                    cache_n=cached,
                    prompt_n=len(tokens) - cached,
                    prompt_ms=0,
                    predicted_n=len(generated),
                    predicted_ms=0,
                )
            )
            slot = tokens + generated[:-1]
    return timings


async def _tokenize(http: httpx.AsyncClient, text: str, *, special: bool) -> list[int]:
    body = {"content": text, "add_special": special, "parse_special": True}
    tokens: list[int] = (await http.post("/tokenize", json=body)).json()["tokens"]
    return tokens


def _shared(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


async def _one(binary: Path, model: Path, template: Path, tmp: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"name": template.stem}
    fmt: ChatFormat | None = None
    spec = LaunchSpec(
        binary=binary, model=model, n_ctx=4096, threads=2, chat_template_file=template
    )
    async with managed_server(spec, tmp / f"{template.stem}.log") as server:
        async with Client(server.url) as client:
            try:
                await client.apply_template(
                    [{"role": "user", "content": "Hello."}], list(TOOLS), add_generation_prompt=True
                )
            except InferError as e:
                return {**row, "renders": False, "why": str(e)[:200]}
            try:
                fmt = await ExactHistory(client).format(make_baseline(SYSTEM), thinking=True)
            except FormatError as e:
                row["why"] = f"history goes as messages: {e}"
        row["renders"] = True
        try:
            records = await conversation(
                server.url, tmp / row["name"], "exact", TURNS, tolerate=True
            )
        except (FormatError, InferError) as e:
            return {**row, "failed": str(e)[:200]}
        row["exact"] = _figures(_used(records))
        sent_tokens = any(isinstance(r, AssistantRecord) and r.tokens for r in records)
        # A template loopd cannot make exact got messages already: the same figures.
        as_messages = await _as_messages(server.url, records, fmt) if sent_tokens else None
        row["messages"] = _figures(as_messages) if as_messages else row["exact"]
    return row


async def measure(binary: Path, model: Path, templates: Path) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for template in sorted(templates.glob("*.jinja")):  # noqa: ASYNC240 - a listing, once
            print(f"  {template.stem}", file=sys.stderr)
            rows.append(await _one(binary, model, template, Path(tmp)))
    rendered = [r for r in rows if r["renders"]]
    ran = [r for r in rendered if r.get("exact", {}).get("requests")]
    exact_zero = [r for r in ran if r["exact"]["recomputed"] == 0]
    not_worse = [r for r in ran if r["exact"]["ratio"] <= r["messages"]["ratio"]]
    return {
        "templates": len(rows),
        "renders": len(rendered),
        "ran": len(ran),
        "exact_with_nothing_recomputed": len(exact_zero),
        "exact_at_or_below_messages": len(not_worse),
        "rows": rows,
    }


def _cell(figures: dict[str, Any] | None) -> str:
    if not figures or not figures["requests"]:
        return "did not run"
    return f"{figures['recomputed']} / {figures['processed']} / {figures['ratio']:.2f}"


def table(f: dict[str, Any]) -> list[str]:
    lines = [
        (
            f"{f['renders']} of {f['templates']} templates render with tools, and the "
            f"conversation ran on {f['ran']} of them; token-exact history recomputed nothing on "
            f"{f['exact_with_nothing_recomputed']} of those, and processed no more than history "
            f"as messages on {f['exact_at_or_below_messages']}."
        ),
        "",
        (
            "| template | exact: recomputed / processed / processed÷minimum "
            "| as messages: recomputed / processed / processed÷minimum | note |"
        ),
        "| --- | --- | --- | --- |",
    ]
    for r in f["rows"]:
        if not r["renders"]:
            lines.append(f"| {r['name']} | - | - | does not render: {r['why'][:80]} |")
            continue
        note = r.get("why", "") or r.get("failed", "")
        lines.append(
            f"| {r['name']} | {_cell(r.get('exact'))} | {_cell(r.get('messages'))} | {note[:100]} |"
        )
    return lines


if __name__ == "__main__":  # PYTHONPATH=tests:bench, as `just bench` sets it
    paths = [Path(a) for a in sys.argv[1:4]]
    print(json.dumps(trio.run(measure, paths[0], paths[1], paths[2]), indent=1))
