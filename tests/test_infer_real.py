"""The inference client against a real llama-server running SmolLM2-135M on the CPU."""

from __future__ import annotations

import itertools
from functools import partial

import httpx
import pytest
import trio

from conftest import QWEN_TEMPLATE, QWQ_TEMPLATE, StartLlama
from loopd.infer import (
    BUDGET_MESSAGE,
    THINKING_CAP_GRACE,
    ChatEvent,
    ChatRequest,
    Client,
    Completion,
    ConnectError,
    Content,
    Generation,
    Hit,
    Loss,
    Progress,
    Reasoning,
    Retrying,
    RetryPolicy,
    StreamError,
    ThinkingCapped,
    Timeouts,
    Waiting,
    cache_outcome,
    is_context_full,
    slot_tokens,
)
from loopd.server_proc import free_port

pytestmark = pytest.mark.llama

GREEDY = {"temperature": 0, "seed": 1}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def ask(*turns: str, **kwargs: object) -> ChatRequest:
    messages = [SYSTEM, *({"role": "user", "content": t} for t in turns)]
    return ChatRequest(messages, generation=Generation(sampling=GREEDY, **kwargs))  # type: ignore[arg-type]


def extend(request: ChatRequest, answer: Completion, user: str) -> ChatRequest:
    assistant: dict[str, object] = {"role": "assistant", "content": answer.content or ""}
    if answer.reasoning_content is not None:
        assistant["reasoning_content"] = answer.reasoning_content
    messages = [*request.messages, assistant, {"role": "user", "content": user}]
    return ChatRequest(messages, generation=request.generation)


async def test_real_server_streams_progress_and_content_with_timings(llama: StartLlama) -> None:
    server = await llama()
    events: list[ChatEvent] = []
    async with Client(server.url, timeouts=Timeouts(queued_after=3600)) as client:
        done = await client.chat(ask("Say hello.", max_tokens=16), events.append)
    assert events[0] == Waiting()
    progress = [e for e in events if isinstance(e, Progress)]
    assert progress
    assert progress[-1].processed == progress[-1].total
    assert done.content == "".join(e.text for e in events if isinstance(e, Content))
    assert done.content
    assert done.timings is not None
    assert done.timings.predicted_n > 0


async def test_second_request_on_the_slot_reuses_the_whole_first(llama: StartLlama) -> None:
    """The slot keeps prompt and answer; only the last sampled token is evaluated again."""
    server = await llama()
    async with Client(server.url) as client:
        first_request = ask("Name a colour.", max_tokens=12)
        first = await client.chat(first_request, lambda _: None)
        second = await client.chat(extend(first_request, first, "Another one?"), lambda _: None)
    assert first.timings is not None
    assert second.timings is not None
    t = first.timings
    assert second.timings.cache_n == t.cached + t.prompt_n + t.predicted_n - 1
    assert cache_outcome(first.timings, second.timings) == Hit()


async def test_sent_is_called_once_the_request_is_written_before_any_answer() -> None:
    """A server that reads the request and never answers: `sent` is called while the client
    still waits, so what runs beside a request waits for its writing, not for its answer."""
    written = trio.Event()
    sent = trio.Event()

    async def never_answer(stream: trio.SocketStream) -> None:
        received = b""
        while b"\r\n\r\n" not in received or not received.endswith(b"}"):
            received += await stream.receive_some()
        written.set()
        await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with Client(f"http://127.0.0.1:{port}") as client, trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, never_answer, listeners)
        nursery.start_soon(
            partial(client.chat, ask("Hi", max_tokens=1), lambda _: None, sent=sent.set)
        )
        with trio.fail_after(10):
            await written.wait()
            await sent.wait()
        nursery.cancel_scope.cancel()


async def test_context_full_on_a_real_server(llama: StartLlama) -> None:
    server = await llama(n_ctx=256)
    async with Client(server.url) as client:
        with pytest.raises(Exception) as caught:  # noqa: PT011 - the check is is_context_full
            await client.chat_with_retry(ask("word " * 400, max_tokens=4), lambda _: None)
    assert is_context_full(caught.value)


async def test_a_server_killed_mid_stream_gives_a_typed_error(llama: StartLlama) -> None:
    server = await llama()
    async with Client(server.url) as client:

        def kill_on_first_token(event: ChatEvent) -> None:
            if isinstance(event, Content):
                server.kill()

        with pytest.raises(StreamError):
            await client.chat_with_retry(
                ask("Count to one hundred.", max_tokens=400), kill_on_first_token
            )


async def test_a_server_that_is_down_gives_retrying_then_connect_error() -> None:
    events: list[ChatEvent] = []
    retry = RetryPolicy(attempts=3, base=0.05, cap=0.1)
    async with Client(f"http://127.0.0.1:{free_port()}", retry=retry) as client:
        with pytest.raises(ConnectError):
            await client.chat_with_retry(ask("Hi", max_tokens=4), events.append)
    assert [type(e) for e in events] == [Retrying, Retrying]


async def test_retry_reaches_a_server_that_comes_back(llama: StartLlama) -> None:
    """Down at first, started while the client backs off: the request goes through."""
    port = free_port()
    events: list[ChatEvent] = []
    retry = RetryPolicy(attempts=40, base=0.25, cap=0.5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(llama, 2048, None, port)
        async with Client(f"http://127.0.0.1:{port}", retry=retry) as client:
            done = await client.chat_with_retry(ask("Hi", max_tokens=4), events.append)
    assert any(isinstance(e, Retrying) for e in events)
    assert done.timings is not None


async def test_a_cancelled_request_frees_the_slot(llama: StartLlama) -> None:
    server = await llama()
    async with Client(server.url) as client:
        with trio.CancelScope() as scope:

            def cancel_on_first_token(event: ChatEvent) -> None:
                if isinstance(event, Content):
                    scope.cancel()

            await client.chat(ask("Count to one thousand.", max_tokens=2000), cancel_on_first_token)
        assert scope.cancelled_caught
        async with httpx.AsyncClient(base_url=server.url) as http:
            with trio.fail_after(10):
                # Polling the server's own state: there is nothing local to wait on.
                while (await http.get("/slots")).json()[0]["is_processing"]:  # noqa: ASYNC110
                    await trio.sleep(0.02)
        done = await client.chat(ask("Hi", max_tokens=4), lambda _: None)
    assert done.timings is not None
    assert done.timings.predicted_n > 0


async def test_reasoning_streams_and_the_thinking_cap_stops_it(llama: StartLlama) -> None:
    server = await llama(template=QWQ_TEMPLATE)
    events: list[ChatEvent] = []
    async with Client(server.url) as client:
        free = await client.chat(ask("Why is the sky blue?", max_tokens=60), lambda _: None)
        capped = await client.chat(
            ask("Why is the sky blue?", max_tokens=60, thinking_cap=20), events.append
        )
    assert free.reasoning_tokens > 20 + THINKING_CAP_GRACE  # left alone, it thinks on
    assert not free.thinking_capped
    assert any(isinstance(e, Reasoning) for e in events)
    assert ThinkingCapped(cap=20) in events
    assert capped.thinking_capped
    assert capped.reasoning_content is not None
    assert capped.reasoning_content.endswith(BUDGET_MESSAGE)  # the server's own cut
    assert capped.reasoning_tokens < free.reasoning_tokens
    assert capped.finish_reason != "thinking_cap"


async def test_a_template_that_drops_reasoning_shows_a_cache_loss(llama: StartLlama) -> None:
    server = await llama(template=QWQ_TEMPLATE)
    async with Client(server.url) as client:
        first_request = ask("Name a colour.", max_tokens=12)
        first = await client.chat(first_request, lambda _: None)
        second = await client.chat(extend(first_request, first, "Another?"), lambda _: None)
    assert first.reasoning_content
    assert first.timings is not None
    assert second.timings is not None
    outcome = cache_outcome(first.timings, second.timings)
    assert isinstance(outcome, Loss)
    assert outcome.expected == slot_tokens(first.timings)


async def test_a_template_that_keeps_everything_shows_no_loss(llama: StartLlama) -> None:
    server = await llama(template=QWEN_TEMPLATE)
    async with Client(server.url) as client:
        request = ask("Name a colour.", max_tokens=12)
        answers = []
        for user in ("Another?", "And one more?"):
            answers.append(await client.chat(request, lambda _: None))
            request = extend(request, answers[-1], user)
        answers.append(await client.chat(request, lambda _: None))
    timings = [a.timings for a in answers]
    assert all(t is not None for t in timings)
    for previous, new in itertools.pairwise(timings):
        assert previous is not None
        assert new is not None
        assert cache_outcome(previous, new) == Hit()
