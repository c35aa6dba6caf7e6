"""The inference client against recorded llama-server exchanges, replayed over real HTTP."""

from __future__ import annotations

import json

import pytest
import trio

from conftest import StartReplay
from loopd.infer import (
    BUDGET_MESSAGE,
    THINKING_CAP_GRACE,
    BadAnswer,
    ChatEvent,
    ChatRequest,
    Client,
    ConnectError,
    Content,
    EventSink,
    Generation,
    Hit,
    HttpError,
    InferTimeout,
    Progress,
    Queued,
    Reasoning,
    Retrying,
    RetryPolicy,
    ServerHealth,
    StreamBroken,
    StreamErrorEvent,
    ThinkingCapped,
    Timeouts,
    ToolCallDelta,
    Waiting,
    cache_outcome,
    is_context_full,
)
from loopd.server_proc import free_port
from support.replay import Exchange, ReplayServer

FAST_RETRY = RetryPolicy(attempts=3, base=0.01, cap=0.02)
# Never reports Queued: for tests about the order of events, on a machine however busy.
PATIENT = Timeouts(queued_after=3600)
REQUEST = ChatRequest(
    [{"role": "user", "content": "hi"}], generation=Generation(slot=3, max_tokens=16)
)


def collect() -> tuple[list[ChatEvent], EventSink]:
    events: list[ChatEvent] = []
    return events, events.append


async def test_plain_answer_streams_progress_then_content(replay: StartReplay) -> None:
    server = await replay("plain")
    events, sink = collect()
    async with Client(server.url, timeouts=PATIENT) as client:
        done = await client.chat(REQUEST, sink)
    assert events[0] == Waiting()
    assert any(isinstance(e, Progress) for e in events)
    text = "".join(e.text for e in events if isinstance(e, Content))
    assert text
    assert done.content == text
    assert done.finish_reason in {"stop", "length"}
    assert done.timings is not None
    assert done.timings.prompt_n > 0


async def test_request_pins_the_slot_and_asks_for_cache_progress_and_usage(
    replay: StartReplay,
) -> None:
    server = await replay("plain")
    async with Client(server.url) as client:
        await client.chat(REQUEST, lambda _: None)
    sent = server.requests[0]
    assert sent["path"] == "/v1/chat/completions"
    body = sent["body"]
    assert body["id_slot"] == 3
    assert body["stream"] is True
    assert body["cache_prompt"] is True
    assert body["return_progress"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == REQUEST.messages
    assert body["max_tokens"] == 16


def test_request_body_is_the_same_bytes_every_time() -> None:
    request = ChatRequest(
        [{"role": "user", "content": "é"}], generation=Generation(sampling={"temperature": 0})
    )
    assert request.body() == request.body()
    assert "é".encode() in request.body()


def test_sampling_fields_cannot_override_the_protocol_fields() -> None:
    request = ChatRequest(
        [], generation=Generation(slot=2, sampling={"id_slot": 9, "stream": False, "seed": 4})
    )
    body = json.loads(request.body())
    assert (body["id_slot"], body["stream"], body["seed"]) == (2, True, 4)


async def test_second_turn_reuses_the_cache_of_the_first(replay: StartReplay) -> None:
    server = await replay("second_turn")
    async with Client(server.url) as client:
        first = await client.chat(REQUEST, lambda _: None)
        second = await client.chat(REQUEST, lambda _: None)
    assert first.timings is not None
    assert second.timings is not None
    assert second.timings.cached >= first.timings.cached + first.timings.prompt_n
    assert cache_outcome(first.timings, second.timings) == Hit()


async def test_context_full_is_a_400_that_is_context_full_and_not_retried(
    replay: StartReplay,
) -> None:
    server = await replay("context_full")
    events, sink = collect()
    async with Client(server.url, retry=FAST_RETRY) as client:
        with pytest.raises(HttpError) as caught:
            await client.chat_with_retry(REQUEST, sink)
    assert caught.value.status == 400
    assert is_context_full(caught.value)
    assert not any(isinstance(e, Retrying) for e in events)
    assert len(server.requests) == 1


@pytest.mark.parametrize(("name", "tool"), [("find_tool", "find_tool"), ("call_tool", "call_tool")])
async def test_a_tool_call_arrives_with_its_exact_arguments_string(
    replay: StartReplay, name: str, tool: str
) -> None:
    server = await replay(name)
    events, sink = collect()
    async with Client(server.url) as client:
        done = await client.chat(REQUEST, sink)
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert deltas
    assert deltas[0].name == tool
    assert deltas[0].id
    assert len(done.tool_calls) == 1
    call = done.tool_calls[0]
    assert (call.id, call.name) == (deltas[0].id, tool)
    assert call.arguments == "".join(d.arguments for d in deltas)
    assert done.finish_reason == "tool_calls"


async def test_reasoning_streams_and_the_servers_budget_caps_it(replay: StartReplay) -> None:
    server = await replay("reasoning_cap")
    events, sink = collect()
    request = ChatRequest(REQUEST.messages, generation=Generation(thinking_cap=20))
    async with Client(server.url) as client:
        done = await client.chat(request, sink)
    body = json.loads(request.body())
    assert (body["reasoning_budget_tokens"], body["reasoning_budget_message"]) == (
        20,
        BUDGET_MESSAGE,
    )
    reasoning = [e for e in events if isinstance(e, Reasoning)]
    assert reasoning
    assert done.reasoning_content == "".join(e.text for e in reasoning)
    assert ThinkingCapped(cap=20) in events
    assert events.index(ThinkingCapped(cap=20)) == events.index(reasoning[-1]) + 1
    assert done.thinking_capped
    assert done.finish_reason != "thinking_cap"  # the server ended it, not the client
    assert done.timings is not None


async def test_reasoning_the_server_does_not_stop_is_cut_by_the_client(
    replay: StartReplay,
) -> None:
    server = await replay("reasoning_long")
    events, sink = collect()
    async with Client(server.url) as client:
        done = await client.chat(
            ChatRequest(REQUEST.messages, generation=Generation(thinking_cap=5)), sink
        )
    assert done.finish_reason == "thinking_cap"
    assert done.thinking_capped
    assert done.reasoning_tokens == 5 + THINKING_CAP_GRACE + 1
    assert events.count(ThinkingCapped(cap=5)) == 1
    assert done.timings is None


async def test_no_thinking_cap_without_thinking(replay: StartReplay) -> None:
    server = await replay("reasoning_long")
    async with Client(server.url) as client:
        done = await client.chat(
            ChatRequest(REQUEST.messages, generation=Generation(thinking=False, thinking_cap=5)),
            lambda _: None,
        )
    assert not done.thinking_capped
    assert "reasoning_budget_tokens" not in server.requests[0]["body"]


async def test_503_while_loading_is_retried_with_retrying_events(replay: StartReplay) -> None:
    server = await replay("loading_503", "plain")
    events, sink = collect()
    async with Client(server.url, retry=FAST_RETRY) as client:
        done = await client.chat_with_retry(REQUEST, sink)
    retries = [e for e in events if isinstance(e, Retrying)]
    assert len(retries) == 1
    assert retries[0].attempt == 1
    assert "503" in retries[0].why
    assert 0 < retries[0].delay <= FAST_RETRY.cap
    assert done.content
    assert len(server.requests) == 2


async def test_503_past_the_last_attempt_is_the_error(replay: StartReplay) -> None:
    server = await replay("loading_503", "loading_503", "loading_503", "plain")
    events, sink = collect()
    async with Client(server.url, retry=FAST_RETRY) as client:
        with pytest.raises(HttpError) as caught:
            await client.chat_with_retry(REQUEST, sink)
    assert caught.value.status == 503
    assert [e.attempt for e in events if isinstance(e, Retrying)] == [1, 2]
    assert len(server.requests) == FAST_RETRY.attempts


async def test_a_server_that_is_down_gives_retrying_then_connect_error() -> None:
    events, sink = collect()
    async with Client(f"http://127.0.0.1:{free_port()}", retry=FAST_RETRY) as client:
        with pytest.raises(ConnectError):
            await client.chat_with_retry(REQUEST, sink)
    assert [e.attempt for e in events if isinstance(e, Retrying)] == [1, 2]


async def test_a_connect_error_names_why_the_servers_keeper_says_it_is_away() -> None:
    health = ServerHealth()
    url = f"http://127.0.0.1:{free_port()}"
    async with Client(url, retry=RetryPolicy(attempts=1), health=health) as client:
        health.exited("it exited with status 9")
        with pytest.raises(ConnectError) as away:
            await client.chat_with_retry(REQUEST, collect()[1])
        health.up()
        with pytest.raises(ConnectError) as unknown:
            await client.chat_with_retry(REQUEST, collect()[1])
    assert away.value.down == "it exited with status 9"
    assert "(it exited with status 9)" in str(away.value)
    assert unknown.value.down is None


async def test_an_error_inside_the_stream_is_typed_and_not_retried(replay: StartReplay) -> None:
    server = await replay("stream_error", "plain")
    events, sink = collect()
    async with Client(server.url, retry=FAST_RETRY) as client:
        with pytest.raises(StreamErrorEvent) as caught:
            await client.chat_with_retry(REQUEST, sink)
    assert caught.value.error["type"] == "server_error"
    assert any(isinstance(e, ToolCallDelta) for e in events)  # output was passed on first
    assert not any(isinstance(e, Retrying) for e in events)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("garbage", "event stream"),
        ("bad_chunk", "cannot read"),
        ("no_done", "without \\[DONE\\]"),
        ("cut", "broke"),
    ],
)
async def test_a_broken_stream_is_a_typed_error(
    replay: StartReplay, name: str, message: str
) -> None:
    server = await replay(name)
    async with Client(server.url, retry=FAST_RETRY) as client:
        with pytest.raises(StreamBroken, match=message):
            await client.chat_with_retry(REQUEST, lambda _: None)
    assert len(server.requests) == 1


async def test_an_error_status_with_a_body_that_is_not_json(replay: StartReplay) -> None:
    server = await replay("error_500_text")
    async with Client(server.url) as client:
        with pytest.raises(HttpError) as caught:
            await client.chat(REQUEST, lambda _: None)
    assert caught.value.status == 500
    assert caught.value.error_type() is None
    assert "crashed" in caught.value.body
    assert not is_context_full(caught.value)


async def test_a_server_that_never_answers_is_queued_then_times_out(replay: StartReplay) -> None:
    server = await replay("plain", stall=True)
    events, sink = collect()
    async with Client(server.url, timeouts=Timeouts(queue=0.5)) as client:
        with pytest.raises(InferTimeout):
            await client.chat(REQUEST, sink)
    assert events == [Queued()]


async def test_a_stream_that_goes_silent_times_out(replay: StartReplay) -> None:
    server = await replay("plain", event_delay=30)
    async with Client(server.url, timeouts=Timeouts(read=0.3)) as client:
        with pytest.raises(InferTimeout, match="sent nothing"):
            await client.chat(REQUEST, lambda _: None)


async def test_cancelling_a_request_closes_its_stream_at_once(replay: StartReplay) -> None:
    server = await replay("plain", event_delay=0.05)
    events: list[ChatEvent] = []
    async with Client(server.url) as client:
        with trio.CancelScope() as scope:

            def sink(event: ChatEvent) -> None:
                events.append(event)
                if isinstance(event, Content):
                    scope.cancel()

            await client.chat(REQUEST, sink)
        assert scope.cancelled_caught
        # The server notices the closed connection on its next write.
        with trio.fail_after(5):
            await server.wait_until(lambda: server.broken > 0)
    assert sum(isinstance(e, Content) for e in events) == 1


async def test_a_json_endpoint_without_what_it_is_for_is_a_bad_answer(
    nursery: trio.Nursery,
) -> None:
    """Another server, or another version, on the address: `/detokenize` answers 200 with an
    object that holds no `content`."""
    body = json.dumps({"tokens": [1, 2]})
    server = ReplayServer([Exchange({}, 200, [("content-type", "application/json")], body, {})])
    await nursery.start(server.run)
    async with Client(server.url) as client:
        with pytest.raises(BadAnswer, match="/detokenize answered without content"):
            await client.detokenize([1, 2])
        assert await client.healthy()
        assert (await client.describe()).model == "SmolLM2-135M-Instruct.Q4_1.gguf"
    async with Client(f"http://127.0.0.1:{free_port()}") as nobody:
        assert not await nobody.healthy()
