"""loopd on a real vLLM (the CPU build, SmolLM2-135M): found from `[server] url` alone,
token-exact on the model's own template and on one that drops past reasoning, its cache
figures at vLLM's block-grained limit on every request, a loopd restart between turns, two
sessions at once, and vLLM itself killed and started again mid-session. Against the same
conversation sent as messages to vLLM's chat endpoint, side by side."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from loopd.infer import Timings, cache_limit
from loopd.session.records import (
    AssistantRecord,
    CacheLossRecord,
    PromptRecord,
    UsageRecord,
    conversation_problems,
)
from support.daemon import Daemon, LineClient
from support.fake_engine import fake_engine
from support.vllm import EAGER, RunningVllm, start_vllm
from test_sessions import records, welcome

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = Path(os.environ.get("LOOPD_TEMPLATES") or ROOT / ".cache/llama-templates")
# QwQ's template drops the reasoning of every earlier answer when it renders messages.
DROPS_REASONING = "Qwen-QwQ-32B.jinja"
LONG = "Here are my notes from the meeting. " + " ".join(
    f"Point {n}: the team agreed to look at item {n} again next week." for n in range(40)
)
QUESTIONS = [LONG + " Summarise them in one line.", "Name a colour.", "Name a fruit.", "Thanks."]
MAX_TOKENS = 24
TURN_TIMEOUT = 300


def on_vllm(home: Path, url: str, *, loop: str = "") -> Daemon:
    """A loopd whose only server line is `url`: the engine is found from the server."""
    d = Daemon(home, url, history="exact")
    text = d.config.read_text().replace(
        f'url = "{url}"\n', f'url = "{url}"\nsampling = {{ temperature = 0 }}\n'
    )
    d.config.write_text(text + f"[loop]\nmax_tokens = {MAX_TOKENS}\n{loop}")
    return d


def usages(d: Daemon, session: str) -> list[Timings]:
    return [r.timings for r in records(d, session) if isinstance(r, UsageRecord) and r.timings]


def assert_at_the_block_limit(d: Daemon, session: str) -> None:
    """Every request found in vLLM's cache all the blocks the one before filled, and the log
    is a valid conversation with no loss recorded."""
    log = records(d, session)
    assert conversation_problems(log) == []
    assert not [r for r in log if isinstance(r, CacheLossRecord)]
    figures = usages(d, session)
    assert len(figures) >= 2
    for before, after in itertools.pairwise(figures):
        assert after.block == 32
        assert after.cache_n == cache_limit(before, after), (before, after)


def assert_prompts_extend(d: Daemon, session: str, sent: list[Any]) -> None:
    """Each request's prompt, as vLLM received it (`sent`: the bodies of `/v1/completions`),
    is the previous one and the tokens of its answer, token for token, and more."""
    log = records(d, session)
    prompts = [r for r in log if isinstance(r, PromptRecord)]
    answers = [r for r in log if isinstance(r, AssistantRecord)]
    assert len(sent) == len(prompts) == len(answers) >= 2
    for n in range(len(sent) - 1):
        tokens = list(answers[n].tokens or ())
        assert tokens, "an answer without its token ids"
        assert all(isinstance(t, int) for t in tokens)  # vLLM names every token
        kept = sent[n]["prompt"] + tokens[: len(tokens) - prompts[n + 1].trim]
        assert sent[n + 1]["prompt"][: len(kept)] == kept, f"request {n + 2} does not extend"
        assert len(sent[n + 1]["prompt"]) > len(kept)


async def conversation(d: Daemon, questions: list[str], *, restart_after: int | None = None) -> str:
    client = await d.connect()
    session = await welcome(client, {"type": "hello", "session": "new"})
    for n, text in enumerate(questions):
        if n == restart_after:
            await d.stop()
            await d.close_clients()
            await d.start()
            client = await d.connect()
            await welcome(client, {"type": "hello", "session": session})
        lines = await client.turn(f"t{n}", text, timeout=TURN_TIMEOUT)
        assert lines[-1]["type"] == "turn_done", lines[-1]
    return session


async def status(client: LineClient) -> dict[str, Any]:
    await client.send({"type": "status"})
    return (await client.until("status"))[-1]


async def test_a_conversation_with_a_restart_is_token_exact_at_the_block_limit(
    vllm_server: RunningVllm, tmp_path: Path
) -> None:
    with fake_engine({}, upstream=vllm_server.url) as recorder:  # what vLLM receives
        d = on_vllm(tmp_path / "loopd", recorder.url)
        await d.start()
        try:
            session = await conversation(d, QUESTIONS, restart_after=2)
            seen = await status(d.clients[-1])
        finally:
            await d.end()
    assert seen["engine"] == "vllm"
    assert (seen["model"], seen["context_size"]) == (vllm_server.model, 4096)
    assert "vLLM server at" in d.log.read_text()  # found, not named
    assert_at_the_block_limit(d, session)
    assert_prompts_extend(d, session, recorder.bodies("/v1/completions"))


async def test_two_sessions_at_once_each_extend_their_own_prompts(
    vllm_server: RunningVllm, tmp_path: Path
) -> None:
    d = on_vllm(tmp_path / "loopd", vllm_server.url)
    await d.start()
    try:
        sessions: list[str] = []

        async def one(n: int) -> None:
            sessions.append(await conversation(d, [f"Say the word {n}.", "Again, please."]))

        async with trio.open_nursery() as nursery:
            for n in range(2):
                nursery.start_soon(one, n)
    finally:
        await d.end()
    assert len(set(sessions)) == 2
    for session in sessions:
        assert_at_the_block_limit(d, session)


def chat_endpoint(server: RunningVllm, questions: list[str]) -> list[int]:
    """The conversation as a client of the chat endpoint sends it: its whole history as
    messages, each answer sent back as the content it got; the tokens each request had to
    compute anew (`prompt_tokens - cached_tokens`)."""
    messages: list[dict[str, Any]] = []
    processed = []
    for text in questions:
        messages.append({"role": "user", "content": text})
        body = {
            "model": server.model,
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300).json()
        usage = answer["usage"]
        processed.append(usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"])
        messages.append(
            {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}
        )
    return processed


@pytest.fixture(scope="module")
def reasoning_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningVllm]:
    """A second vLLM, serving SmolLM2 with a template that drops past reasoning and writes
    loopd's tools into the prompt (calls in Hermes' `<tool_call>` syntax), started with no
    tool-call parser at all."""
    template = TEMPLATES / DROPS_REASONING
    assert template.is_file(), f"{template} is missing: run `just test` (it fetches them)"
    # No tool-call parser: loopd reads the model's calls itself.
    with start_vllm(
        tmp_path_factory.mktemp("vllm-qwq"), chat_template=template, extra_args=EAGER
    ) as server:
        yield server


async def test_on_a_template_that_drops_past_reasoning_loopd_recomputes_nothing(
    reasoning_vllm: RunningVllm, tmp_path: Path
) -> None:
    """The chat endpoint's client loses what the template drops at every request; loopd,
    sending the tokens the model generated, loses nothing. Processed tokens side by side."""
    with fake_engine({}, upstream=reasoning_vllm.url) as recorder:  # what vLLM receives
        d = on_vllm(tmp_path / "loopd", recorder.url)
        await d.start()
        try:
            session = await conversation(d, QUESTIONS[1:])
        finally:
            await d.end()
    assert_at_the_block_limit(d, session)
    sent = recorder.bodies("/v1/completions")
    assert_prompts_extend(d, session, sent)
    # loopd's tools are in the prompt, and a call of one is constrained once it opens; the
    # vLLM has no parser of calls, and needs none.
    rendered = [b for b in recorder.bodies("/tokenize") if "messages" in b]
    assert any(t["function"]["name"] == "find_tool" for b in rendered for t in b.get("tools", []))
    tags = [json.loads(b["structured_outputs"]["structural_tag"]) for b in sent]
    assert all(t["format"]["triggers"] == ['<tool_call>\n{"name": "'] for t in tags)
    answers = [r for r in records(d, session) if isinstance(r, AssistantRecord)]
    assert any(a.reasoning_content for a in answers)  # the template opens the reasoning
    loopd = [t.prompt_n for t in usages(d, session)]
    direct = chat_endpoint(reasoning_vllm, QUESTIONS[1:])
    assert sum(loopd[1:]) < sum(direct[1:])


async def test_vllms_chat_endpoint_as_an_openai_server_with_loopds_tools(
    vllm_server: RunningVllm, tmp_path: Path
) -> None:
    """`engine = "openai"`: history as messages, loopd's tools offered, vLLM's own parser
    reading the calls (`CHAT_TOOLS`); its cache figures read from `usage`."""
    d = on_vllm(tmp_path / "loopd", vllm_server.url)
    d.config.write_text(
        d.config.read_text().replace("sampling = ", 'engine = "openai"\nsampling = ', 1)
    )
    await d.start()
    try:
        session = await conversation(d, ["Name a colour.", "Name a fruit."])
        seen = await status(d.clients[-1])
    finally:
        await d.end()
    assert seen["engine"] == "openai"
    log = records(d, session)
    assert conversation_problems(log) == []
    assert all(r.tokens is None for r in log if isinstance(r, AssistantRecord))  # as messages
    figures = usages(d, session)
    assert len(figures) == 2
    assert all(t.cache_n is not None for t in figures)  # vLLM reports `cached_tokens`
    assert figures[1].cache_n  # the second request found the first's prefix


async def test_vllm_killed_and_started_again_the_turn_waits_and_the_loss_names_why(
    tmp_path: Path,
) -> None:
    with start_vllm(tmp_path / "vllm", extra_args=EAGER) as first:
        d = on_vllm(tmp_path / "loopd", first.url, loop=f"turn_timeout = {TURN_TIMEOUT * 2}\n")
        await d.start()
        client = await d.connect()
        session = await welcome(client, {"type": "hello", "session": "new"})
        assert (await client.turn("t1", "Name a colour.", timeout=TURN_TIMEOUT))[-1]["type"] == (
            "turn_done"
        )
        port = first.port
    try:
        await client.send({"type": "send", "id": "t2", "content": "Name a fruit."})
        lines = await client.until("event", timeout=60)  # the server is gone: it waits
        while lines[-1]["event"]["kind"] != "waiting_for_server":
            lines = await client.until("event", timeout=60)
        with start_vllm(tmp_path / "vllm", extra_args=EAGER, port=port):
            lines = await client.until("turn_done", timeout=TURN_TIMEOUT * 2)
            assert lines[-1]["id"] == "t2"
            third = await client.turn("t3", "Name a tree.", timeout=TURN_TIMEOUT)
            assert third[-1]["type"] == "turn_done"
    finally:
        await d.end()
    log = records(d, session)
    assert conversation_problems(log) == []
    lost = [r for r in log if isinstance(r, CacheLossRecord)]
    assert len(lost) == 1  # the turn after the restart; the next one extends it again
    assert lost[0].reason is not None
    assert "keeps no cache" in lost[0].reason
    figures = usages(d, session)
    assert figures[-1].cache_n == cache_limit(figures[-2], figures[-1])
