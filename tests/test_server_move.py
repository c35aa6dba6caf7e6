"""With several llama-servers, a request its server cannot take before any output (it answers
503 while it loads, or it was killed) goes on on another server that can take it, mid-turn,
with nothing said twice; one whose output had begun fails as it does with one server; while
no other server can take it, the turn waits. A real `loopd serve` on two scripted servers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
from acp import schema

from bxctl.acp_map import update_of
from bxctl.view import TurnView
from conftest import NO_SLOT_FILES
from loopd.session.records import (
    AssistantRecord,
    CacheLossRecord,
    ToolResultRecord,
    UserRecord,
    conversation_problems,
)
from loopd.wire.events import MovedToServer
from loopd.wire.proto import Event
from support.daemon import Daemon, LineClient
from support.fake_llama import FakeLlama, Reply
from support.replay import Exchange, ReplayServer
from test_sessions import records, welcome
from test_waiting import LOADING, kinds, until_end

Step = Callable[[Any], Exchange]
"""One request's answer, from its body."""


def refused(_: Any) -> Exchange:
    """503 "Loading model", as a llama-server loading its model answers."""
    return Exchange({}, 503, [("content-type", "application/json")], LOADING, {})


@dataclass
class Scripted:
    """A scripted llama-server that answers each completion request with the next step, then
    with `rest`, in a cancel scope of its own: cancelled, it is gone (connections refused)."""

    steps: list[Step]
    rest: Step
    requests: list[Any] = field(default_factory=list)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    server: ReplayServer = field(init=False)

    def __post_init__(self) -> None:
        self.server = ReplayServer([self] * 1000)

    def __call__(self, request: Any) -> Exchange:
        self.requests.append(request)
        return (self.steps.pop(0) if self.steps else self.rest)(request)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.scope:
            await self.server.run(task_status=task_status)

    def kill(self) -> None:
        self.scope.cancel()


def killed(server: Scripted) -> Step:
    """The server dies as the request reaches it: no answer, and no server after."""

    def step(_: Any) -> Exchange:
        server.kill()
        return refused(None)  # never sent: the connection goes with the server

    return step


def cut_after_output(fake: FakeLlama) -> Step:
    """The answer begins, then the connection breaks (the server died under it)."""

    def step(request: Any) -> Exchange:
        whole = fake(request)
        begun = "\n\n".join(whole.body.split("\n\n")[:3]) + "\n\n"  # the role and two words
        return Exchange({}, 200, whole.headers, begun, {"cut": True})

    return step


@pytest.fixture
async def two(
    tmp_path: Path, nursery: trio.Nursery
) -> AsyncIterator[Callable[[Scripted, Scripted], Awaitable[Daemon]]]:
    """A loopd on two scripted servers, `[server] url` in the order given."""
    started: list[Daemon] = []

    async def start(first: Scripted, second: Scripted) -> Daemon:
        for s in (first, second):
            await nursery.start(s.run)
        d = Daemon(tmp_path / "loopd", first.server.url, slots=NO_SLOT_FILES)
        both = f'url = ["{first.server.url}", "{second.server.url}"]'
        d.config.write_text(d.config.read_text().replace(f'url = "{first.server.url}"', both))
        await d.start()
        started.append(d)
        return d

    yield start
    for d in started:
        await d.end()


async def new_session(d: Daemon) -> tuple[LineClient, str]:
    client = await d.connect()
    return client, await welcome(client, {"type": "hello", "session": "new"})


def moves(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        line["event"]
        for line in lines
        if line["type"] == "event" and line["event"]["kind"] == "moved_to_server"
    ]


FIND = Reply(tool_calls=(("c1", "find_tool", '{"query": "files"}'),))


async def test_a_request_refused_before_output_goes_on_on_the_other_server_mid_turn(
    two: Callable[[Scripted, Scripted], Awaitable[Daemon]],
) -> None:
    """The turn's second request, after a tool call ran, is refused: the other server takes
    it from the log as it stands, and the call is neither run nor recorded twice."""
    a_fake = FakeLlama([FIND])
    a = Scripted([a_fake], refused)
    b = Scripted([], FakeLlama([Reply(content="answered by the second")]))
    d = await two(a, b)
    client, session = await new_session(d)
    lines = await client.turn("t1", "Which tools are there?")
    assert lines[-1]["type"] == "turn_done", lines
    assert lines[-1]["content"] == "answered by the second"
    (moved,) = moves(lines)
    assert (moved["previous"], moved["server"]) == (a.server.url, b.server.url)
    assert moved["reason"] == "loading"
    assert "Loading model" in moved["detail"]
    assert "waiting_for_server" not in kinds(lines)  # moved at once, not after a wait
    assert kinds(lines).count("tool_call_started") == 1
    assert kinds(lines).count("tool_result") == 1
    assert (len(a.requests), len(b.requests)) == (2, 1)

    log = records(d, session)
    assert conversation_problems(log) == []
    assert [type(r) for r in log if isinstance(r, UserRecord | AssistantRecord)] == [
        UserRecord,
        AssistantRecord,
        AssistantRecord,
    ]
    assert len([r for r in log if isinstance(r, ToolResultRecord)]) == 1
    # The second server held nothing of the session: the recompute is recorded, not hidden.
    (loss,) = [r for r in log if isinstance(r, CacheLossRecord)]
    assert loss.cached < loss.expected
    # It was asked the conversation as the log holds it, each message once.
    roles = [m["role"] for m in b.requests[0]["messages"]]
    assert roles[-3:] == ["user", "assistant", "tool"]
    assert roles.count("user") == 1


async def test_a_server_killed_under_a_request_moves_the_turn_and_the_session_stays(
    two: Callable[[Scripted, Scripted], Awaitable[Daemon]],
) -> None:
    """Killed mid-turn: its connection lost, then refused. The session's next turn is
    answered where it moved."""
    a = Scripted([FakeLlama([FIND])], refused)
    a.steps.append(killed(a))
    b = Scripted([], FakeLlama([Reply(content="second"), Reply(content="third")]))
    d = await two(a, b)
    client, session = await new_session(d)
    lines = await client.turn("t1", "Which tools are there?")
    assert lines[-1]["type"] == "turn_done", lines
    assert lines[-1]["content"] == "second"
    (moved,) = moves(lines)
    assert moved["server"] == b.server.url
    assert moved["reason"] == "unreachable"
    lines = await client.turn("t2", "And now?")
    assert lines[-1]["content"] == "third"
    assert not moves(lines)
    assert len(b.requests) == 2
    log = records(d, session)
    assert conversation_problems(log) == []
    assert len([r for r in log if isinstance(r, UserRecord)]) == 2
    assert len([r for r in log if isinstance(r, ToolResultRecord)]) == 1


async def test_a_request_whose_output_had_begun_fails_and_is_not_moved(
    two: Callable[[Scripted, Scripted], Awaitable[Daemon]],
) -> None:
    a = Scripted([cut_after_output(FakeLlama([Reply(content="half of an answer")]))], refused)
    b = Scripted([], FakeLlama([Reply(content="never asked")]))
    d = await two(a, b)
    client, session = await new_session(d)
    lines = await client.turn("t1", "hi")
    assert "content" in kinds(lines)
    assert not moves(lines)
    failed = lines[-1]
    assert (failed["type"], failed["kind"]) == ("turn_failed", "infer")
    assert (len(a.requests), len(b.requests)) == (1, 0)
    assert conversation_problems(records(d, session)) == []


async def test_while_the_other_server_is_busy_the_turn_waits_then_moves_once_it_is_free(
    two: Callable[[Scripted, Scripted], Awaitable[Daemon]],
) -> None:
    """The first session takes the first server's slot and answers slowly; the second
    session's server loads: it waits (as with one server) until the slot comes free."""
    slow = Reply(content=" ".join(["word"] * 30), delay=0.05)
    busy = Scripted([], FakeLlama([slow, Reply(content="the second session's answer")]))
    loading = Scripted([], refused)
    d = await two(busy, loading)
    first, _ = await new_session(d)
    second, session = await new_session(d)
    await first.send({"type": "send", "id": "t1", "content": "a long one"})
    await first.until("event")  # its turn holds the busy server's only slot
    await second.send({"type": "send", "id": "t1", "content": "hi"})
    lines = await until_end(second, "t1")
    assert (await until_end(first, "t1"))[-1]["type"] == "turn_done"
    assert lines[-1]["type"] == "turn_done", lines
    assert lines[-1]["content"] == "the second session's answer"
    assert kinds(lines).index("waiting_for_server") < kinds(lines).index("moved_to_server")
    assert len(loading.requests) >= 2
    assert conversation_problems(records(d, session)) == []


def test_bxctl_chat_and_acp_tell_the_move() -> None:
    moved = MovedToServer(
        previous="http://a:8080", server="http://b:8080", reason="loading", detail="HTTP 503"
    )
    said = "moved to the server at http://b:8080: the one at http://a:8080 is loading its model"
    view = TurnView()
    view.feed(Event(id="t1", event=moved))
    assert [note.plain for note in view.notes] == [f"{said} (HTTP 503)"]
    update = update_of(moved, "s1")
    assert isinstance(update, schema.AgentThoughtChunk)
    assert isinstance(update.content, schema.TextContentBlock)
    assert update.content.text == f"({said} (HTTP 503))\n"
