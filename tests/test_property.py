"""The property loopd exists for: every request extends the previous one, token for token.

hypothesis writes conversations (user messages; answers with and without reasoning and tool
calls, repeated calls included; every port answer; approvals given once, for the session,
denied or never given; oversized results; a full context; server errors; cancellations;
restarts, where the session is closed and reopened from its log between turns) and plays them
against a scripted llama-server over real HTTP, with history both ways:

- token-exact (`[session] history = "exact"`, the default; `support.fake_exact`): the server
  renders with a ChatML stand-in template, tokenizes one token per character and computes its
  cache figures from its slot's token ids. Every request's prompt extends the previous prompt
  and the answer the log keeps, token for token (`support.fake_exact.check`), and none goes as
  messages;
- as messages (`history = "template"`; `support.fake_llama`): for every pair of consecutive
  requests, the later one's messages start with the earlier one's, compared as serialised
  bytes.

Either way the slot never loses its cache; the reopened log gives the same messages; the log is
a valid conversation, every approval asked for is decided, and a tool approved for the session
is never asked about again. A failing case prints how to replay it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from loopd.canonical import canonical
from loopd.config import LoopConfig
from loopd.infer import Client, RetryPolicy
from loopd.session.baseline import make_baseline, messages
from loopd.session.records import (
    ApprovalRecord,
    ApprovalRequestRecord,
    Decision,
    Record,
    conversation_problems,
    open_approvals,
)
from loopd.session.store import Store
from loopd.tools import PortHandle
from loopd.turn import Runtime, TurnError, run_turn
from loopd.turn.exact import ExactHistory
from loopd.wire.events import ApprovalNeeded, TurnEvent
from support import fake_exact
from support.fake_exact import ExactLlama
from support.fake_llama import FakeLlama, Reply
from support.ports import start_port
from support.replay import ReplayServer
from test_turn import Notes, registry

words = st.text(st.sampled_from('abc é\n"{}\\'), min_size=1, max_size=12)
tools = st.sampled_from(["read_note", "broken", "wipe", "buy", "big", "web", "nope", "buy"])


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
    approvals: list[Decision | None]
    """The answers to this turn's approvals, in order; None: nobody answers (the timeout)."""


steps = st.builds(
    Step,
    user=words,
    replies=st.lists(replies, max_size=4),
    cancel_after=st.none() | st.integers(1, 12),
    restart=st.booleans(),
    approvals=st.lists(st.none() | st.sampled_from(["once", "session", "deny"]), max_size=4),
)


def buy(title: str, call_id: str = "c1") -> Reply:
    arguments = json.dumps({"name": "buy", "arguments": {"title": title}})
    return Reply(tool_calls=((call_id, "call_tool", arguments),))


APPROVALS = [
    # once, then denied, then nobody answers: each asked and decided in the log
    Step("a", [buy("a"), buy("b"), buy("c"), Reply(content="ok")], None, False, ["once", "deny"]),
    # for the session: the next call of buy, after a restart, is not asked about
    Step("b", [buy("d"), Reply(content="ok")], None, False, ["session"]),
    Step("c", [buy("e"), Reply(content="ok")], None, True, []),
]


History = Literal["exact", "template"]


async def play(conversation: list[Step], directory: Path, history: History) -> None:
    fake: ExactLlama | FakeLlama = ExactLlama([]) if history == "exact" else FakeLlama([])
    side = fake.side() if isinstance(fake, ExactLlama) else {}
    server = ReplayServer([fake] * 200, side=side)
    loop = LoopConfig(tool_iterations=3, tool_result_cap=200, turn_timeout=30)
    store = Store(directory)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        port = await start_port(
            nursery, registry(), {"notes": Notes()}, timeout=0.2, approval_timeout=0.05
        )
        async with Client(server.url, retry=RetryPolicy(attempts=1)) as client:
            session = await store.create(make_baseline("Be brief."))
            exact = ExactHistory(client) if history == "exact" else None
            rt = Runtime(
                loop=loop, inference=client, registry=port.registry, port=port, exact=exact
            )
            for step in conversation:
                if step.restart:
                    before = canonical(messages(session.baseline, session.records))
                    session.close()
                    session = await store.open(session.id)
                    assert canonical(messages(session.baseline, session.records)) == before
                fake.replies = list(step.replies)
                await one_turn(session, rt, port, step)
            records, baseline = list(session.records), session.baseline
            session.close()
        nursery.cancel_scope.cancel()

    if isinstance(fake, ExactLlama):
        assert fake.chat == 0  # not one request went as messages
        fake_exact.check(fake.sent, baseline, records)
    else:
        bodies = [r["body"]["messages"] for r in server.requests]
        for earlier, later in itertools.pairwise(bodies):
            assert canonical(later[: len(earlier)]) == canonical(earlier)
    assert "cache_loss" not in [r.kind for r in records]
    assert conversation_problems(records) == []
    assert open_approvals(records) == []
    assert not asked_after_granted(records)


def asked_after_granted(records: list[Record]) -> list[ApprovalRequestRecord]:
    granted: set[str] = set()
    asked = []
    for r in records:
        if isinstance(r, ApprovalRecord) and r.decision == "session":
            granted.add(r.tool)
        elif isinstance(r, ApprovalRequestRecord) and r.tool in granted:
            asked.append(r)
    return asked


async def one_turn(session: Any, rt: Runtime, port: PortHandle, step: Step) -> None:
    decisions = list(step.approvals)
    async with trio.open_nursery() as deciders:
        with trio.CancelScope() as scope:
            seen = 0

            def on_event(event: TurnEvent) -> None:
                nonlocal seen
                seen += 1
                decision = (
                    decisions.pop(0) if isinstance(event, ApprovalNeeded) and decisions else None
                )
                if isinstance(event, ApprovalNeeded) and decision is not None:
                    deciders.start_soon(port.decide, session.id, event.call, decision)
                if step.cancel_after is not None and seen >= step.cancel_after:
                    scope.cancel()

            with contextlib.suppress(TurnError):  # limits and failures are part of the script
                await run_turn(session, rt, step.user, on_event)


@settings(
    max_examples=60, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(conversation=st.lists(steps, min_size=1, max_size=5))
@example(conversation=APPROVALS)
@pytest.mark.parametrize("history", ["exact", "template"])
def test_every_request_extends_the_previous_one(conversation: list[Step], history: History) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trio.run(play, conversation, Path(tmp), history)
