"""The stream assembler on its own: chunks in, events and a completion out."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loopd.infer import (
    BUDGET_MESSAGE,
    Content,
    Progress,
    StreamBroken,
    StreamErrorEvent,
    ThinkingCapped,
    ToolCallDelta,
)
from loopd.infer._assemble import THINKING_CAP_GRACE, Assembler


def chunk(delta: dict[str, Any] | None = None, **extra: Any) -> str:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": None}]
    return json.dumps({"choices": choices, "object": "chat.completion.chunk", **extra})


def test_content_pieces_join_into_the_answer() -> None:
    a = Assembler()
    events = [e for text in ("Hel", "lo", "!") for e in a.feed(chunk({"content": text}))]
    assert events == [Content(text="Hel"), Content(text="lo"), Content(text="!")]
    assert a.completion().content == "Hello!"


def test_no_content_at_all_is_none_not_empty() -> None:
    a = Assembler()
    a.feed(chunk({"role": "assistant", "content": None}))
    assert a.completion().content is None
    assert a.completion().reasoning_content is None


def test_prompt_progress_becomes_progress_events() -> None:
    a = Assembler()
    progress = {"total": 30, "cache": 10, "processed": 20, "time_ms": 3.5}
    assert a.feed(chunk(prompt_progress=progress)) == [Progress(total=30, cache=10, processed=20)]


def test_timings_are_taken_from_the_last_chunk_that_has_them() -> None:
    a = Assembler()
    timings = {
        "cache_n": 4,
        "prompt_n": 9,
        "prompt_ms": 1.5,
        "predicted_n": 3,
        "predicted_ms": 2.0,
        "prompt_per_second": 6000.0,
    }
    a.feed(chunk({}, timings=timings))
    done = a.completion()
    assert done.timings is not None
    assert (done.timings.cache_n, done.timings.prompt_n, done.timings.predicted_n) == (4, 9, 3)


def test_finish_reason_is_kept() -> None:
    a = Assembler()
    a.feed(json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
    assert a.completion().finish_reason == "length"


def test_tool_call_id_and_name_are_set_whole_and_arguments_appended() -> None:
    a = Assembler()
    pieces = [
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "find", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"query": '}},
        # The parser revised its mind: id and name come again, whole.
        {"index": 0, "id": "c1b", "function": {"name": "find_tool"}},
        {"index": 0, "function": {"arguments": '"files"}'}},
        {"index": 1, "id": "c2", "function": {"name": "call_tool", "arguments": "{}"}},
    ]
    events = [e for p in pieces for e in a.feed(chunk({"tool_calls": [p]}))]
    assert events[0] == ToolCallDelta(index=0, id="c1", name="find", arguments="")
    assert events[2] == ToolCallDelta(index=0, id="c1b", name="find_tool", arguments="")
    calls = a.completion().tool_calls
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("c1b", "find_tool", '{"query": "files"}'),
        ("c2", "call_tool", "{}"),
    ]


def test_arguments_string_is_kept_exactly_as_received() -> None:
    """Whitespace, key order and escapes survive: the string is never re-dumped."""
    raw = '{ "b":1,  "a" : "\\u00e9\\n" }'
    a = Assembler()
    a.feed(chunk({"tool_calls": [{"index": 0, "id": "x", "function": {"name": "t"}}]}))
    for i in range(0, len(raw), 3):
        a.feed(chunk({"tool_calls": [{"index": 0, "function": {"arguments": raw[i : i + 3]}}]}))
    assert a.completion().tool_calls[0].arguments == raw


def test_reasoning_the_server_capped_is_known_by_its_budget_message() -> None:
    a = Assembler(thinking_cap=3)
    pieces = ["hm", " so", " then", *(BUDGET_MESSAGE[i : i + 5] for i in range(0, 30, 5))]
    events = [e for p in pieces for e in a.feed(chunk({"reasoning_content": p}))]
    assert ThinkingCapped(cap=3) not in events  # not known until the reasoning ends
    events = a.feed(chunk({"content": "Answer"}))
    assert events == [ThinkingCapped(cap=3), Content(text="Answer")]
    done = a.completion()
    assert done.thinking_capped
    assert done.reasoning_content is not None
    assert done.reasoning_content.endswith(BUDGET_MESSAGE)


def test_capped_reasoning_at_the_very_end_of_the_stream() -> None:
    a = Assembler(thinking_cap=3)
    a.feed(chunk({"reasoning_content": "hm" + BUDGET_MESSAGE}))
    assert a.finish() == [ThinkingCapped(cap=3)]
    assert a.completion().thinking_capped


def test_reasoning_that_ends_by_itself_is_not_capped() -> None:
    a = Assembler(thinking_cap=10)
    for _ in range(8):
        a.feed(chunk({"reasoning_content": "short"}))
    assert a.feed(chunk({"content": "Answer"})) == [Content(text="Answer")]
    assert a.finish() == []
    assert not a.completion().thinking_capped


def test_reasoning_past_the_cap_and_its_grace_must_be_cut() -> None:
    a = Assembler(thinking_cap=2)
    for _ in range(2 + THINKING_CAP_GRACE):
        a.feed(chunk({"reasoning_content": "x"}))
    assert a.past_limit() is None
    a.feed(chunk({"reasoning_content": "x"}))
    assert a.past_limit() == [ThinkingCapped(cap=2)]
    done = a.completion(cut_by_client=True)
    assert done.finish_reason == "thinking_cap"
    assert done.thinking_capped


def test_without_a_cap_nothing_is_capped() -> None:
    a = Assembler()
    for _ in range(100):
        a.feed(chunk({"reasoning_content": "x" + BUDGET_MESSAGE}))
    assert a.past_limit() is None
    assert a.finish() == []


def test_an_error_chunk_raises_with_the_servers_error() -> None:
    a = Assembler()
    error = {"code": 500, "message": "boom", "type": "server_error"}
    with pytest.raises(StreamErrorEvent, match="boom") as caught:
        a.feed(json.dumps({"error": error}))
    assert caught.value.error == error


@pytest.mark.parametrize(
    "data",
    ["{not json", "[1, 2]", '{"choices": [{"delta": {"content": 5}}]}', '{"choices": 3}'],
)
def test_a_chunk_of_the_wrong_shape_is_a_broken_stream(data: str) -> None:
    with pytest.raises(StreamBroken, match="cannot read"):
        Assembler().feed(data)
