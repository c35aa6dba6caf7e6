"""An answer cut short as it streamed (a cancel, the turn's deadline, a server whose stream
broke) is kept as far as it came, on a scripted llama-server: what came and nothing more, a
valid conversation with a call begun, a whole call, or open reasoning, and the model sees it in
the next request. The real llama-server's side (token ids, the slot): test_cut_real.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from bxctl.acp_map import replayed
from loopd.config import LoopConfig
from loopd.infer import Client, Content, Reasoning, RetryPolicy
from loopd.session.baseline import make_baseline
from loopd.session.records import (
    AssistantRecord,
    Record,
    ToolResultRecord,
    UsageRecord,
    conversation_problems,
)
from loopd.session.store import Session, Store
from loopd.session.transcript import transcript
from loopd.turn import InferFailed, Runtime, TurnLimit, run_turn
from loopd.wire.events import TurnEvent
from support.fake_llama import SSE, FakeLlama, Reply
from support.ports import NoTools
from support.replay import Exchange, ReplayServer

LOOKUP = json.dumps({"name": "read_file", "arguments": {"path": "notes.txt"}})


def chunk(delta: dict[str, Any], **extra: Any) -> str:
    body = {"choices": [{"finish_reason": None, "index": 0, "delta": delta}], **extra}
    return f"data: {json.dumps(body)}\n\n"


def broken(*deltas: dict[str, Any]) -> Exchange:
    """A stream of `deltas` after the prompt's progress, then the connection dropped."""
    progress = {"total": 40, "cache": 0, "processed": 40, "time_ms": 1}
    body = chunk({"role": "assistant", "content": None}, prompt_progress=progress)
    body += "".join(chunk(d) for d in deltas)
    return Exchange({}, 200, SSE, body, {"cut": True})


def call_piece(index: int, **fields: Any) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, **fields}]}


Turn = Callable[..., Awaitable[Any]]


class Harness:
    def __init__(self, session: Session, client: Client, fake: FakeLlama) -> None:
        self.session, self.client, self.fake = session, client, fake

    async def turn(
        self,
        content: str = "hello",
        on_event: Callable[[TurnEvent], None] = lambda _: None,
        **loop: Any,
    ) -> Any:
        rt = Runtime(loop=LoopConfig(**loop), inference=self.client, port=NoTools(),
                     registry=NoTools.registry)  # fmt: skip
        return await run_turn(self.session, rt, content, on_event)

    @property
    def records(self) -> list[Record]:
        return list(self.session.records)

    def kinds(self) -> list[str]:
        return [r.kind for r in self.session.records]

    def answer(self, index: int = 0) -> AssistantRecord:
        return [r for r in self.session.records if isinstance(r, AssistantRecord)][index]


@pytest.fixture
async def harness(
    tmp_path: Path, nursery: trio.Nursery
) -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    made: list[Harness] = []

    async def make(*script: Reply | Exchange) -> Harness:
        fake = FakeLlama([r for r in script if isinstance(r, Reply)])
        server = ReplayServer([fake if isinstance(s, Reply) else s for s in script])
        await nursery.start(server.run)
        session = await Store(tmp_path).create(make_baseline("Be brief."))
        client = Client(server.url, retry=RetryPolicy(attempts=1))
        made.append(h := Harness(session, client, fake))
        return h

    yield make
    for h in made:
        h.session.close()
        await h.client.aclose()


async def test_a_cancelled_answer_is_kept_cut_short_as_far_as_it_came(harness: Any) -> None:
    h = await harness(Reply(content="one two three four five six", delay=0.2), Reply(content="ok"))
    shown: list[str] = []
    with trio.CancelScope() as scope:

        def cancel_at_the_first_words(event: TurnEvent) -> None:
            if isinstance(event, Content):
                shown.append(event.text)
                scope.cancel()

        await h.turn(on_event=cancel_at_the_first_words)
    assert h.kinds() == ["user", "assistant", "usage", "turn_end"]
    cut = h.answer()
    assert (cut.content, cut.cut, cut.ended, cut.tool_calls) == ("one", "cancelled", False, ())
    assert shown == ["one"]  # what the person saw, and nothing that never streamed
    usage = h.records[2]
    assert isinstance(usage, UsageRecord)
    assert usage.timings is not None
    assert usage.timings.predicted_n == 1  # the prompt's figures from its progress, one piece
    assert conversation_problems(h.records) == []


async def test_the_model_sees_the_cut_answer_in_the_next_request(harness: Any) -> None:
    h = await harness(Reply(content="one two three four five six", delay=0.2), Reply(content="ok"))
    with trio.CancelScope() as scope:
        await h.turn(on_event=lambda e: scope.cancel() if isinstance(e, Content) else None)
    await h.turn("go on")
    sent = h.fake.bodies[1]["messages"]
    assert sent[-2:] == [
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "go on"},
    ]
    assert conversation_problems(h.records) == []


async def test_an_answer_cut_at_the_turns_deadline_is_kept_as_cut_by_it(harness: Any) -> None:
    h = await harness(Reply(content=" ".join(["slowly"] * 50), delay=0.1))
    seen: list[str] = []
    with pytest.raises(TurnLimit, match="turn_timeout"):
        await h.turn(on_event=lambda e: seen.append(e.text) if isinstance(e, Content) else None,
                     turn_timeout=1.0)  # fmt: skip
    assert h.kinds() == ["user", "assistant", "usage", "turn_end"]
    cut = h.answer()
    assert cut.cut == "turn_limit"
    assert cut.content == "".join(seen) != ""
    assert conversation_problems(h.records) == []


async def test_a_call_begun_when_the_stream_broke_is_no_call_and_none_is_left_open(
    harness: Any,
) -> None:
    h = await harness(
        broken(
            {"content": "Let me look."},
            call_piece(
                0, id="c1", type="function", function={"name": "call_tool", "arguments": ""}
            ),
            call_piece(0, function={"arguments": LOOKUP[:20]}),
        )
    )
    with pytest.raises(InferFailed):
        await h.turn()
    assert h.kinds() == ["user", "assistant", "usage", "turn_end"]
    cut = h.answer()
    assert (cut.content, cut.tool_calls, cut.cut) == ("Let me look.", (), "error")
    assert conversation_problems(h.records) == []


async def test_a_whole_call_of_a_cut_answer_is_answered_and_never_run(harness: Any) -> None:
    h = await harness(
        broken(
            call_piece(
                0, id="c1", type="function", function={"name": "call_tool", "arguments": ""}
            ),
            call_piece(0, function={"arguments": LOOKUP}),
            call_piece(
                1, id="c2", type="function", function={"name": "call_tool", "arguments": ""}
            ),
            call_piece(1, function={"arguments": LOOKUP[:9]}),
        )
    )
    with pytest.raises(InferFailed):
        await h.turn()
    assert h.kinds() == ["user", "assistant", "usage", "tool_result", "turn_end"]
    assert [c.id for c in h.answer().tool_calls] == ["c1"]
    result = h.records[3]
    assert isinstance(result, ToolResultRecord)
    assert (result.tool_call_id, result.content) == ("c1", "Not run: the turn ended first (error).")
    assert conversation_problems(h.records) == []


async def test_an_answer_cut_inside_its_reasoning_keeps_the_reasoning_open(
    harness: Any,
) -> None:
    h = await harness(
        broken({"reasoning_content": "The user"}, {"reasoning_content": " asks"}),
        Reply(content="ok"),
    )
    thought: list[str] = []
    with pytest.raises(InferFailed):
        await h.turn(
            on_event=lambda e: thought.append(e.text) if isinstance(e, Reasoning) else None
        )
    cut = h.answer()
    assert (cut.reasoning_content, cut.content, cut.cut) == ("The user asks", None, "error")
    assert "".join(thought) == cut.reasoning_content
    await h.turn("again")  # the next request goes, the cut answer in it
    assert h.fake.bodies[0]["messages"][-2] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "The user asks",
    }
    assert conversation_problems(h.records) == []


def test_bxctl_log_and_an_editors_replay_mark_a_cut_answer() -> None:
    records: list[Record] = [
        AssistantRecord(content="Once upon", cut="cancelled"),
        AssistantRecord(content="A whole answer."),
    ]
    lines = [line.plain for line in transcript(records)]
    assert lines == [
        "model: Once upon",
        "  (answer cut short: cancelled)",
        "model: A whole answer.",
    ]
    said = [u.content.text for u in replayed(records)]  # type: ignore[union-attr]
    assert said == ["Once upon", "\n\n(answer cut short: cancelled)", "A whole answer."]
