"""`just bench fork`: time to first token of a fork's first turn, against the same conversation
sent to llama-server as a new prompt, and the tokens the fork computed.

For each size, one llama-server (SmolLM2-135M, whose 8,192-token training context is the most
llama-server gives a slot) with three slots; loopd lends two of them (`[server] slots`), the
third is the baseline's. A session's first message is a document of that many tokens. Then, in
pairs, alternating which goes first: a fork of that session at turn 1 and a question in it,
through `loopd serve` and the socket (its time to the first content event), and the very
request body loopd sends for that question, built beforehand from the session's log, sent
straight to `/completion` on the third slot with `cache_prompt: false` (the whole conversation
computed, as for a new prompt). The first fork takes over the session's hot slot; the later
ones find it taken by the first and restore the session's slot file into a slot. What a fork
computes at the least is its new message: the request's tokens less those the session's slot
held after its turn.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import httpx
from history import first_content, loopds_request, patient_daemon, read_document, through_loopd

from loopd.infer import Client, slot_tokens
from loopd.server_proc import LaunchSpec, managed_server
from loopd.session.records import UsageRecord
from loopd.session.store import Store
from loopd.turn.exact import ExactHistory
from support.daemon import LineClient

# The largest fits SmolLM2's 8,192 tokens with loopd's system prompt, the question and the
# answer; 8,000 does not.
SIZES = (2_000, 7_000)
PAIRS = 3
"""The first fork is served from the hot slot, the later ones from the slot file."""
BASELINE_SLOT = 2
RESTORED = "restored the slot of session {parent} for its fork {fork}"


async def _fork(client: LineClient, parent: str) -> str:
    await client.send({"type": "fork_session", "session": parent, "at": 1})
    welcome = (await client.until("welcome"))[-1]
    fork: str = welcome["session"]
    return fork


def _last_usage(store: Store, session: str) -> UsageRecord:
    return [r for r in store.read(session)[1] if isinstance(r, UsageRecord)][-1]


async def _size(binary: Path, model: Path, tokens: int, tmp: Path) -> dict[str, Any]:
    spec = LaunchSpec(
        binary=binary,
        model=model,
        n_ctx=8192,
        parallel=BASELINE_SLOT + 1,
        threads=2,
        slot_save_path=tmp / f"slots-{tokens}",
    )
    spec.slot_save_path.mkdir()  # type: ignore[union-attr]
    async with managed_server(spec, tmp / f"llama-{tokens}.log") as server:
        d = patient_daemon(tmp / f"loopd-{tokens}", server.url, f"slots = {BASELINE_SLOT}\n")
        await d.start()
        rows = []
        try:
            client = await d.connect()
            await read_document(client, tokens)
            store = Store(d.home / "sessions")
            parent = store.latest() or ""
            header, records, _ = store.read(parent)
            held = slot_tokens(_last_usage(store, parent).timings)  # type: ignore[arg-type]
            async with (
                httpx.AsyncClient(base_url=server.url, timeout=3600) as http,
                Client(server.url) as llama,
            ):
                exact = ExactHistory(llama)
                for pair in range(PAIRS):
                    turn = f"f{pair}"
                    # The very prompt loopd sends for the fork's question, built beforehand.
                    question = f"Question {turn}: and now?"
                    same, _, _ = await loopds_request(exact, header.baseline, records, question)
                    body = json.loads(same)
                    body |= {"cache_prompt": False, "id_slot": BASELINE_SLOT}
                    row: dict[str, Any] = {}
                    order = ("loopd", "direct") if pair % 2 == 0 else ("direct", "loopd")
                    for who in order:
                        if who == "loopd":
                            fork = await _fork(client, parent)
                            row["loopd_ms"] = 1000 * await through_loopd(client, turn)
                            timings = _last_usage(store, fork).timings
                            if timings is None:
                                raise RuntimeError("the fork's request has no timings")
                            row["prompt_n"], row["cache_n"] = timings.prompt_n, timings.cache_n
                            row["minimum"] = timings.prompt_tokens - held
                            restored = RESTORED.format(parent=parent, fork=fork)
                            row["from"] = "file" if restored in d.log.read_text() else "hot slot"
                        else:
                            took, timings_ = await first_content(
                                http, "/completion", json.dumps(body).encode()
                            )
                            row["direct_ms"] = 1000 * took
                            row["direct_prompt_n"] = timings_.get("prompt_n", 0)
                    row["ratio"] = row["loopd_ms"] / row["direct_ms"]
                    rows.append(row)
        finally:
            await d.kill()
            await d.close_clients()
    return {"tokens": held, "pairs": rows}


async def measure(binary: Path, model: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        sizes = [await _size(binary, model, tokens, Path(tmp)) for tokens in SIZES]
    return {"sizes": sizes}


def table(f: dict[str, Any]) -> list[str]:
    lines = [
        (
            "| history (tokens) | fork served from | fork's first token | new prompt (no cache) "
            "| ratio | fork computed (prompt_n / cache_n) | its new message | new prompt computed |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for size in f["sizes"]:
        hot = [r for r in size["pairs"] if r["from"] == "hot slot"]
        restored = [r for r in size["pairs"] if r["from"] == "file"]
        for label, rows in (("hot slot", hot), ("slot file", restored)):
            if not rows:
                continue
            median = {k: statistics.median(r[k] for r in rows) for k in _FIGURES}
            lines.append(
                f"| {size['tokens']:,} | {label} ({len(rows)}) | {median['loopd_ms']:.0f} ms "
                f"| {median['direct_ms']:.0f} ms | {median['ratio']:.2f}x "
                f"| {median['prompt_n']:.0f} / {median['cache_n']:,.0f} "
                f"| {median['minimum']:.0f} | {median['direct_prompt_n']:,.0f} |"
            )
    return lines


_FIGURES = ("loopd_ms", "direct_ms", "ratio", "prompt_n", "cache_n", "minimum", "direct_prompt_n")
