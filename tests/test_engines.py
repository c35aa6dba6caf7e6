"""The engines behind `Client`: vLLM's `/v1/completions` stream read into the same events and
completion as llama-server's, any OpenAI-compatible server's figures read honestly, the engine
found from the server itself, and every bad answer a typed error. The streams are shaped as
vLLM 0.32 and llama-server send them (see tests/test_vllm_real.py for the real one); the
server is `support.fake_engine`, real HTTP on loopback."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from loopd.infer import (
    Access,
    BadAnswer,
    ChatRequest,
    Client,
    Completion,
    ConnectionLost,
    Content,
    Generation,
    Hit,
    HttpError,
    Loss,
    PromptRequest,
    StreamBroken,
    StreamErrorEvent,
    Timings,
    Unreported,
    _stream,
    cache_limit,
    cache_outcome,
    is_context_full,
)
from loopd.infer._grammar import structural_tag
from loopd.session.records import conversation_problems
from support.daemon import Daemon
from support.fake_engine import Answer, fake_engine
from support.formats import QWEN, QWEN_CODER
from test_sessions import records, welcome

MODELS = {"object": "list", "data": [{"id": "smol", "owned_by": "vllm", "max_model_len": 4096}]}
METRICS = (
    'vllm:cache_config_info{block_size="32",enable_prefix_caching="True"} 1.0\n'
    "process_start_time_seconds 1796041000.5\n"
)
KEY = "sk-loopd-test-0123456789"


def piece(text: str, ids: list[int] | None, finish: str | None = None, stop: Any = None) -> Any:
    choice = {"index": 0, "text": text, "finish_reason": finish, "stop_reason": stop}
    if ids is not None:
        choice["token_ids"] = ids
    return {"object": "text_completion", "choices": [choice]}


def usage(prompt: int, completion: int, cached: int | None) -> Any:
    details = {} if cached is None else {"prompt_tokens_details": {"cached_tokens": cached}}
    return {
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, **details},
    }


def chatml(body: dict[str, Any]) -> str:
    """What a `/tokenize` request holds as text: its prompt, or its messages rendered as
    ChatML (a stand-in for a chat template; one character a token)."""
    if "prompt" in body:
        return str(body["prompt"])
    text = "".join(
        f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in body["messages"]
    )
    return text + ("<|im_start|>assistant\n" if body.get("add_generation_prompt") else "")


def vllm_routes(stream: Answer) -> dict[str, Any]:
    return {
        "/props": Answer.of({"detail": "Not Found"}, 404),
        "/v1/models": Answer.of(MODELS),
        "/metrics": Answer(200, METRICS.encode(), "text/plain"),
        "/tokenize": lambda body: Answer.of({"tokens": [ord(c) for c in chatml(body)]}),
        "/detokenize": lambda body: Answer.of({"prompt": "".join(map(chr, body["tokens"]))}),
        "/v1/completions": stream,
    }


def prompt_request(**generation: Any) -> PromptRequest:
    return PromptRequest(
        prompt=["ab", 7, 8, "c"], format=QWEN, generation=Generation(affinity="s1", **generation)
    )


async def vllm_completion(stream: Answer, **access: Any) -> tuple[Completion, Any]:
    with fake_engine(vllm_routes(stream)) as server:
        async with Client(server.url, access=Access(**access)) as client:
            client.be(await client.identify())
            await client.describe()
            done = await client.chat(prompt_request(), lambda _: None)
        return done, server


async def test_vllm_answer_keeps_its_token_ids_and_the_cache_figure_in_blocks() -> None:
    stream = Answer.events(
        piece("Hel", [10]),
        piece("lo", [11]),
        piece("", [2], finish="stop"),  # the end token: its id, no text
        usage(prompt=40, completion=3, cached=32),
    )
    done, server = await vllm_completion(stream, engine="vllm")
    assert done.content == "Hello"
    assert done.tokens == (10, 11, 2)
    assert done.ended
    assert done.finish_reason == "stop"
    assert done.timings is not None
    assert (done.timings.cache_n, done.timings.prompt_n, done.timings.predicted_n) == (32, 8, 3)
    assert done.timings.block == 32
    # The prompt went as ids alone: its texts tokenized by the server, without special tokens.
    body = server.bodies("/v1/completions")[0]
    assert body["prompt"] == [ord("a"), ord("b"), 7, 8, ord("c")]
    assert body["return_token_ids"] is True
    assert body["model"] == "smol"
    assert body["max_tokens"] == 4096 - 5  # vLLM's own default is 16
    assert not {"id_slot", "n_predict"} & set(body)  # llama-server's own fields
    assert server.bodies("/tokenize")[0] == {
        "prompt": "ab",
        "add_special_tokens": False,
        "model": "smol",
    }


async def test_vllm_tool_call_in_the_raw_output_becomes_a_call() -> None:
    raw = '<tool_call>\n{"name": "find_tool", "arguments": {"query": "time"}}\n</tool_call>'
    pieces = [piece(c, [100 + n]) for n, c in enumerate(raw)]
    stream = Answer.events(*pieces, piece("", [2], finish="stop"), usage(10, len(raw) + 1, 0))
    done, _ = await vllm_completion(stream, engine="vllm")
    assert [(c.name, c.arguments) for c in done.tool_calls] == [("find_tool", '{"query": "time"}')]
    assert done.finish_reason == "tool_calls"
    assert len(done.tokens or ()) == len(raw) + 1


async def test_vllm_answer_cut_by_max_tokens_did_not_end() -> None:
    stream = Answer.events(piece("a", [10]), piece("b", [11], finish="length"), usage(5, 2, 0))
    done, _ = await vllm_completion(stream, engine="vllm")
    assert (done.finish_reason, done.ended) == ("length", False)


async def test_text_without_token_ids_is_a_broken_stream() -> None:
    """An answer the next prompt could not extend (a vLLM older than `return_token_ids`)."""
    with pytest.raises(StreamBroken, match="without its token ids"):
        await vllm_completion(Answer.events(piece("Hi", None)), engine="vllm")


async def test_a_stream_cut_mid_token_is_a_lost_connection() -> None:
    stream = Answer.events(piece("Hel", [10]), cut='data: {"choices": [{"index": 0, "text": "lo')
    with pytest.raises(ConnectionLost):
        await vllm_completion(stream, engine="vllm")


async def test_an_error_inside_the_stream_is_typed() -> None:
    error = {"error": {"message": "Token id 99999 is out of vocabulary", "code": 400}}
    with pytest.raises(StreamErrorEvent, match="out of vocabulary"):
        await vllm_completion(Answer.events(error), engine="vllm")


async def test_a_400_without_json_is_an_http_error() -> None:
    stream = Answer(400, b"<html>bad request</html>", "text/html")
    with pytest.raises(HttpError) as raised:
        await vllm_completion(stream, engine="vllm")
    assert raised.value.status == 400
    assert not is_context_full(raised.value)
    assert raised.value.error_type() is None


def test_vllms_words_for_a_full_context_are_a_full_context() -> None:
    too_long = (
        '{"error":{"message":"This model\'s maximum context length is 4096 tokens. However, '
        'your prompt contains 5000 input tokens","type":"BadRequestError","code":400}}'
    )
    exactly = '{"error":{"message":"max_tokens must be at least 1, got 0.","code":400}}'
    assert is_context_full(HttpError(400, too_long))
    assert is_context_full(HttpError(400, exactly))
    assert not is_context_full(HttpError(500, too_long))


def test_the_cache_limit_is_block_grained_and_never_the_last_token() -> None:
    previous = Timings(cache_n=0, prompt_n=794, prompt_ms=1, predicted_n=10, predicted_ms=1)
    new = Timings(cache_n=800, prompt_n=20, prompt_ms=1, predicted_n=1, predicted_ms=1, block=32)
    assert cache_limit(previous, new) == 800  # 794 + 10 - 1 = 803 held, 25 blocks whole
    assert cache_outcome(previous, new) == Hit()
    short = new.model_copy(update={"cache_n": 768, "prompt_n": 52})
    assert cache_outcome(previous, short) == Loss(expected=800, cached=768)
    # A prompt of 800 tokens, fewer than were held: its last is computed, so a block less.
    again = Timings(cache_n=768, prompt_n=32, prompt_ms=1, predicted_n=1, predicted_ms=1, block=32)
    assert cache_limit(previous, again) == 768
    per_token = new.model_copy(update={"block": None, "cache_n": 800})
    assert cache_outcome(previous, per_token) == Loss(expected=803, cached=800)


def openai_routes(stream: Answer) -> dict[str, Any]:
    models = {"data": [{"id": "gpt-x", "owned_by": "someone"}]}
    return {"/v1/models": Answer.of(models), "/v1/chat/completions": stream}


async def test_an_openai_compatible_answer_without_cache_figures_says_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]},
        {"choices": [{"index": 0, "delta": {"reasoning": "hm"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2}},
    ]
    events: list[Any] = []
    with fake_engine(openai_routes(Answer.events(*chunks))) as server:
        access = Access(api_key=KEY, affinity_header="X-Session-ID")
        async with Client(server.url, access=access) as client:
            client.be(await client.identify())
            assert client.engine.name == "openai"
            assert (await client.describe()).model == "gpt-x"
            request = ChatRequest(
                [{"role": "user", "content": "hi"}],
                tools=[{"type": "function", "function": {"name": "t", "parameters": {}}}],
                generation=Generation(slot=2, max_tokens=9, affinity="s1", sampling={"seed": 1}),
            )
            done = await client.chat(request, events.append)
    assert (done.content, done.reasoning_content) == ("Hi", "hm")
    assert done.timings is not None
    assert done.timings.cache_n is None
    assert cache_outcome(done.timings, done.timings) == Unreported()
    assert [e.text for e in events if isinstance(e, Content)] == ["Hi"]
    body = server.bodies("/v1/chat/completions")[0]
    assert set(body) == {
        "model",
        "messages",
        "tools",
        "stream",
        "stream_options",
        "max_tokens",
        "seed",
    }
    chat = next(s for s in server.seen if s.path == "/v1/chat/completions")
    assert chat.headers["authorization"] == f"Bearer {KEY}"
    assert chat.headers["x-session-id"] == "s1"
    assert all(s.headers.get("authorization") == f"Bearer {KEY}" for s in server.seen)
    assert KEY not in caplog.text
    assert KEY not in repr(access)


async def test_the_engine_is_found_from_the_server() -> None:
    llama: dict[str, Any] = {"/props": Answer.of({"default_generation_settings": {}})}
    vllm = vllm_routes(Answer.events())
    other = openai_routes(Answer.events())
    for routes, name in ((llama, "llama"), (vllm, "vllm"), (other, "openai")):
        with fake_engine(routes) as server:
            async with Client(server.url) as client:
                assert await client.identify() == name


async def test_a_server_that_is_no_engine_is_a_clear_error() -> None:
    with fake_engine({}) as server:
        async with Client(server.url) as client:
            with pytest.raises(BadAnswer, match="neither llama-server"):
                await client.identify()


async def test_a_model_the_server_does_not_serve_is_named() -> None:
    with fake_engine(openai_routes(Answer.events())) as server:
        async with Client(server.url, access=Access(engine="openai", model="nope")) as client:
            with pytest.raises(BadAnswer, match=r"serves no model 'nope'.*gpt-x"):
                await client.describe()


FIND_TOOL = {
    "type": "function",
    "function": {
        "name": "find_tool",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}


def test_a_json_call_is_constrained_on_vllm_once_it_opens() -> None:
    tag = structural_tag(QWEN, [FIND_TOOL])
    assert tag is not None
    triggered = json.loads(tag)["format"]
    assert triggered["type"] == "triggered_tags"
    assert triggered["triggers"] == ['<tool_call>\n{"name": "']
    (only,) = triggered["tags"]
    assert only["begin"] == '<tool_call>\n{"name": "find_tool", "arguments": '
    assert only["content"]["json_schema"]["required"] == ["query"]
    assert only["end"] == "}\n</tool_call>"
    # Parameters one by one are not xgrammar's JSON: those calls go unconstrained.
    assert structural_tag(QWEN_CODER, [FIND_TOOL]) is None
    assert structural_tag(QWEN, []) is None


async def test_the_vllm_request_carries_the_constraint_of_its_tools() -> None:
    stream = Answer.events(piece("Hi", [10]), piece("", [2], finish="stop"), usage(5, 2, 0))
    with fake_engine(vllm_routes(stream)) as server:
        async with Client(server.url, access=Access(engine="vllm")) as client:
            request = PromptRequest(prompt=["ab"], format=QWEN, tools=(FIND_TOOL,))
            await client.chat(request, lambda _: None)
    (body,) = server.bodies("/v1/completions")
    assert body["structured_outputs"] == {"structural_tag": structural_tag(QWEN, [FIND_TOOL])}


async def test_a_bad_answer_fails_the_turn_and_leaves_a_valid_log(tmp_path: Path) -> None:
    """A real `loopd serve` on a scripted vLLM whose answer comes without token ids: the turn
    fails with the reason, and the session's log is a valid conversation."""
    with fake_engine(vllm_routes(Answer.events(piece("Hi", None)))) as server:
        d = Daemon(tmp_path / "loopd", server.url, history="exact")
        await d.start()
        try:
            client = await d.connect()
            session = await welcome(client, {"type": "hello", "session": "new"})
            lines = await client.turn("t1", "Hello", timeout=60)
        finally:
            await d.end()
    assert lines[-1]["type"] == "turn_failed"
    assert "without its token ids" in lines[-1]["message"]
    log = records(d, session)
    assert conversation_problems(log) == []
    assert [r.kind for r in log][-1] == "turn_end"


async def test_loopd_pointed_at_a_server_that_is_no_engine_stops_at_start_saying_so(
    tmp_path: Path,
) -> None:
    with fake_engine({"/": Answer(200, b"<html>a web page</html>", "text/html")}) as server:
        d = Daemon(tmp_path / "loopd", server.url, history="exact")
        with d.log.open("ab") as log:
            process = await trio.lowlevel.open_process(d.command("serve"), stdout=log, stderr=log)
        with trio.fail_after(30):
            status = await process.wait()
    assert status != 0
    said = d.log.read_text()
    assert "is neither llama-server (no /props) nor an OpenAI-compatible server" in said


async def test_a_llama_server_loading_its_model_is_not_taken_for_another_server() -> None:
    """While it loads, llama-server answers `/props` with 503 and `/v1/models` with 200."""
    loading = {
        "/props": Answer.of({"error": {"message": "Loading model", "code": 503}}, 503),
        "/v1/models": Answer.of({"data": [{"id": "m.gguf", "owned_by": "llamacpp"}]}),
    }
    with fake_engine(loading) as server:
        async with Client(server.url) as client:
            with pytest.raises(HttpError) as raised:
                await client.identify()
    assert raised.value.status == 503
    locked = {**loading, "/props": Answer.of({"error": {"code": 401}}, 401)}
    with fake_engine(locked) as server:  # its /props wants a key loopd was not given
        async with Client(server.url) as client:
            assert await client.identify() == "llama"


@pytest.mark.parametrize("reason", ["abort", "error"])
async def test_an_answer_vllm_ended_otherwise_than_by_stop_or_length_is_broken(
    reason: str,
) -> None:
    stream = Answer.events(piece("Hel", [10]), piece("", [11], finish=reason), usage(5, 2, 0))
    with pytest.raises(StreamBroken, match=f"ended the answer with '{reason}'"):
        await vllm_completion(stream, engine="vllm")


async def test_a_vllm_stream_done_without_a_finish_is_broken() -> None:
    with pytest.raises(StreamBroken, match="without a finish reason"):
        await vllm_completion(Answer.events(piece("Hel", [10])), engine="vllm")


async def test_the_block_size_named_in_the_config_stands_where_metrics_cannot_be_read() -> None:
    """A router in front of vLLM: no `/metrics` of vLLM's."""
    stream = Answer.events(piece("a", [10], finish="stop"), usage(40, 1, 16))
    routes = {**vllm_routes(stream), "/metrics": Answer(404, b"not found", "text/plain")}
    with fake_engine(routes) as server:
        async with Client(server.url, access=Access(engine="vllm", block_size=16)) as client:
            assert (await client.describe()).block == 16
            done = await client.chat(prompt_request(), lambda _: None)
    assert done.timings is not None
    assert done.timings.block == 16


async def test_a_json_answer_past_the_cap_is_a_lost_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The small requests go over the streams' own HTTP (`_stream`), bounded as they are: a
    server's answer cannot fill loopd's memory."""
    monkeypatch.setattr(_stream, "MAX_BODY", 1000)
    props = {"chat_template": "x" * 2000, "default_generation_settings": {}}
    with fake_engine({"/props": Answer.of(props)}) as server:
        async with Client(server.url) as client:
            with pytest.raises(ConnectionLost, match="an answer of over 1000 bytes"):
                await client.chat_template()
            monkeypatch.setattr(_stream, "MAX_BODY", 1 << 20)
            assert await client.chat_template() == "x" * 2000


async def test_a_servers_start_is_what_it_says_or_when_it_answered_again_after_away() -> None:
    """`started_at`, which a cache lost to a restart is recorded with: vLLM's own start time;
    for a server that says none, the moment it is described again after a health check found
    it away (one a caller's deadline cut counts), and never while it was not away."""
    with fake_engine(vllm_routes(Answer.events())) as server:
        async with Client(server.url, access=Access(engine="vllm")) as client:
            await client.describe()
            assert client.started_at == 1796041000.5
    silent = Answer(200, METRICS.splitlines(keepends=True)[0].encode(), "text/plain")
    routes = {**vllm_routes(Answer.events()), "/metrics": silent, "/health": Answer.of({})}
    with fake_engine(routes) as server:
        async with Client(server.url, access=Access(engine="vllm")) as client:
            await client.describe()
            assert await client.healthy()
            await client.describe()
            assert client.started_at is None  # it never went away
            with trio.move_on_after(0):  # a health check cut short: no answer, as far as seen
                await client.healthy()
            before = time.time()
            await client.describe()
            assert client.started_at is not None
            assert client.started_at >= before
