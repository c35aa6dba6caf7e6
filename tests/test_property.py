"""The property loopd exists for: every request extends the previous one, byte for byte.

hypothesis writes conversations (user messages; answers with and without reasoning and tool
calls, repeated calls included; every port answer; oversized results; a full context; server
errors; cancellations; restarts, where the session is closed and reopened from its log between
turns) and plays them against the scripted llama-server over real HTTP. After each, for every
pair of consecutive requests, the later one's messages start with the earlier one's, compared
as serialised bytes; the slot never loses its cache; the reopened log gives the same messages;
and the log is a valid conversation. A failing case prints how to replay it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loopd.baseline import make_baseline, messages
from loopd.canonical import canonical
from loopd.config import LoopConfig
from loopd.events import TurnEvent
from loopd.infer import Client, RetryPolicy
from loopd.records import conversation_problems
from loopd.store import Store
from loopd.tools import LocalToolPort
from loopd.turn import Runtime, TurnError, run_turn
from support.fake_llama import FakeLlama, Reply
from support.replay import ReplayServer
from test_turn import Notes, registry

words = st.text(st.sampled_from('abc é\n"{}\\'), min_size=1, max_size=12)
tools = st.sampled_from(["read_note", "broken", "wipe", "buy", "big", "web", "nope"])


@st.composite
def tool_call(draw: st.DrawFn) -> tuple[str, str, str]:
    call_id = f"c{draw(st.integers(0, 5))}"
    kind = draw(st.sampled_from(["call_tool", "call_tool", "find_tool", "garbage", "direct"]))
    if kind == "call_tool":
        arguments = json.dumps({"name": draw(tools), "arguments": {"title": draw(words)}})
        return (call_id, "call_tool", arguments)
    if kind == "find_tool":
        return (call_id, "find_tool", json.dumps({"query": draw(words)}))
    if kind == "garbage":
        return (call_id, "call_tool", '{"name": "read_note", "arguments": {"title": "x')
    return (call_id, draw(tools), "{}")


replies = st.one_of(
    st.builds(
        Reply,
        content=st.none() | words,
        reasoning=st.none() | words,
        tool_calls=st.lists(tool_call(), max_size=3).map(tuple),
    ),
    st.builds(Reply, kind=st.sampled_from(["context_full", "server_error", "stream_error"])),
)


@dataclass(frozen=True)
class Step:
    user: str
    replies: list[Reply]
    cancel_after: int | None
    """Cancel the turn at its n-th event."""
    restart: bool
    """Close the session and reopen it from its log before this turn."""


steps = st.builds(
    Step,
    user=words,
    replies=st.lists(replies, max_size=4),
    cancel_after=st.none() | st.integers(1, 12),
    restart=st.booleans(),
)


async def play(conversation: list[Step], directory: Path) -> None:
    fake = FakeLlama([])
    server = ReplayServer([fake] * 200)
    loop = LoopConfig(tool_iterations=3, tool_result_cap=200, turn_timeout=30)
    store = Store(directory)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        async with Client(server.url, retry=RetryPolicy(attempts=1)) as client:
            session = await store.create(make_baseline("Be brief."))
            rt = Runtime(
                loop=loop,
                inference=client,
                registry=registry(),
                port=LocalToolPort(registry(), {"notes": Notes()}, timeout=0.2),
            )
            for step in conversation:
                if step.restart:
                    before = canonical(messages(session.baseline, session.records))
                    session.close()
                    session = await store.open(session.id)
                    assert canonical(messages(session.baseline, session.records)) == before
                fake.replies = list(step.replies)
                await one_turn(session, rt, step)
            records = list(session.records)
            session.close()
        nursery.cancel_scope.cancel()

    bodies = [r["body"]["messages"] for r in server.requests]
    for earlier, later in itertools.pairwise(bodies):
        assert canonical(later[: len(earlier)]) == canonical(earlier)
    assert "cache_loss" not in [r.kind for r in records]
    assert conversation_problems(records) == []


async def one_turn(session: Any, rt: Runtime, step: Step) -> None:
    with trio.CancelScope() as scope:
        seen = 0

        def on_event(_: TurnEvent) -> None:
            nonlocal seen
            seen += 1
            if step.cancel_after is not None and seen >= step.cancel_after:
                scope.cancel()

        with contextlib.suppress(TurnError):  # limits and failures are part of the script
            await run_turn(session, rt, step.user, on_event)


@settings(
    max_examples=60, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(conversation=st.lists(steps, min_size=1, max_size=5))
def test_every_request_extends_the_previous_one(conversation: list[Step]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trio.run(play, conversation, Path(tmp))
