"""Sub-agents on a scripted server of four slots: a `delegate` call runs a new session on a slot
of its own; its answer, or why there is none, is the call's result. Each conversation (the
parent's, each child's) is answered from its own script, with its own slot figures."""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from rich.console import Console

from bxctl.text import as_tree
from bxctl.view import TurnView
from loopd.actors import Core, SessionHandle, Subscription, TurnDone, TurnFailed, open_core
from loopd.config import AgentsConfig, Config, LoopConfig, Policy
from loopd.infer import Client
from loopd.session.baseline import SUB_AGENT_NOTE
from loopd.session.records import (
    ApprovalRecord,
    CacheLossRecord,
    Record,
    SessionHeader,
    ToolResultRecord,
    TurnEndRecord,
    UserRecord,
    conversation_problems,
)
from loopd.session.store import Store
from loopd.wire.events import AgentUpdate, ApprovalNeeded, ToolCallStarted
from loopd.wire.proto import Event
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply
from support.replay import Exchange, ReplayServer
from test_actors import collect, config, next_of, read_file
from test_bxctl import bxctl


def delegate(*tasks: str) -> Reply:
    """One answer with a `delegate` call for each task."""
    return Reply(
        tool_calls=tuple(
            (f"d{n}", "call_tool", json.dumps({"name": "delegate", "arguments": {"task": task}}))
            for n, task in enumerate(tasks, start=1)
        )
    )


@dataclass
class Conversations:
    """Answers each conversation, known by its first user message, from its own script."""

    scripts: dict[str, list[Reply]]
    fakes: dict[str, FakeLlama] = field(default_factory=dict)

    def __call__(self, request: Any) -> Exchange:
        first = next(m["content"] for m in request["messages"] if m["role"] == "user")
        if first not in self.fakes:
            self.fakes[first] = FakeLlama(self.scripts[first])
        return self.fakes[first](request)


@dataclass
class Scripted:
    tmp_path: Path
    server: ReplayServer
    store: Store
    core: Core
    parent: SessionHandle
    first: str
    events: Subscription

    def log(self, session: str | None = None) -> list[Record]:
        return self.store.read(session or self.first)[1]

    def header(self, session: str) -> SessionHeader:
        return self.store.read(session)[0]

    def children(self) -> list[str]:
        """The sub-agents' sessions, in the order they were started."""
        ids = sorted(p.stem for p in self.store.directory.glob("*.jsonl"))
        return [i for i in ids if self.header(i).parent is not None]

    def results(self, session: str | None = None) -> list[str]:
        return [r.content for r in self.log(session) if isinstance(r, ToolResultRecord)]

    async def turn(self, turn: str, text: str) -> list[Any]:
        await self.parent.send(turn, text)
        with trio.fail_after(10):
            return [m.item for m in await collect(self.events, 1)]


@asynccontextmanager
async def scripted(
    tmp_path: Path,
    scripts: dict[str, list[Reply]],
    *,
    cfg: Config | None = None,
    slots: int = 4,
    **agents: Any,
) -> AsyncIterator[Scripted]:
    server = ReplayServer([Conversations(scripts)] * 100, slots=slots)
    base = cfg or config(tmp_path)
    settings = base.model_copy(update={"agents": AgentsConfig(**agents)})
    store = Store(tmp_path / "sessions")
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        async with Client(server.url) as client, open_core(settings, store, [client]) as core:
            parent, first = await core.sessions.attach("new")
            events = await parent.subscribe(1000)
            yield Scripted(tmp_path, server, store, core, parent, first, events)
        nursery.cancel_scope.cancel()


def valid(s: Scripted, *sessions: str) -> None:
    for session in sessions:
        assert conversation_problems(s.log(session)) == [], session


async def test_a_delegate_call_runs_a_child_session_and_its_answer_is_the_result(
    tmp_path: Path,
) -> None:
    scripts = {
        "How many moons has Mars?": [delegate("Count the moons of Mars."), Reply(content="Two.")],
        "Count the moons of Mars.": [Reply(content="Mars has two moons.")],
    }
    async with scripted(tmp_path, scripts) as s:
        items = await s.turn("t1", "How many moons has Mars?")
    (child,) = s.children()
    assert s.results() == [f"The sub-agent in session {child} answered:\n\nMars has two moons."]
    header = s.header(child)
    assert (header.parent, header.call, header.call_id) == (s.first, 1, "d1")
    assert header.baseline.system.endswith(SUB_AGENT_NOTE)
    assert [r.content for r in s.log(child) if isinstance(r, UserRecord)] == [
        "Count the moons of Mars."
    ]
    assert [r.reason for r in s.log(child) if isinstance(r, TurnEndRecord)] == ["answer"]
    news = [i for i in items if isinstance(i, AgentUpdate)]
    assert {(n.session, n.parent, n.call) for n in news} == {(child, s.first, 1)}
    assert [n.state for n in news][-1] == "answered"
    assert news[-1].tokens > 0
    assert isinstance(items[-1], TurnDone)
    valid(s, s.first, child)
    assert not any(isinstance(r, CacheLossRecord) for r in s.log())  # the parent's slot kept


async def test_three_delegate_calls_of_one_answer_run_at_once_and_answer_in_call_order(
    tmp_path: Path,
) -> None:
    tasks = [f"Name a colour, number {n}." for n in range(3)]
    slow = {task: [Reply(content=f"colour {n} is red", delay=0.05)] for n, task in enumerate(tasks)}
    scripts = {"Three colours, please.": [delegate(*tasks), Reply(content="ok")], **slow}
    async with scripted(tmp_path, scripts) as s:
        await s.turn("t1", "Three colours, please.")
    children = s.children()
    assert len(children) == 3
    starts = [next(r.time for r in s.log(c) if isinstance(r, UserRecord)) for c in children]
    ends = [next(r.time for r in s.log(c) if isinstance(r, TurnEndRecord)) for c in children]
    assert max(starts) < min(ends)  # each began before any ended
    results = s.log()
    order = [r.tool_call_id for r in results if isinstance(r, ToolResultRecord)]
    assert order == ["d1", "d2", "d3"]
    by_call = {s.header(c).call_id: c for c in children}
    for n, result in enumerate(s.results()):
        assert result == (
            f"The sub-agent in session {by_call[f'd{n + 1}']} answered:\n\ncolour {n} is red"
        )
    valid(s, s.first, *children)


async def test_a_child_cannot_delegate_at_the_default_depth(tmp_path: Path) -> None:
    scripts = {
        "Go.": [delegate("Plan it."), Reply(content="done")],
        "Plan it.": [delegate("Plan it deeper."), Reply(content="I planned it myself.")],
    }
    async with scripted(tmp_path, scripts) as s:
        await s.turn("t1", "Go.")
    (child,) = s.children()  # the grandchild was never made
    assert s.results(child) == [
        (
            "The tool failed: a sub-agent 1 level deep cannot delegate ([agents] depth = 1); do "
            "the task yourself"
        )
    ]
    assert "I planned it myself." in s.results()[0]


async def test_depth_two_lets_a_child_delegate_once_more(tmp_path: Path) -> None:
    scripts = {
        "Go.": [delegate("Plan it."), Reply(content="done")],
        "Plan it.": [delegate("Plan a part."), Reply(content="planned")],
        "Plan a part.": [Reply(content="the part")],
    }
    async with scripted(tmp_path, scripts, depth=2) as s:
        items = await s.turn("t1", "Go.")
    child, grandchild = s.children()
    assert s.header(grandchild).parent == child
    assert "the part" in s.results(child)[0]
    # The grandchild's news reaches the top session's clients, naming its own parent.
    assert any(isinstance(i, AgentUpdate) and i.parent == child for i in items)


async def test_depth_zero_offers_no_delegate_tool(tmp_path: Path) -> None:
    scripts = {"Go.": [delegate("Plan it."), Reply(content="done")]}
    async with scripted(tmp_path, scripts, depth=0) as s:
        await s.turn("t1", "Go.")
    assert s.children() == []
    assert "no tool" in s.results()[0].lower()


async def test_children_at_once_beyond_the_bound_are_refused(tmp_path: Path) -> None:
    scripts = {
        "Two things.": [delegate("First thing.", "Second thing."), Reply(content="ok")],
        "First thing.": [Reply(content="first", delay=0.05)],
        "Second thing.": [Reply(content="second", delay=0.05)],
    }
    async with scripted(tmp_path, scripts, at_once=1) as s:
        await s.turn("t1", "Two things.")
    (child,) = s.children()
    # The two start side by side, in no fixed order: whichever came second is refused.
    answered, refused = sorted(s.results(), key=lambda r: "answered" not in r)
    assert answered.startswith(f"The sub-agent in session {child} answered")
    assert refused == (
        "The tool failed: as many sub-agents as loopd runs at once are running "
        "([agents] at_once = 1); wait for their answers, or do it yourself"
    )


async def test_children_per_turn_beyond_the_bound_are_refused(tmp_path: Path) -> None:
    scripts = {
        "Two things.": [delegate("First thing."), delegate("Second thing."), Reply(content="ok")],
        "First thing.": [Reply(content="first")],
        "Second thing.": [Reply(content="second")],
    }
    async with scripted(tmp_path, scripts, per_turn=1) as s:
        await s.turn("t1", "Two things.")
    assert len(s.children()) == 1
    assert "([agents] per_turn = 1)" in s.results()[1]


async def test_one_slot_leaves_no_room_for_a_child(tmp_path: Path) -> None:
    scripts = {"Go.": [delegate("Plan it."), Reply(content="done")]}
    async with scripted(tmp_path, scripts, slots=1) as s:
        await s.turn("t1", "Go.")
    assert s.results()[0].startswith("The tool failed: loopd has one slot, and this turn holds it")


async def test_a_child_never_waits_for_a_slot_every_turn_holds_one(tmp_path: Path) -> None:
    """Two slots: one holds another session's stalled turn, the other the delegating turn.
    Waiting for a slot could wait forever (that turn may wait for sub-agents of its own)."""
    scripts = {
        "Stall.": [Reply(kind="stall")],
        "Go.": [delegate("Plan it."), Reply(content="done")],
        "Plan it.": [Reply(content="planned")],
    }
    async with scripted(tmp_path, scripts, slots=2) as s:
        other, _ = await s.core.sessions.attach("new")
        await other.send("t0", "Stall.")
        with trio.fail_after(10):
            await s.server.wait_until(lambda: len(s.server.requests) == 1)
        await s.turn("t1", "Go.")
    assert s.results() == [
        (
            "The tool failed: no slot is free for a sub-agent: every slot runs a turn now; do "
            "the task yourself, or delegate it later"
        )
    ]
    assert s.children() == []  # no log for a child never run


async def test_cancelling_the_parent_cancels_its_children(tmp_path: Path) -> None:
    scripts = {
        "Two things.": [delegate("First thing.", "Second thing.")],
        "First thing.": [Reply(kind="stall")],
        "Second thing.": [Reply(kind="stall")],
    }
    async with scripted(tmp_path, scripts) as s:
        await s.parent.send("t1", "Two things.")
        with trio.fail_after(10):
            await s.server.wait_until(lambda: len(s.server.requests) == 3)  # both stall
        assert len(s.core.agents.running) == 2
        assert await s.parent.cancel("t1")
        with trio.fail_after(10):
            items = [m.item for m in await collect(s.events, 1)]
        assert s.core.agents.running == {}
    assert isinstance(items[-1], TurnFailed)
    assert items[-1].kind == "cancelled"
    children = s.children()
    for child in children:
        assert [r.reason for r in s.log(child) if isinstance(r, TurnEndRecord)] == ["cancelled"]
    ended = [i.state for i in items if isinstance(i, AgentUpdate) and i.state != "running"]
    assert ended == ["cancelled", "cancelled"]
    assert [r.reason for r in s.log() if isinstance(r, TurnEndRecord)] == ["cancelled"]
    valid(s, s.first, *children)


def write_file(path: str, content: str) -> Reply:
    arguments = json.dumps({"name": "write_file", "arguments": {"path": path, "content": content}})
    return Reply(tool_calls=(("w1", "call_tool", arguments),))


SUB_AGENT_STATES = ["waits for approval", "waits for its answer", "generates", "parent's deadline"]


async def cancelled_while_a_sub_agent(folder: Path, state: str) -> list[Any]:
    """The parent's events from when its sub-agent is in `state` to the parent's end: cancelled
    then, or, for the parent's deadline, ended by it."""
    child = {
        "waits for approval": write_file("a.md", "x"),
        "generates": Reply(content=" ".join(["word"] * 400), delay=0.01),
    }.get(state, Reply(kind="stall"))
    deadline = state == "parent's deadline"
    cfg = config(folder, turn_timeout=0.5) if deadline else None
    scripts = {"Go.": [delegate("Do it.")], "Do it.": [child]}
    async with scripted(folder, scripts, cfg=cfg) as s:
        await s.parent.send("t1", "Go.")
        with trio.fail_after(10):
            if state == "waits for approval":
                await next_of(s.events, ApprovalNeeded)
            elif state == "generates":
                while (await next_of(s.events, AgentUpdate)).state != "running":
                    pass  # its first words have streamed
            elif not deadline:
                await s.server.wait_until(lambda: len(s.server.requests) == 2)
        if not deadline:
            assert await s.parent.cancel("t1")
        with trio.fail_after(10):
            return [m.item for m in await collect(s.events, 1)]


@pytest.mark.parametrize("state", SUB_AGENT_STATES)
async def test_a_cancelled_parent_is_over_only_after_its_sub_agent_is(
    tmp_path: Path, state: str
) -> None:
    """The sub-agent runs in its parent turn's task: its `cancelled` reaches clients before the
    parent's end, every time, whatever it was doing and whether a client cancelled the parent or
    its deadline did (it ran in the tool port's task, which the parent's cancel did not wait
    for, and came after)."""
    for attempt in range(20):
        (tmp_path / str(attempt)).mkdir()
        items = await cancelled_while_a_sub_agent(tmp_path / str(attempt), state)
        ended = [i for i in items if isinstance(i, AgentUpdate) and i.state == "cancelled"]
        assert len(ended) == 1, attempt
        assert items.index(ended[0]) < len(items) - 1, attempt
        assert isinstance(items[-1], TurnFailed), attempt
        kind = "turn_limit" if state == "parent's deadline" else "cancelled"
        assert items[-1].kind == kind, attempt


async def test_a_child_past_its_iteration_cap_gives_the_limit_as_the_result(
    tmp_path: Path,
) -> None:
    scripts = {
        "Read twice.": [delegate("Read the note twice."), Reply(content="ok")],
        "Read the note twice.": [read_file("a.md", "r1"), read_file("b.md", "r2")],
    }
    async with scripted(tmp_path, scripts, tool_iterations=1) as s:
        items = await s.turn("t1", "Read twice.")
    (child,) = s.children()
    assert s.results()[0] == (
        f"The tool failed: the sub-agent in session {child} stopped without an answer (turn "
        "limit): more than 1 rounds of tool calls in one turn ([agents] tool_iterations)"
    )
    assert [r.reason for r in s.log(child) if isinstance(r, TurnEndRecord)] == ["turn_limit"]
    failed = [i for i in items if isinstance(i, AgentUpdate) and i.state == "failed"]
    assert len(failed) == 1
    assert failed[0].tool_calls == 1  # the second round is refused before its call starts


async def test_a_child_past_its_own_deadline_gives_the_limit_as_the_result(
    tmp_path: Path,
) -> None:
    scripts = {
        "Wait.": [delegate("Wait forever."), Reply(content="ok")],
        "Wait forever.": [Reply(kind="stall")],
    }
    async with scripted(tmp_path, scripts, turn_timeout=0.5) as s:
        await s.turn("t1", "Wait.")
    (child,) = s.children()
    assert s.results()[0] == (
        f"The tool failed: the sub-agent in session {child} stopped without an answer (turn "
        "limit): the turn took longer than 0.5 s ([agents] turn_timeout)"
    )
    assert [r.reason for r in s.log() if isinstance(r, TurnEndRecord)] == ["answer"]


async def test_the_parents_deadline_ends_its_children(tmp_path: Path) -> None:
    scripts = {
        "Wait.": [delegate("Wait forever.", "Wait as well.")],
        "Wait forever.": [Reply(kind="stall")],
        "Wait as well.": [Reply(kind="stall")],
    }
    async with scripted(tmp_path, scripts, cfg=config(tmp_path, turn_timeout=0.5)) as s:
        items = await s.turn("t1", "Wait.")
    assert isinstance(items[-1], TurnFailed)
    assert items[-1].kind == "turn_limit"
    children = s.children()
    assert len(children) == 2
    for child in children:
        assert [r.reason for r in s.log(child) if isinstance(r, TurnEndRecord)] == ["cancelled"]
    valid(s, s.first, *children)


def test_a_childs_limits_are_the_agents_table_and_the_rest_its_parents() -> None:
    parent = LoopConfig(thinking=False, max_tokens=100, tool_result_cap=50, turn_timeout=9.0)
    agents = AgentsConfig(tool_iterations=2, thinking_cap=3, repetition_cap=4, turn_timeout=5.0)
    child = agents.loop(parent)
    assert (child.tool_iterations, child.thinking_cap, child.repetition_cap) == (2, 3, 4)
    assert child.turn_timeout == 5.0
    assert (child.thinking, child.max_tokens, child.tool_result_cap) == (False, 100, 50)


async def test_a_childs_approval_reaches_the_parents_client_and_is_answered_there(
    tmp_path: Path,
) -> None:
    scripts = {
        "What do I buy?": [delegate("Read today.md."), Reply(content="milk")],
        "Read today.md.": [read_file("today.md"), Reply(content="buy milk")],
    }
    async with scripted(tmp_path, scripts) as s:
        await s.parent.send("t1", "What do I buy?")
        with trio.fail_after(10):
            needed = await next_of(s.events, ApprovalNeeded)
        (child,) = s.children()
        assert (needed.session, needed.tool) == (child, "read_file")
        pending = (await s.parent.status()).pending
        assert [p.item for p in pending] == [needed]
        assert not await s.parent.decide(needed.call, "once")  # the parent's own call 1: none
        assert not await s.parent.decide(needed.call, "once", session="20260101T000000000Z-0")
        assert await s.parent.decide(needed.call, "once", session=child)
        with trio.fail_after(10):
            await collect(s.events, 1)
    assert "buy milk" in s.results()[0]
    approvals = [r for r in s.log(child) if isinstance(r, ApprovalRecord)]
    assert [(a.tool, a.decision, a.by) for a in approvals] == [("read_file", "once", "user")]


async def test_a_delegate_policy_of_ask_waits_for_a_person_before_the_child_starts(
    tmp_path: Path,
) -> None:
    scripts = {
        "Go.": [delegate("Plan it."), delegate("Plan it again."), Reply(content="done")],
        "Plan it.": [Reply(content="planned")],
        "Plan it again.": [Reply(content="planned again")],
    }
    cfg = config(tmp_path)
    cfg.tools.policies["delegate"] = Policy(action="ask")
    async with scripted(tmp_path, scripts, cfg=cfg) as s:
        await s.parent.send("t1", "Go.")
        with trio.fail_after(10):
            needed = await next_of(s.events, ApprovalNeeded)
        assert (needed.tool, needed.session, needed.arguments) == (
            "delegate",
            None,
            {"task": "Plan it."},
        )
        assert s.children() == []  # nothing started before the answer
        assert await s.parent.decide(needed.call, "deny")
        with trio.fail_after(10):
            needed = await next_of(s.events, ApprovalNeeded)
        assert await s.parent.decide(needed.call, "once")
        with trio.fail_after(10):
            await collect(s.events, 1)
    (child,) = s.children()
    assert [r.content for r in s.log(child) if isinstance(r, UserRecord)] == ["Plan it again."]
    denied, answered = s.results()
    assert denied == "The call was denied: the user did not approve it"
    assert answered.startswith(f"The sub-agent in session {child} answered")


async def test_a_tool_the_parent_approved_for_its_session_is_approved_in_its_children(
    tmp_path: Path,
) -> None:
    scripts = {
        "Read it.": [
            read_file("today.md"),
            Reply(content="read"),
            delegate("Read today.md."),
            Reply(content="milk"),
        ],
        "Read today.md.": [read_file("today.md"), Reply(content="buy milk")],
    }
    async with scripted(tmp_path, scripts) as s:
        await s.parent.send("t1", "Read it.")
        with trio.fail_after(10):
            needed = await next_of(s.events, ApprovalNeeded)
        assert await s.parent.decide(needed.call, "session")
        with trio.fail_after(10):
            await collect(s.events, 1)
        items = await s.turn("t2", "Read it.")
    assert not any(isinstance(i, ApprovalNeeded) for i in items)  # the child did not ask
    (child,) = s.children()
    assert s.header(child).grants == ("read_file",)
    assert "buy milk" in s.results()[-1]


async def come_back(client: LineClient, first: str, children: list[str]) -> None:
    """After a restart, open a sub-agent's session, or list the sessions."""
    if first == "a sub-agent":
        await client.send({"type": "hello", "session": children[0]})
        await client.until("welcome")
        return
    # In a session of its own: a listing opens the client's session, `latest` where it named
    # none, and that would be the parent.
    await client.send({"type": "hello", "session": "new"})
    await client.until("welcome")
    await client.send({"type": "sessions"})
    listed = (await client.until("sessions"))[-1]["sessions"]
    assert set(children) < {s["id"] for s in listed}


@pytest.mark.parametrize("first", ["the parent", "a sub-agent", "the list of sessions"])
async def test_a_kill_9_with_children_running_leaves_every_log_valid_and_runs_nothing_again(
    tmp_path: Path, first: str
) -> None:
    """After the restart, a sub-agent's log is closed the first time loopd comes to it: when
    its parent opens, when it opens itself, or when loopd lists the sessions."""
    scripts = {
        "Two things.": [delegate("First thing.", "Second thing.")],
        "First thing.": [Reply(kind="stall")],
        "Second thing.": [Reply(kind="stall")],
    }
    server = ReplayServer([Conversations(scripts)] * 10, slots=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        d = Daemon(tmp_path / "loopd", server.url, slots='save = "never"\n')
        await d.start()
        try:
            client = await d.connect()
            await client.send({"type": "hello", "session": "new"})
            parent = (await client.until("welcome"))[-1]["session"]
            await client.send({"type": "send", "id": "t1", "content": "Two things."})
            with trio.fail_after(10):
                await server.wait_until(lambda: len(server.requests) == 3)
            await d.kill()
            store = Store(d.home / "sessions")
            children = [i.id for i in await store.sessions() if i.parent == parent]
            assert len(children) == 2
            await d.start()
            client = await d.connect()
            if first != "the parent":
                await come_back(client, first, children)
                closed = children[:1] if first == "a sub-agent" else children
                for child in closed:
                    assert isinstance(store.read(child)[1][-1], TurnEndRecord), child
                assert not isinstance(store.read(parent)[1][-1], TurnEndRecord)  # not yet
                client = await d.connect()  # the first one stays where it is
            await client.send({"type": "hello", "session": parent})
            await client.until("welcome")
        finally:
            await d.end()
        nursery.cancel_scope.cancel()
    assert len(server.requests) == 3  # no child ran again
    log = store.read(parent)[1]
    assert conversation_problems(log) == []
    results = {r.tool_call_id: r.content for r in log if isinstance(r, ToolResultRecord)}
    by_call = {str(store.read(c)[0].call_id): c for c in children}
    for call_id, child in by_call.items():
        assert results[call_id].startswith(
            f"Interrupted: loopd stopped while the sub-agent in session {child}"
        )
        child_log = store.read(child)[1]
        assert conversation_problems(child_log) == []
        assert [r.reason for r in child_log if isinstance(r, TurnEndRecord)] == ["error"]
    if first != "the list of sessions":
        assert [i.id for i in await store.sessions() if i.parent is None] == [parent]
        assert store.latest() == parent  # `latest` is never a sub-agent's
    text = d.log.read_text()
    assert "ERROR" not in text, text


@pytest.mark.parametrize("bad", [{"depth": -1}, {"at_once": 0}, {"per_turn": 0}])
def test_bad_agents_settings_are_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="agents"):
        Config.model_validate({"agents": bad})


# -- bxctl -----------------------------------------------------------------------------------


@asynccontextmanager
async def daemon_on(tmp_path: Path, scripts: dict[str, list[Reply]]) -> AsyncIterator[Daemon]:
    """`loopd serve` on a scripted server of four slots, `read_file` asking for approval."""
    server = ReplayServer([Conversations(scripts)] * 100, slots=4)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "today.md").write_text("buy milk\n")
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        d = Daemon(tmp_path / "loopd", server.url, slots='save = "never"\n')
        d.config.write_text(
            d.config.read_text()
            + f'[tools]\nroots = ["{notes}"]\n[tools.policies.read_file]\naction = "ask"\n'
        )
        await d.start()
        try:
            yield d
        finally:
            await d.end()
            nursery.cancel_scope.cancel()


async def test_bxctl_shows_sub_agents_in_sessions_and_log_and_answers_their_approvals(
    tmp_path: Path,
) -> None:
    scripts = {
        "What do I buy?": [delegate("Read today.md."), Reply(content="Milk.")],
        "Read today.md.": [read_file("today.md"), Reply(content="buy milk")],
    }
    async with daemon_on(tmp_path, scripts) as d:
        code, _, err = await bxctl(d, "chat", "-m", "What do I buy?")
        assert code == 6  # the sub-agent's call waits for approval
        store = Store(d.home / "sessions")
        parent = store.latest()
        (child,) = [i.id for i in store.sessions_now() if i.parent]
        hint = f"bxctl approve 1 --once|--session|--deny --in {parent} --sub-agent {child}"
        assert hint in err
        watching = await d.connect()
        await watching.send({"type": "hello", "session": parent})
        await watching.until("welcome")
        await watching.send({"type": "subscribe"})
        code, _, err = await bxctl(d, "approve", "1", "--once", "--sub-agent", child)
        assert (code, err) == (0, "")
        await watching.until("turn_done")
        code, out, _ = await bxctl(d, "sessions")
        assert out.splitlines()[1].startswith(f"  └─ {child}")
        code, out, _ = await bxctl(d, "log")
    lines = out.splitlines()
    start = lines.index(f"    ┌ sub-agent {child}")
    assert lines[start - 1].startswith(f"  ↳ #1 The sub-agent in session {child} answered")
    assert lines[start + 1] == "    │ you: Read today.md."
    assert "    │ model: buy milk" in lines
    assert lines[-1].startswith("model: Milk.") or "model: Milk." in out


def test_the_live_view_draws_a_line_per_sub_agent_under_its_call() -> None:
    view = TurnView()
    news = AgentUpdate(session="S1", parent="P", call=1, state="running", tool_calls=2)
    for event in (
        ToolCallStarted(name="call_tool", call=1, tool="delegate"),
        news.model_copy(update={"tool": "read_file", "tokens": 40}),
        news.model_copy(update={"state": "failed", "tokens": 90, "detail": "turn limit"}),
    ):
        view.feed(Event(id="t1", event=event))
    console = Console(record=True, width=120, color_system=None)
    console.print(view.final())
    assert console.export_text().splitlines()[:2] == [
        "⚙ call_tool → delegate (call 1)",
        "  ↳ sub-agent S1 (call 1): failed · 2 tool calls · 90 tokens · turn limit",
    ]


def test_sessions_are_listed_as_a_tree() -> None:
    listed = [
        SimpleNamespace(id="a", parent=None, forked_from=None),
        SimpleNamespace(id="a1", parent="a", forked_from=None),
        SimpleNamespace(id="b", parent=None, forked_from=None),
        SimpleNamespace(id="a1x", parent="a1", forked_from=None),
        SimpleNamespace(id="a2", parent="a", forked_from=None),
    ]
    assert [(d, s.id) for d, s in as_tree(listed)] == [
        (0, "a"),
        (1, "a1"),
        (2, "a1x"),
        (1, "a2"),
        (0, "b"),
    ]
    assert [s.id for _, s in as_tree(listed, newest_first=True)][:2] == ["b", "a"]


async def one_asks_and_one_talks(client: LineClient) -> None:
    """Until one sub-agent waits for approval and another has begun its answer."""
    asking: set[str] = set()
    talking: set[str] = set()
    with trio.fail_after(30):
        while not (asking and talking - asking):
            line = await client.receive()
            assert line is not None
            event = line.get("event", {})
            if event.get("kind") == "approval_needed":
                asking.add(event["session"])
            elif event.get("kind") == "agent" and event["state"] == "running":
                talking.add(event["session"])


async def test_sigterm_with_sub_agents_running_logs_no_error_and_closes_every_log(
    tmp_path: Path,
) -> None:
    """One sub-agent waits for approval, another generates slowly: loopd stops at once, exits 0,
    its own log says no error, and every log is a closed conversation."""
    scripts = {
        "Two things.": [delegate("Read today.md.", "Write slowly.")],
        "Read today.md.": [read_file("today.md")],
        "Write slowly.": [Reply(content=" ".join(["word"] * 200), delay=0.2)],
    }
    async with daemon_on(tmp_path, scripts) as d:
        client = await d.connect()
        await client.send({"type": "hello", "session": "new"})
        parent = (await client.until("welcome"))[-1]["session"]
        await client.send({"type": "send", "id": "t1", "content": "Two things."})
        await one_asks_and_one_talks(client)
        assert await d.stop(signal.SIGTERM) == 0
    text = d.log.read_text()
    assert "ERROR" not in text, text
    assert "Traceback" not in text, text
    store = Store(d.home / "sessions")
    sessions = store.sessions_now()
    assert sorted(i.parent or "" for i in sessions) == ["", parent, parent]
    for info in sessions:
        _, records, torn = store.read(info.id)
        assert torn == 0
        assert conversation_problems(records) == [], info.id
        assert [r.reason for r in records if isinstance(r, TurnEndRecord)] == ["cancelled"]


async def test_a_running_sub_agents_session_is_refused_naming_its_parent_then_opens_after(
    tmp_path: Path,
) -> None:
    """Its log is its parent's turn's to write while it runs: opening it is refused with where
    to follow it (not "open for writing by another process": it is this loopd), and once the
    parent's call is over it opens."""
    scripts = {
        "What do I buy?": [delegate("Read today.md."), Reply(content="Milk.")],
        "Read today.md.": [read_file("today.md"), Reply(content="buy milk")],
    }
    async with daemon_on(tmp_path, scripts) as d:
        client = await d.connect()
        await client.send({"type": "hello", "session": "new"})
        parent = (await client.until("welcome"))[-1]["session"]
        await client.send({"type": "send", "id": "t1", "content": "What do I buy?"})
        asking = await client.until("event")
        while asking[-1]["event"]["kind"] != "approval_needed":
            asking = await client.until("event")
        needed = asking[-1]["event"]
        child = needed["session"]
        other = await d.connect()
        await other.send({"type": "hello", "session": child})
        error = (await other.until("error"))[-1]
        assert error["code"] == "session_unavailable"
        assert error["message"] == (
            f"session {child} is a sub-agent that runs now, in a turn of session {parent}; "
            f"follow it from session {parent}, whose clients see its progress and answer its "
            "approvals, and open it once its task is done"
        )
        code, _, err = await bxctl(d, "chat", "--session", child, "-m", "hello?")
        assert code == 2
        assert f"in a turn of session {parent}" in err
        assert "another process" not in err
        await client.send(
            {"type": "approve", "call": needed["call"], "session": child, "decision": "once"}
        )
        await client.until("turn_done")
        await other.send({"type": "open_session", "id": child})
        assert (await other.until("welcome"))[-1]["session"] == child
    assert "ERROR" not in d.log.read_text()
