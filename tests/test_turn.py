"""run_turn over recordings and a scripted llama-server: the exact records of each case."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from loopd.canonical import canonical
from loopd.config import LoopConfig, Policy
from loopd.infer import Client, Content, Repeating, RetryPolicy, ThinkingCapped, ToolCallDelta
from loopd.session.baseline import make_baseline, messages
from loopd.session.records import AssistantRecord, ToolResultRecord, TurnEndRecord, UsageRecord
from loopd.session.store import Session, Store
from loopd.tools import PortHandle, Registry, ToolEntry, ToolFailure, ToolOutput, ToolRequest
from loopd.turn import (
    InferFailed,
    Runtime,
    SessionFull,
    TurnLimit,
    TurnOutcome,
    run_turn,
)
from loopd.turn.calls import REPEAT_TEXT
from loopd.wire.events import CacheLoss, ToolCallStarted, ToolResult, TurnEvent
from support.fake_llama import FakeLlama, Reply
from support.ports import start_port
from support.replay import ReplayServer

NOTE_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}


class Notes:
    """Tools that do what their names say."""

    async def run_tool(self, entry: ToolEntry, request: ToolRequest) -> ToolOutput:
        arguments = request.arguments
        if entry.name == "hang":
            await trio.sleep_forever()
        if entry.name == "broken":
            raise ToolFailure("the notebook is locked")
        if entry.name == "big":
            return ToolOutput("x" * 5000)
        return ToolOutput(f"note {arguments.get('title')}: eggs, milk")


def registry() -> Registry:
    policies = {
        "read_note": Policy(),
        "hang": Policy(),
        "broken": Policy(),
        "big": Policy(),
        "wipe": Policy(action="deny"),
        "buy": Policy(action="ask"),
        "web": Policy(untrusted=True, data_class="private"),
    }
    return Registry(
        ToolEntry(n, f"{n} tool", f"{n} tool", NOTE_SCHEMA, "notes", p) for n, p in policies.items()
    )


def call(tool: str, title: str = "groceries", call_id: str = "c1") -> tuple[str, str, str]:
    return (call_id, "call_tool", json.dumps({"name": tool, "arguments": {"title": title}}))


Turn = Callable[..., Awaitable[TurnOutcome]]
# The records of a turn with one tool call before its answer.
ONE_TOOL_ROUND = ["user", "assistant", "usage", "tool_result", "assistant", "usage", "turn_end"]


class Harness:
    def __init__(
        self, session: Session, server: ReplayServer, client: Client, port: PortHandle
    ) -> None:
        self.session, self.server, self.client, self.port = session, server, client, port
        self.events: list[TurnEvent] = []

    async def turn(
        self,
        content: str = "hello",
        *,
        think: bool | None = None,
        on_event: Callable[[TurnEvent], None] | None = None,
        **loop: Any,
    ) -> TurnOutcome:
        rt = Runtime(
            loop=LoopConfig(**{"tool_result_cap": 1000, **loop}),
            inference=self.client,
            port=self.port,
            registry=self.port.registry,
        )

        def seen(event: TurnEvent) -> None:
            self.events.append(event)
            if on_event is not None:
                on_event(event)

        return await run_turn(self.session, rt, content, seen, thinking=think)

    def kinds(self) -> list[str]:
        return [r.kind for r in self.session.records]

    def results(self) -> list[str]:
        return [r.content for r in self.session.records if isinstance(r, ToolResultRecord)]


@pytest.fixture
async def harness(
    tmp_path: Path, nursery: trio.Nursery
) -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    async def make(*script: Reply | str) -> Harness:
        fake = FakeLlama([r for r in script if isinstance(r, Reply)])
        exchanges: list[Any] = []
        for step in script:
            exchanges += [fake] if isinstance(step, Reply) else ReplayServer.of(step).exchanges
        server = ReplayServer(exchanges)
        await nursery.start(server.run)
        session = await Store(tmp_path).create(make_baseline("Be brief."))
        client = Client(server.url, retry=RetryPolicy(attempts=2, base=0.01, cap=0.01))
        made.append((session, client))
        port = await start_port(
            nursery, registry(), {"notes": Notes()}, timeout=0.3, approval_timeout=0.2
        )
        return Harness(session, server, client, port)

    made: list[tuple[Session, Client]] = []
    yield make
    for session, client in made:
        session.close()
        await client.aclose()


async def test_a_plain_answer(harness: Any) -> None:
    h = await harness("plain")
    outcome = await h.turn()
    assert h.kinds() == ["user", "assistant", "usage", "turn_end"]
    assert outcome.content
    assert outcome.content == "".join(e.text for e in h.events if isinstance(e, Content))
    assert h.session.records[-1] == TurnEndRecord(reason="answer", time=h.session.records[-1].time)


async def test_the_question_is_on_disk_before_any_of_its_answer_is_passed_on(
    harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fsynced, not only written: the line is in the file at once (`Session.add`)."""
    h = await harness("plain")
    log = h.session.path.stat().st_ino
    synced = [0]  # how far the log's fsyncs made it durable
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        real_fsync(fd)
        if os.fstat(fd).st_ino == log:
            synced.append(os.fstat(fd).st_size)

    monkeypatch.setattr(os, "fsync", fsync)
    on_disk: list[bool] = []

    def seen(event: TurnEvent) -> None:
        if isinstance(event, Content):
            data = h.session.path.read_bytes()
            question = data.index(b'"kind":"user"')
            on_disk.append(max(synced) >= data.index(b"\n", question) + 1)

    await h.turn("what is on disk?", on_event=seen)
    assert on_disk
    assert all(on_disk)


async def test_find_tool_then_an_answer(harness: Any) -> None:
    h = await harness(
        Reply(tool_calls=(("c1", "find_tool", '{"query": "read a note"}'),)),
        Reply(content="Use read_note."),
    )
    outcome = await h.turn()
    assert h.kinds() == ONE_TOOL_ROUND
    assert h.results()[0].startswith("Tools for 'read a note', best first:\n1. read_note")
    assert outcome.content == "Use read_note."
    assert not any(isinstance(e, ToolCallDelta) for e in h.events)  # deltas are dropped
    started = [e for e in h.events if isinstance(e, ToolCallStarted)]
    assert started == [ToolCallStarted(name="find_tool", call=1)]


async def test_the_real_find_tool_recording_with_its_broken_arguments(harness: Any) -> None:
    """SmolLM2's real call has unfinished JSON: the model is told so, the turn goes on."""
    h = await harness("find_tool", "plain")
    await h.turn()
    kinds = [k for k in h.kinds() if k != "cache_loss"]  # recordings of separate conversations
    assert kinds == ONE_TOOL_ROUND
    assert "are not valid JSON" in h.results()[0]


async def test_call_tool_then_an_answer(harness: Any) -> None:
    h = await harness(Reply(tool_calls=(call("read_note"),)), Reply(content="Eggs and milk."))
    await h.turn()
    assert h.kinds() == ONE_TOOL_ROUND
    result = h.session.records[3]
    assert isinstance(result, ToolResultRecord)
    assert (result.call, result.tool_call_id, result.name) == (1, "c1", "call_tool")
    assert result.content == "note groceries: eggs, milk"
    assert ToolCallStarted(name="call_tool", call=1, tool="read_note") in h.events
    assert next(e for e in h.events if isinstance(e, ToolResult)).preview == result.content


@pytest.mark.parametrize(
    ("tool", "text"),
    [
        ("broken", "The tool failed: the notebook is locked"),
        ("wipe", "The call was denied: the policy for wipe is deny"),
        ("buy", "The call was denied: nobody approved it within 0.2 s"),
        ("nonexistent", "There is no tool named 'nonexistent'."),
    ],
)
async def test_each_port_answer_becomes_its_text(harness: Any, tool: str, text: str) -> None:
    h = await harness(Reply(tool_calls=(call(tool),)), Reply(content="ok"))
    await h.turn()
    assert h.results()[0].startswith(text)


async def test_an_untrusted_result_is_wrapped_and_marked(harness: Any) -> None:
    h = await harness(Reply(tool_calls=(call("web"),)), Reply(content="ok"))
    await h.turn()
    result = h.session.records[3]
    assert isinstance(result, ToolResultRecord)
    assert result.content == "<untrusted-data>\nnote groceries: eggs, milk\n</untrusted-data>"
    assert (result.untrusted, result.data_class) == (True, "private")


async def test_thinking_by_config_and_for_one_turn(harness: Any) -> None:
    h = await harness(Reply(content="a"), Reply(content="b"), Reply(content="c"))
    await h.turn()
    await h.turn(think=False)
    await h.turn(thinking=False, think=True)
    bodies = [r["body"] for r in h.server.requests]
    asked = [b["chat_template_kwargs"]["enable_thinking"] for b in bodies]
    assert asked == [True, False, True]
    assert ["reasoning_budget_tokens" in b for b in bodies] == [True, False, True]


async def test_templates_that_read_the_date_get_the_sessions_first_day(harness: Any) -> None:
    """Llama 3.x templates write `date_string` into the system prompt: pinned, history as
    messages does not change at midnight."""
    h = await harness(Reply(content="a"))
    await h.turn()
    kwargs = h.server.requests[0]["body"]["chat_template_kwargs"]
    assert kwargs["date_string"] == h.session.header.created.strftime("%d %b %Y")


async def test_a_failed_request_appends_nothing(harness: Any) -> None:
    h = await harness(Reply(kind="server_error"))
    with pytest.raises(InferFailed, match="HTTP 500"):
        await h.turn()
    assert h.kinds() == ["user", "turn_end"]
    assert h.session.records[-1].reason == "error"


async def test_an_error_inside_the_stream_keeps_what_came_as_an_answer_cut_short(
    harness: Any,
) -> None:
    h = await harness(Reply(content="half an", kind="stream_error"))
    with pytest.raises(InferFailed):
        await h.turn()
    assert h.kinds() == ["user", "assistant", "usage", "turn_end"]
    answer = h.session.records[1]
    assert isinstance(answer, AssistantRecord)
    assert (answer.content, answer.cut, answer.ended) == ("half an", "error", False)


async def test_every_request_extends_the_previous_one(harness: Any) -> None:
    h = await harness(
        Reply(tool_calls=(call("read_note"), call("big", call_id="c2"))),
        Reply(content="done"),
        Reply(content="second turn"),
    )
    await h.turn()
    await h.turn("and now?")
    sent = [canonical(r["body"]["messages"]) for r in h.server.requests]
    bodies = [r["body"]["messages"] for r in h.server.requests]
    for earlier, later in itertools.pairwise(bodies):
        assert canonical(later[: len(earlier)]) == canonical(earlier)
    assert len(sent) == 3
    assert canonical(messages(h.session.baseline, h.session.records)[: len(bodies[-1])]) == sent[-1]
    assert not any(isinstance(e, CacheLoss) for e in h.events)
    assert "cache_loss" not in h.kinds()


# -- the limits, one test each ---------------------------------------------------------------


async def test_limit_tool_iterations(harness: Any) -> None:
    rounds = [Reply(tool_calls=(call("read_note", f"n{i}", f"c{i}"),)) for i in range(3)]
    h = await harness(*rounds)
    with pytest.raises(TurnLimit, match="tool_iterations"):
        await h.turn(tool_iterations=2)
    assert h.kinds().count("assistant") == 3
    assert h.results()[-1] == "Not run: the turn ended first (turn limit)."
    assert h.kinds()[-2:] == ["tool_result", "turn_end"]


async def test_limit_tool_iterations_not_reached_with_more_allowed(harness: Any) -> None:
    rounds = [Reply(tool_calls=(call("read_note", f"n{i}", f"c{i}"),)) for i in range(3)]
    h = await harness(*rounds, Reply(content="done"))
    assert (await h.turn(tool_iterations=3)).content == "done"


async def test_limit_repeated_call(harness: Any) -> None:
    same = call("read_note")
    h = await harness(
        Reply(tool_calls=(same,)), Reply(tool_calls=(same,)), Reply(tool_calls=(same,))
    )
    with pytest.raises(TurnLimit, match="third time"):
        await h.turn()
    assert h.results() == [
        "note groceries: eggs, milk",
        REPEAT_TEXT,
        "Not run: the turn ended first (turn limit).",
    ]


async def test_limit_repeated_call_sees_through_spacing_and_key_order(harness: Any) -> None:
    one = ("c1", "call_tool", '{"name": "read_note", "arguments": {"title": "groceries"}}')
    two = ("c2", "call_tool", '{ "arguments" : {"title":"groceries"}, "name":"read_note" }')
    h = await harness(Reply(tool_calls=(one,)), Reply(tool_calls=(two,)), Reply(content="ok"))
    await h.turn()
    assert h.results() == ["note groceries: eggs, milk", REPEAT_TEXT]


async def test_limit_repeated_call_off_runs_every_call(harness: Any) -> None:
    same = call("read_note")
    h = await harness(*[Reply(tool_calls=(same,))] * 3, Reply(content="done"))
    await h.turn(repeat_detection=False)
    assert h.results() == ["note groceries: eggs, milk"] * 3


async def test_limit_thinking_cap(harness: Any) -> None:
    h = await harness("reasoning_long")
    with pytest.raises(TurnLimit, match="thinking_cap"):  # recorded: it thought on, unanswered
        await h.turn(thinking_cap=5)
    usage = next(r for r in h.session.records if isinstance(r, UsageRecord))
    assert usage.thinking_capped
    assert ThinkingCapped(cap=5) in h.events
    assert json.loads(json.dumps(h.server.requests[0]["body"]))["reasoning_budget_tokens"] == 5


async def test_limit_thinking_cap_cut_by_loopd_is_a_limit_not_an_empty_answer(
    harness: Any,
) -> None:
    endless = " ".join(["hmm"] * 100)  # a server that ignores the reasoning budget
    h = await harness(Reply(reasoning=endless, content="too late"))
    with pytest.raises(TurnLimit, match=r"thought past 5 tokens without an answer"):
        await h.turn(thinking_cap=5)
    assert h.kinds() == ["user", "assistant", "usage", "turn_end"]
    assistant = h.session.records[1]
    assert isinstance(assistant, AssistantRecord)
    assert assistant.reasoning_content  # what it thought is kept
    assert not assistant.content
    assert h.session.records[-1].reason == "turn_limit"


async def test_limit_an_answer_that_repeats_itself_is_cut(harness: Any) -> None:
    loop = "Hello! " + "She loves her cat. " * 400  # 7,600 characters, a loop from the start
    h = await harness(Reply(content=loop), Reply(content="Fine."))
    with pytest.raises(TurnLimit, match=r"same text over and over for 1000 characters"):
        await h.turn(repetition_cap=1000)
    assert h.kinds() == ["user", "assistant", "usage", "turn_end"]
    assistant = h.session.records[1]
    assert isinstance(assistant, AssistantRecord)
    assert assistant.content is not None
    # What was said up to the cut stays in the log; the rest was never read.
    assert assistant.content.startswith("Hello! She loves her cat.")
    assert 1000 <= len(assistant.content) < 1200
    assert [e.period for e in h.events if isinstance(e, Repeating)] == [19]
    assert h.session.records[-1].reason == "turn_limit"
    assert (await h.turn(repetition_cap=1000)).content == "Fine."  # the session goes on


async def test_no_repetition_cap_lets_a_loop_run_to_its_end(harness: Any) -> None:
    loop = "She loves her cat. " * 200
    h = await harness(Reply(content=loop))
    assert (await h.turn(repetition_cap=0)).content == loop


async def test_limit_context_full(harness: Any) -> None:
    h = await harness("context_full")
    with pytest.raises(SessionFull, match="exceeds the available context size"):
        await h.turn()
    assert h.kinds() == ["user", "turn_end"]
    assert h.session.records[-1].reason == "session_full"


async def test_limit_tool_result_size(harness: Any) -> None:
    h = await harness(Reply(tool_calls=(call("big"),)), Reply(content="ok"))
    await h.turn(tool_result_cap=100)
    result = h.session.records[3]
    assert isinstance(result, ToolResultRecord)
    assert result.truncated
    assert result.content == "x" * 50 + "\n[... 4900 characters cut here ...]\n" + "x" * 50
    assert [e.truncated for e in h.events if isinstance(e, ToolResult)] == [True]


async def test_limit_tool_timeout(harness: Any) -> None:
    h = await harness(Reply(tool_calls=(call("hang"),)), Reply(content="ok"))
    await h.turn()
    assert h.results() == ["The tool failed: hang did not finish within 0.3 s and was stopped"]


async def test_limit_turn_timeout(harness: Any) -> None:
    h = await harness(Reply(kind="stall"))
    with pytest.raises(TurnLimit, match="turn_timeout"):
        await h.turn(turn_timeout=0.5)
    assert h.kinds() == ["user", "turn_end"]
    assert h.session.records[-1].reason == "turn_limit"


async def test_a_turn_cancelled_from_outside_leaves_a_valid_log(
    harness: Any, tmp_path: Path
) -> None:
    h = await harness(Reply(tool_calls=(call("hang"), call("read_note", call_id="c2"))))
    with trio.CancelScope() as scope:

        def cancel_once_hanging(event: TurnEvent) -> None:
            if isinstance(event, ToolCallStarted) and event.tool == "hang":
                scope.cancel()

        await h.turn(on_event=cancel_once_hanging)
    assert h.kinds() == ["user", "assistant", "usage", "tool_result", "tool_result", "turn_end"]
    assert h.results() == ["Not run: the turn ended first (cancelled)."] * 2
    assert h.session.records[-1].reason == "cancelled"
    answered = {r.tool_call_id for r in h.session.records if isinstance(r, ToolResultRecord)}
    calls = next(r for r in h.session.records if isinstance(r, AssistantRecord)).tool_calls
    assert answered == {c.id for c in calls}
