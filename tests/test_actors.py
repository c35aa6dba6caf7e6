"""The actors wired by open_core: turns in order, events fanned out, cancels that reach the
HTTP stream, and a log left valid by every way a turn can stop."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from loopd.actors import Busy, Published, TurnDone, TurnFailed, inference_actor, open_core
from loopd.baseline import make_baseline
from loopd.config import Config
from loopd.exact import next_request
from loopd.infer import ChatEvent, ChatRequest, Client, Content, Queued, Timeouts
from loopd.records import TurnEndRecord
from loopd.store import Session, Store
from support.fake_llama import FakeLlama, Reply
from support.replay import ReplayServer


@pytest.fixture
async def served(nursery: trio.Nursery) -> tuple[FakeLlama, ReplayServer]:
    fake = FakeLlama([])
    server = ReplayServer([fake] * 50)
    await nursery.start(server.run)
    return fake, server


@pytest.fixture
async def session(tmp_path: Path) -> AsyncIterator[Session]:
    with await Store(tmp_path / "sessions").create(make_baseline()) as session:
        yield session


def config(tmp_path: Path, **loop: Any) -> Config:
    """The scripted server answers the chat endpoint only: history goes as messages."""
    return Config.model_validate(
        {
            "loop": loop,
            "tools": {"roots": [str(tmp_path)]},
            "channel": {"queue_limit": 2},
            "session": {"history": "template"},
        }
    )


async def collect(subscription: Any, turns: int) -> list[Published]:
    got: list[Published] = []
    async for message in subscription.receive:
        got.append(message)
        if sum(isinstance(m.item, TurnDone | TurnFailed) for m in got) == turns:
            break
    return got


async def test_turns_run_in_order_and_subscribers_see_them_tagged(
    tmp_path: Path, served: Any, session: Session
) -> None:
    fake, server = served
    fake.replies = [Reply(content="one"), Reply(content="two")]
    async with Client(server.url) as client, open_core(config(tmp_path), session, client) as core:
        subscription = core.session.subscribe(100)
        assert core.session.submit("t1", "first") == 0
        assert core.session.submit("t2", "second") == 1
        got = await collect(subscription, 2)
    done = [(m.turn, m.item.outcome.content) for m in got if isinstance(m.item, TurnDone)]
    assert done == [("t1", "one"), ("t2", "two")]
    assert {m.turn for m in got if isinstance(m.item, Content)} == {"t1", "t2"}
    assert [r.kind for r in session.records].count("turn_end") == 2


async def test_a_full_queue_answers_busy(tmp_path: Path, served: Any, session: Session) -> None:
    fake, server = served
    fake.replies = [Reply(kind="stall")]
    async with Client(server.url) as client, open_core(config(tmp_path), session, client) as core:
        core.session.submit("t1", "runs")
        await trio.testing.wait_all_tasks_blocked()
        core.session.submit("t2", "waits")
        core.session.submit("t3", "waits too")
        with pytest.raises(Busy):
            core.session.submit("t4", "one too many")
        assert core.session.queued == ["t2", "t3"]
        assert core.session.cancel("t3")
        assert core.session.queued == ["t2"]
        assert not core.session.cancel("t9")


async def test_cancelling_a_turn_ends_its_http_stream_and_leaves_a_valid_log(
    tmp_path: Path, served: Any, session: Session
) -> None:
    fake, server = served
    fake.replies = [Reply(content=" ".join(["slowly"] * 100), delay=0.05)]
    async with Client(server.url) as client, open_core(config(tmp_path), session, client) as core:
        subscription = core.session.subscribe(100)
        core.session.submit("t1", "hello")
        async for message in subscription.receive:
            if isinstance(message.item, Content):
                break
        assert core.session.cancel("t1")
        got = await collect(subscription, 1)
        with trio.fail_after(5):
            await server.wait_until(lambda: server.broken > 0)
    assert got[-1].item == TurnFailed("cancelled", "the turn was cancelled")
    assert [r.kind for r in session.records] == ["user", "turn_end"]
    assert session.records[-1] == TurnEndRecord(reason="cancelled", time=session.records[-1].time)


async def test_a_subscriber_that_falls_behind_is_dropped_not_the_turn(
    tmp_path: Path, served: Any, session: Session
) -> None:
    fake, server = served
    fake.replies = [Reply(content=" ".join(["word"] * 50))]
    async with Client(server.url) as client, open_core(config(tmp_path), session, client) as core:
        slow = core.session.subscribe(2)
        steady = core.session.subscribe(1000)
        core.session.submit("t1", "talk")
        got = await collect(steady, 1)
        assert slow.lagged
        assert len([m async for m in slow.receive]) == 2  # what fitted, then the end
    assert isinstance(got[-1].item, TurnDone)


async def test_stopping_the_core_mid_turn_leaves_a_valid_log(
    tmp_path: Path, served: Any, session: Session
) -> None:
    fake, server = served
    fake.replies = [Reply(kind="stall")]
    async with Client(server.url) as client, open_core(config(tmp_path), session, client) as core:
        core.session.submit("t1", "hello")
        with trio.fail_after(5):
            await server.wait_until(lambda: bool(server.requests))
    assert [r.kind for r in session.records] == ["user", "turn_end"]
    assert session.records[-1] == TurnEndRecord(reason="cancelled", time=session.records[-1].time)


async def test_the_inference_actor_runs_one_request_at_a_time(served: Any) -> None:
    fake, server = served
    fake.replies = [Reply(content="first answer", delay=0.05), Reply(content="second answer")]
    request = ChatRequest([{"role": "user", "content": "hi"}])
    first: list[ChatEvent] = []
    second: list[ChatEvent] = []
    streaming = trio.Event()
    # The client's own Queued (no headers yet) is turned off: this is about the actor's.
    patient = Timeouts(queued_after=3600)
    async with Client(server.url, timeouts=patient) as client, trio.open_nursery() as nursery:
        handle = await nursery.start(inference_actor, client)
        results: dict[str, str | None] = {}

        async def ask(name: str, events: list[ChatEvent]) -> None:
            def on_event(event: ChatEvent) -> None:
                events.append(event)
                if isinstance(event, Content):
                    streaming.set()

            results[name] = (await handle.chat_with_retry(request, on_event)).content

        async with trio.open_nursery() as asks:
            asks.start_soon(ask, "a", first)
            await streaming.wait()
            asks.start_soon(ask, "b", second)
        nursery.cancel_scope.cancel()
    assert results == {"a": "first answer", "b": "second answer"}
    assert second[0] == Queued()
    assert Queued() not in first
    assert len(server.requests) == 2


async def test_an_error_from_the_server_reaches_the_caller_typed(served: Any) -> None:
    fake, server = served
    fake.replies = [Reply(kind="context_full")]
    async with Client(server.url) as client, trio.open_nursery() as nursery:
        handle = await nursery.start(inference_actor, client)
        with pytest.raises(Exception, match="exceeds the available context") as caught:
            await handle.chat_with_retry(ChatRequest([]), lambda _: None)
        nursery.cancel_scope.cancel()
    assert type(caught.value).__name__ == "HttpError"
    assert json.loads(caught.value.body)["error"]["type"] == "exceed_context_size_error"  # type: ignore[attr-defined]


async def test_a_bug_in_a_turn_fails_that_turn_and_the_next_is_served(
    tmp_path: Path, served: Any, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, server = served
    fake.replies = [Reply(content="still here")]
    calls = 0

    async def broken_once(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyError("a bug")
        return await next_request(*args)

    monkeypatch.setattr("loopd.turn.next_request", broken_once)
    async with Client(server.url) as client, open_core(config(tmp_path), session, client) as core:
        subscription = core.session.subscribe(100)
        core.session.submit("t1", "first")
        core.session.submit("t2", "second")
        got = await collect(subscription, 2)
    ends = [m.item for m in got if isinstance(m.item, TurnDone | TurnFailed)]
    assert ends[0] == TurnFailed("error", "loopd failed: KeyError: 'a bug'")
    assert isinstance(ends[1], TurnDone)
    assert ends[1].outcome.content == "still here"
    assert [r.reason for r in session.records if isinstance(r, TurnEndRecord)] == [
        "error",
        "answer",
    ]
