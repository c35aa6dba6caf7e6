"""Token-exact history on a real llama-server (SmolLM2-135M on the CPU) under real models' chat
templates: every request finds in the cache all that the slot held, tool calls and a restart
included; the same conversation with history as messages records the template's losses.

SmolLM2 does not call tools on its own, so the first two requests of a turn start the answer
with the opening of a call in the template's own format (`Runtime.prefill`); the model writes
the arguments, loopd parses them, the tools run.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest

from conftest import QWEN_TEMPLATE, QWQ_TEMPLATE, TEMPLATES, StartLlama
from loopd.config import LoopConfig
from loopd.infer import Client, Timings, slot_tokens
from loopd.session.baseline import make_baseline
from loopd.session.records import (
    AssistantRecord,
    CacheLossRecord,
    PromptRecord,
    Record,
    ToolResultRecord,
    TurnEndRecord,
    UsageRecord,
    conversation_problems,
)
from loopd.session.store import Store
from loopd.tools import Registry
from loopd.turn import InferFailed, Runtime, run_turn
from loopd.turn.exact import ExactHistory
from support.conversation import conversation
from support.ports import NoTools

pytestmark = pytest.mark.llama

TEMPLATE_FILES = [
    QWQ_TEMPLATE,
    TEMPLATES / "Qwen-Qwen3-0.6B.jinja",
    TEMPLATES / "openai-gpt-oss-120b.jinja",
    TEMPLATES / "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
    TEMPLATES / "Qwen3.5-4B.jinja",
    TEMPLATES / "GLM-4.6.jinja",
    TEMPLATES / "MiniMax-M2.jinja",
    TEMPLATES / "MiniMax-M3.jinja",
    TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    TEMPLATES / "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
    TEMPLATES / "google-gemma-4-31B-it.jinja",
    TEMPLATES / "LFM2.5-8B-A1B.jinja",
    TEMPLATES / "LFM2.5-Instruct.jinja",  # renders no past call: the model's own stay
]


TURNS = ("What do my notes say?", "Thanks. Anything else?")


@pytest.mark.parametrize("template", TEMPLATE_FILES, ids=lambda p: p.stem)
async def test_exact_history_recomputes_nothing_the_slot_holds(
    llama: StartLlama, tmp_path: Path, template: Path
) -> None:
    server = await llama(n_ctx=4096, template=template)
    records = await conversation(server.url, tmp_path, "exact", TURNS)
    calls = [c.name for r in records if isinstance(r, AssistantRecord) for c in r.tool_calls]
    assert calls[:2] == ["find_tool", "call_tool"]
    # Nothing of the calls' delimiters is left over as content (a list's closing `]`).
    made_to_call = [r for r in records if isinstance(r, AssistantRecord) and r.tool_calls][:2]
    assert [(r.content or "").strip() for r in made_to_call] == ["", ""]
    results = [r for r in records if isinstance(r, ToolResultRecord)]
    assert "buy milk" in results[1].content
    usages = [r.timings for r in records if isinstance(r, UsageRecord)]
    assert len(usages) >= 4
    for previous, new in itertools.pairwise(usages):
        assert previous is not None
        assert new is not None
        assert new.cache_n == slot_tokens(previous)
    assert not [r for r in records if isinstance(r, CacheLossRecord)]
    prompts = [r for r in records if isinstance(r, PromptRecord)]
    assert [p.full for p in prompts] == [True] + [False] * (len(prompts) - 1)


@pytest.mark.parametrize(
    ("template", "opens", "ends"),
    [
        ("mistralai-Mistral-Nemo-Instruct-2407", '[TOOL_CALLS][{"name": "', "]"),
        ("CohereForAI-c4ai-command-r-plus-tool_use", "Action:\n```json\n[\n    {\n", "]```"),
        ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", "<|START_ACTION|>[", "]<|END_ACTION|>"),
        ("Kimi-K2-Instruct", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
        ("GLM-4.7-Flash", "<tool_call>", ""),
        ("google-gemma-4-31B-it", "<|tool_call>call:", ""),
        ("LFM2.5-8B-A1B", "<|tool_call_start|>[", "]<|tool_call_end|>"),
        (
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
            "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>",
            "<\uff5ctool\u2581calls\u2581end\uff5c>",
        ),
    ],
)
async def test_what_opens_and_closes_a_block_of_calls_is_learned(
    llama: StartLlama, template: str, opens: str, ends: str
) -> None:
    """A block of calls ends with what closes it, which is not content; an empty thinking
    block before a call is reasoning, not part of the call's opening. What opens the results
    (GLM's `<|observation|>`, Gemma's `<|tool_response>`) closes nothing: the model stops
    there, and the next request starts with it."""
    server = await llama(n_ctx=4096, template=TEMPLATES / f"{template}.jinja")
    async with Client(server.url) as client:
        fmt = await ExactHistory(client).format(make_baseline("Be brief."), thinking=True)
    assert fmt.tool_call is not None
    assert fmt.tool_call.open.startswith(opens)
    assert fmt.tool_call.block_close == ends


# Templates whose renderings are out of the ordinary: RWKV World always writes its generation
# prompt unless the variable is defined; Phi-3.5 ends a conversation with its eos when no
# answer is asked for; Command R+ writes an instruction after the whole history. They have no
# tool calls loopd can make SmolLM2 write (Command R+'s it writes on its own, and loops), so
# the cache figures are the test.
ODD_RENDERINGS = [
    TEMPLATES / "llama-cpp-rwkv-world.jinja",
    TEMPLATES / "microsoft-Phi-3.5-mini-instruct.jinja",
    TEMPLATES / "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
]


@pytest.mark.parametrize("template", ODD_RENDERINGS, ids=lambda p: p.stem)
async def test_odd_renderings_are_exact_too(
    llama: StartLlama, tmp_path: Path, template: Path
) -> None:
    server = await llama(n_ctx=8192, template=template)
    records = await conversation(
        server.url, tmp_path, "exact", TURNS, make_prefill=None, tolerate=True
    )
    usages = [r.timings for r in records if isinstance(r, UsageRecord) and r.timings]
    assert len(usages) >= 2
    for previous, new in itertools.pairwise(usages):
        assert new.cache_n == slot_tokens(previous)
    assert not [r for r in records if isinstance(r, CacheLossRecord)]
    prompts = [r for r in records if isinstance(r, PromptRecord)]
    assert [p.full for p in prompts] == [True] + [False] * (len(prompts) - 1)


# gpt-oss is left out: as messages, the server parses SmolLM2's output with its harmony parser,
# which fails the stream ("does not match the expected peg-native format").
AS_MESSAGES = [QWQ_TEMPLATE, TEMPLATE_FILES[1], TEMPLATE_FILES[3]]


@pytest.mark.parametrize("template", AS_MESSAGES, ids=lambda p: p.stem)
async def test_history_as_messages_records_every_loss_exactly(
    llama: StartLlama, tmp_path: Path, template: Path
) -> None:
    """`history = "template"`: whatever the template drops or re-renders is recomputed, and
    every request that finds less than the slot held is followed by a `cache_loss` saying
    exactly how much; no request loses silently."""
    server = await llama(n_ctx=4096, template=template)
    records = await conversation(server.url, tmp_path, "template", TURNS, make_prefill=None)
    usages: list[Timings] = []
    for at, record in enumerate(records):
        if not isinstance(record, UsageRecord):
            continue
        assert record.timings is not None
        loss = records[at + 1] if at + 1 < len(records) else None
        if usages and record.timings.cached < slot_tokens(usages[-1]):
            assert isinstance(loss, CacheLossRecord)
            assert loss.expected == slot_tokens(usages[-1])
            assert loss.cached == record.timings.cache_n
        else:
            assert not isinstance(loss, CacheLossRecord)
        usages.append(record.timings)
    if template == QWQ_TEMPLATE:  # it drops past reasoning at every request
        assert any(isinstance(r, CacheLossRecord) for r in records)


async def test_a_call_the_server_cannot_parse_fails_the_turn_and_leaves_a_valid_log(
    llama: StartLlama, tmp_path: Path
) -> None:
    """History as messages: llama-server parses tool calls, and answers HTTP 500 mid-stream
    when the model's arguments are not JSON (here the model rambles inside the string). The
    turn ends as an error with the server's words; nothing of the failed answer is logged."""
    server = await llama(n_ctx=4096, template=QWQ_TEMPLATE)
    with pytest.raises(BaseExceptionGroup) as failed:  # from the tool port's nursery
        await conversation(server.url, tmp_path, "template", TURNS)
    assert failed.group_contains(InferFailed, match="Failed to parse tool call arguments")
    store = Store(tmp_path / "sessions")
    _, records, _ = store.read(store.latest() or "")
    assert isinstance(records[-1], TurnEndRecord)
    assert records[-1].reason == "error"
    assert conversation_problems(records) == []
    assert not any(
        "best tools" in (r.content or "") for r in records if isinstance(r, AssistantRecord)
    )


def without_tools(
    client: Client, max_tokens: int, sampling: dict[str, Any], exact: ExactHistory | None
) -> Runtime:
    registry = Registry()
    return Runtime(
        loop=LoopConfig(max_tokens=max_tokens),
        inference=client,
        port=NoTools(),
        registry=registry,
        sampling=sampling,
        exact=exact,
    )


async def sampled_turns(
    url: str, home: Path, history: Literal["exact", "template"]
) -> tuple[list[Record], list[bool]]:
    """Three turns sampled hot, so answers hold token sequences the tokenizer would not
    write (" Par" "is" for " Paris"); and, for each answer, whether its tokens are canonical."""
    async with Client(url) as client, httpx.AsyncClient(base_url=url) as http:
        hot = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 3}
        rt = without_tools(client, 30, hot, ExactHistory(client) if history == "exact" else None)
        with await Store(home).create(make_baseline("Be brief.")) as session:
            for user in ("Name a colour.", "Another one?", "A fruit?"):
                await run_turn(session, rt, user, lambda _: None)
            records = list(session.records)
        canonical = []
        for answer in (r for r in records if isinstance(r, AssistantRecord) and r.tokens):
            ids = [t for t in answer.tokens or () if isinstance(t, int)]
            text = (await http.post("/detokenize", json={"tokens": ids})).json()["content"]
            again = await http.post("/tokenize", json={"content": text, "parse_special": True})
            canonical.append(again.json()["tokens"] == ids)
    return records, canonical


async def test_an_answer_that_does_not_tokenize_back_costs_nothing(
    llama: StartLlama, tmp_path: Path
) -> None:
    """The GPU case, on the CPU: what the model generated is not what its text tokenizes to.
    Sent back as text it is recomputed from there; sent back as tokens, nothing is."""
    server = await llama(n_ctx=4096, template=QWEN_TEMPLATE)
    records, canonical = await sampled_turns(server.url, tmp_path / "exact", "exact")
    assert False in canonical  # the case is really there
    usages = [r.timings for r in records if isinstance(r, UsageRecord) and r.timings]
    assert len(usages) == 3
    for previous, new in itertools.pairwise(usages):
        assert new.cache_n == slot_tokens(previous)

    records, _ = await sampled_turns(server.url, tmp_path / "template", "template")
    assert [r for r in records if isinstance(r, CacheLossRecord)]


async def test_a_date_in_the_template_is_the_one_the_session_started_with(
    llama: StartLlama, tmp_path: Path
) -> None:
    """Llama 3.1's template writes today's date into the system prompt. The prompt is rebuilt
    from the log, never rendered again: a session begun on another day keeps that day, and
    every request after the first one on it extends the one before."""
    server = await llama(n_ctx=4096, template=TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja")
    store = Store(tmp_path)
    async with Client(server.url) as client:
        rt = without_tools(client, 16, {"temperature": 0, "seed": 1}, ExactHistory(client))
        with await store.create(make_baseline("Be brief.")) as session:
            await run_turn(session, rt, "Name a colour.", lambda _: None)
        first = next(r for r in session.records if isinstance(r, PromptRecord))
        today = re.search(r"Today Date: (\d\d \w\w\w \d{4})", first.text)
        assert today is not None
        # The same log, as if its first request had been made on another day.
        path = store.path_of(session.id)
        path.write_text(path.read_text().replace(today.group(1), "01 Jan 2020"))
        with await store.open(session.id) as session:
            for user in ("Another one?", "And a fruit?"):
                await run_turn(session, rt, user, lambda _: None)
            records = list(session.records)
    prompts = [r for r in records if isinstance(r, PromptRecord)]
    assert [p.full for p in prompts] == [True, False, False]
    assert "Today Date: 01 Jan 2020" in prompts[0].text
    usages = [r.timings for r in records if isinstance(r, UsageRecord) and r.timings]
    # The slot held today's date, the log says 2020: the second request starts over from
    # there; the third extends the second exactly.
    assert usages[2].cache_n == slot_tokens(usages[1])
