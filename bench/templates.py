"""`just bench templates`: every chat template llama.cpp ships, token-exact history against
history as messages, on the same real server and model.

For each template in llama.cpp's `models/templates` (the source `just setup` builds), one
llama-server (SmolLM2-135M, `--chat-template-file`) holds a scripted conversation through loopd
with `history = "exact"`: three user turns, the first with a find_tool -> call_tool chain (the
model made to call, see tests/support/prefill.py), the session reopened from its log by a new
client after the first. Its figures are the server's own timings.

The same conversation sent as messages is then played on the same server, request by request:
the prompt each request would have, by the server's own /apply-template and /tokenize, against
what the slot would hold (the previous such prompt, then the tokens the model generated). Once
as loopd's messages (`history = "template"`, and what most clients send), once as the very
requests pydantic-ai builds for it (bench/peer_bodies.py, in its own environment: its own
mapping of the history, thinking as `<think>` text, tool-call arguments written again). Same
answers, same tool calls, so the columns differ only by how history is sent.

Per request, the minimum is the tokens of its prompt that the slot did not hold; recomputed is
what the slot held and the request did not find in the cache.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio
from cache import PEER

from loopd.infer import ChatFormat, Client, FormatError, InferError, Timings, slot_tokens
from loopd.server_proc import LaunchSpec, managed_server
from loopd.session.baseline import TOOLS, make_baseline, messages
from loopd.session.records import AssistantRecord, Record, ToolResultRecord, UsageRecord, UserRecord
from loopd.turn.exact import ExactHistory
from support.conversation import SYSTEM, conversation
from support.prefill import prefills

TURNS = ("What do my notes say?", "Thanks. Anything else?", "Say goodbye.")
HERE = Path(__file__).resolve().parent


def _figures(timings: list[Timings]) -> dict[str, Any]:
    processed = minimum = recomputed = 0
    previous: Timings | None = None
    for t in timings:
        held = slot_tokens(previous) if previous else 0
        processed += t.prompt_n
        minimum += max(1, t.prompt_tokens - held)
        recomputed += max(0, held - t.cached)
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


class NotRendered(Exception):
    """The server's template refused a request's messages: a client sending them fails."""


Bodies = list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]
"""For each answer of a conversation, the messages and tools of the request that asked for it."""


def _loopd_messages(records: list[Record]) -> Bodies:
    """What loopd sends with `history = "template"` (and most clients): loopd's messages."""
    baseline = make_baseline(SYSTEM)
    return [
        (messages(baseline, records[:at]), list(TOOLS))
        for at, record in enumerate(records)
        if isinstance(record, AssistantRecord) and record.tokens is not None
    ]


async def _peer_messages(records: list[Record]) -> Bodies:
    """What pydantic-ai sends for the same conversation (bench/peer_bodies.py, in its own
    environment): its messages are its own mapping of the history (thinking as `<think>` text,
    tool-call arguments parsed and written again)."""
    steps: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for record in records:
        if isinstance(record, UserRecord):
            steps.append({"role": "user", "content": record.content})
        elif isinstance(record, AssistantRecord):
            steps.append(
                {
                    "role": "assistant",
                    "content": record.content,
                    "reasoning": record.reasoning_content,
                    "tool_calls": [c.model_dump() for c in record.tool_calls],
                    "asked": record.tokens is not None,  # the answers the figures count
                }
            )
        elif isinstance(record, ToolResultRecord):
            steps.append(
                {
                    "role": "tool",
                    "name": record.name,
                    "content": record.content,
                    "tool_call_id": record.tool_call_id,
                }
            )
    given = json.dumps({"steps": steps, "tools": list(TOOLS)}).encode()
    uv = os.environ.get("UV", "uv")
    done = await trio.run_process(
        [uv, "run", "--quiet", "--with", PEER, "python", str(HERE / "peer_bodies.py")],
        stdin=given,
        capture_stdout=True,
        cwd=HERE.parent,
    )
    return [(b["messages"], b.get("tools", [])) for b in json.loads(done.stdout)]


async def _played(
    url: str, records: list[Record], bodies: Bodies, fmt: ChatFormat | None
) -> list[Timings]:
    """The figures the conversation would have had with these requests, played on the server:
    each request's prompt by the server's own /apply-template and /tokenize, against what the
    slot would hold (the previous prompt, then the tokens the model generated)."""
    make_prefill = prefills(fmt) if fmt and fmt.tool_call else None
    answers = [
        (at, r.tokens, bool(r.tool_calls))
        for at, r in enumerate(records)
        if isinstance(r, AssistantRecord) and r.tokens is not None
    ]
    timings: list[Timings] = []
    slot: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for (at, answer_tokens, calls), (sent, tools) in zip(answers, bodies, strict=True):
            body = {"messages": sent, "tools": tools}
            rendered = (await http.post("/apply-template", json={**body})).json()
            if "prompt" not in rendered:  # the template refuses these messages
                message = str((rendered.get("error") or {}).get("message", rendered))
                raise NotRendered(message.rpartition("Exception: ")[2][:120])
            prompt = rendered["prompt"]
            prefill = make_prefill(records[:at])[0] if make_prefill and calls else ""
            tokens = await _tokenize(http, prompt, special=True)
            cached = min(_shared(slot, tokens), len(tokens) - 1)
            answer = await _tokenize(http, prefill, special=False) if prefill else []
            generated = [*answer, *(t for t in answer_tokens if isinstance(t, int))]
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
        as_messages = (
            await _played(server.url, records, _loopd_messages(records), fmt)
            if sent_tokens
            else None
        )
        row["messages"] = _figures(as_messages) if as_messages else row["exact"]
        if sent_tokens:
            try:
                peer = await _played(server.url, records, await _peer_messages(records), fmt)
                row["peer"] = _figures(peer)
            except NotRendered as e:
                row["peer_failed"] = f"pydantic-ai's requests do not render: {e}"
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
    with_peer = [r for r in ran if "peer" in r]
    not_worse_than_peer = [r for r in with_peer if r["exact"]["ratio"] <= r["peer"]["ratio"]]
    return {
        "templates": len(rows),
        "renders": len(rendered),
        "ran": len(ran),
        "exact_with_nothing_recomputed": len(exact_zero),
        "exact_at_or_below_messages": len(not_worse),
        "peer_ran": len(with_peer),
        "exact_at_or_below_peer": len(not_worse_than_peer),
        "rows": rows,
    }


def _cell(figures: dict[str, Any] | None, *, ran: bool = True) -> str:
    if not ran:
        return "-"
    if not figures or not figures["requests"]:
        return "did not run"
    return f"{figures['recomputed']} / {figures['processed']} / {figures['ratio']:.2f}"


def table(f: dict[str, Any]) -> list[str]:
    lines = [
        (
            f"{f['renders']} of {f['templates']} templates render with tools, and the "
            f"conversation ran on {f['ran']} of them; token-exact history recomputed nothing on "
            f"{f['exact_with_nothing_recomputed']} of those, and processed no more than history "
            f"as messages on {f['exact_at_or_below_messages']}, and no more than pydantic-ai on "
            f"{f.get('exact_at_or_below_peer', 0)} of the {f.get('peer_ran', 0)} it ran on."
        ),
        "",
        (
            "| template | exact: recomputed / processed / processed÷minimum "
            "| as messages: recomputed / processed / processed÷minimum "
            "| pydantic-ai: recomputed / processed / processed÷minimum | note |"
        ),
        "| --- | --- | --- | --- | --- |",
    ]
    lines[1:1] = [
        "",
        (
            "The pydantic-ai column plays the requests pydantic-ai builds for the same "
            "conversation; it needs the token ids of the answers, which only token-exact history "
            "records, so it is blank (-) where loopd sent messages."
        ),
    ]
    for r in f["rows"]:
        if not r["renders"]:
            lines.append(f"| {r['name']} | - | - | - | does not render: {r['why'][:80]} |")
            continue
        note = "; ".join(n for n in (r.get("why"), r.get("failed"), r.get("peer_failed")) if n)
        lines.append(
            f"| {r['name']} | {_cell(r.get('exact'))} | {_cell(r.get('messages'))} "
            f"| {_cell(r.get('peer'), ran='peer' in r or 'peer_failed' in r)} | {note[:140]} |"
        )
    return lines


if __name__ == "__main__":  # PYTHONPATH=tests:bench, as `just bench` sets it
    paths = [Path(a) for a in sys.argv[1:4]]
    print(json.dumps(trio.run(measure, paths[0], paths[1], paths[2]), indent=1))
