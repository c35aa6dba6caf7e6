"""Turns against a real llama-server (SmolLM2-135M on the CPU): the cache across turns and a
restart, a real cache loss caught in both directions, and the thinking cap."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from conftest import QWQ_TEMPLATE, StartLlama
from loopd.config import LoopConfig
from loopd.infer import (
    THINKING_CAP_GRACE,
    Client,
    Progress,
    Repeating,
    ThinkingCapped,
    slot_tokens,
)
from loopd.session.baseline import make_baseline
from loopd.session.records import AssistantRecord, CacheLossRecord, UsageRecord
from loopd.session.store import Store
from loopd.tools import Registry
from loopd.turn import Runtime, TurnLimit, run_turn
from loopd.turn.exact import ExactHistory
from loopd.wire.events import CacheLoss, TurnEvent
from support.ports import NoTools

pytestmark = pytest.mark.llama

LOOPING = "Write the word hello, over and over."
"""SmolLM2 at temperature 0 writes "hello, " until `max_tokens` for this."""
USERS = ["Name a colour.", "Name a fruit.", "Name an animal.", "Name a city."]


async def four_turns(url: str, directory: Path, loop: LoopConfig) -> tuple[list, list[TurnEvent]]:  # type: ignore[type-arg]
    """Four turns, the session closed and reopened from its log after the second."""
    store = Store(directory)
    events: list[TurnEvent] = []
    registry = Registry()
    async with Client(url) as client:
        rt = Runtime(loop=loop, inference=client, registry=registry,
                     port=NoTools(),
                     sampling={"temperature": 0, "seed": 1})  # fmt: skip
        session = await store.create(make_baseline("You are a helpful assistant. Be brief."))
        for number, user in enumerate(USERS, start=1):
            await run_turn(session, rt, user, events.append)
            if number == 2:
                session.close()
                session = await store.open(session.id)
        records = list(session.records)
        session.close()
    return records, events


async def test_four_turns_and_a_restart_keep_the_whole_cache(
    llama: StartLlama, tmp_path: Path
) -> None:
    server = await llama()
    records, events = await four_turns(server.url, tmp_path, LoopConfig(max_tokens=24))
    usages = [r.timings for r in records if isinstance(r, UsageRecord)]
    assert len(usages) == 4
    assert all(t is not None for t in usages)
    for previous, new in itertools.pairwise(usages):
        assert previous is not None
        assert new is not None
        assert new.cache_n == slot_tokens(previous)
    assert not [r for r in records if isinstance(r, CacheLossRecord)]
    assert not [e for e in events if isinstance(e, CacheLoss)]


async def test_a_template_that_drops_reasoning_records_a_loss_each_turn(
    llama: StartLlama, tmp_path: Path
) -> None:
    server = await llama(template=QWQ_TEMPLATE)
    records, events = await four_turns(server.url, tmp_path, LoopConfig(max_tokens=24))
    usages = [r.timings for r in records if isinstance(r, UsageRecord)]
    losses = [r for r in records if isinstance(r, CacheLossRecord)]
    assert len(losses) == 3  # at each new user turn after the first
    for (previous, new), loss in zip(itertools.pairwise(usages), losses, strict=True):
        assert previous is not None
        assert new is not None
        assert loss.expected == slot_tokens(previous)
        assert loss.cached == new.cache_n
        assert loss.cached < loss.expected
    assert [(e.expected, e.cached) for e in events if isinstance(e, CacheLoss)] == [
        (loss.expected, loss.cached) for loss in losses
    ]


async def one_turn(
    url: str, directory: Path, loop: LoopConfig, user: str
) -> tuple[UsageRecord, list[TurnEvent]]:
    events: list[TurnEvent] = []
    registry = Registry()
    async with Client(url) as client:
        rt = Runtime(
            loop=loop,
            inference=client,
            registry=registry,
            port=NoTools(),
            sampling={"temperature": 0, "seed": 1},
        )
        with await Store(directory).create(
            make_baseline("You are a helpful assistant.")
        ) as session:
            await run_turn(session, rt, user, events.append)
            usage = session.last_usage()
    assert usage is not None
    return usage, events


async def test_the_thinking_cap_on_a_real_server(llama: StartLlama, tmp_path: Path) -> None:
    server = await llama(template=QWQ_TEMPLATE)
    question = "Why is the sky blue?"
    free, _ = await one_turn(server.url, tmp_path, LoopConfig(max_tokens=60), question)
    capped, events = await one_turn(
        server.url, tmp_path, LoopConfig(max_tokens=60, thinking_cap=20), question
    )
    assert free.reasoning_tokens > 20 + THINKING_CAP_GRACE  # left alone, it thinks on
    assert not free.thinking_capped
    assert capped.thinking_capped
    assert capped.reasoning_tokens < free.reasoning_tokens
    assert ThinkingCapped(cap=20) in events


async def test_an_answer_caught_in_a_loop_is_cut_and_the_session_goes_on_cached(
    llama: StartLlama, tmp_path: Path
) -> None:
    """At temperature 0 SmolLM2 writes "hello" until `max_tokens` for `LOOPING`: loopd cuts it
    after `repetition_cap` characters, and the next turn finds the cut answer in the cache."""
    server = await llama()
    events: list[TurnEvent] = []
    async with Client(server.url) as client:
        rt = Runtime(
            loop=LoopConfig(repetition_cap=600),
            inference=client,
            registry=Registry(),
            port=NoTools(),
            sampling={"temperature": 0},
            exact=ExactHistory(client),
        )
        system = make_baseline("You are a helpful assistant.")
        with await Store(tmp_path).create(system) as session:
            with pytest.raises(TurnLimit, match="over and over for 600 characters"):
                await run_turn(session, rt, LOOPING, events.append)
            await run_turn(session, rt, "Thanks.", events.append)
            records = list(session.records)
    cut = next(r for r in records if isinstance(r, AssistantRecord))
    assert cut.content is not None
    assert 600 <= len(cut.content) < 1000  # 8,192 tokens without the cap
    assert cut.tokens is not None
    assert len([e for e in events if isinstance(e, Repeating)]) == 1
    first_prompt = next(e.total for e in events if isinstance(e, Progress))
    after = [r.timings for r in records if isinstance(r, UsageRecord)][-1]
    assert after is not None
    assert after.cached >= first_prompt + len(cut.tokens) - 1  # the cut answer stayed cached
