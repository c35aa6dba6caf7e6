"""The llama-server client: one streamed chat completion at a time, under trio; it and the
small JSON requests each on a connection of its own (`_stream`, the one HTTP stack).

Events go to a plain callback, called in order from the task that reads the stream: a turn
passes them to its session actor's subscribers (each with `send_nowait` into a bounded
channel), tests append them to a list. Every deadline is
a trio cancel scope, so a caller's cancellation ends the HTTP stream at once, and closing it
makes llama-server cancel the generation and free the slot.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import httpx
import trio

from loopd.backoff import Backoff
from loopd.canonical import canonical
from loopd.collector import streaming

from ._engines import ENGINES, Engine, EngineName, Reader, ServerFacts, identify
from ._errors import (
    BadAnswer,
    ConnectError,
    ConnectionLost,
    HttpError,
    InferError,
    InferTimeout,
    StreamBroken,
    is_retryable,
)
from ._health import ServerHealth
from ._prompt_json import PromptJson
from ._stream import Broken, Stream, Unreachable, post, request
from ._types import (
    ChatEvent,
    ChatRequest,
    Completion,
    Content,
    PromptRequest,
    Queued,
    Reasoning,
    Retrying,
    ToolCallDelta,
    Waiting,
)

__all__ = [
    "Access",
    "AnyRequest",
    "Client",
    "Cut",
    "EventSink",
    "RetryPolicy",
    "Sent",
    "Timeouts",
    "is_output",
]

EventSink = Callable[[ChatEvent], None]
Sent = Callable[[], None]
"""Told that a request is written (`Client.chat`'s `sent`)."""
Cut = Callable[[Completion], None]
"""Handed the answer as far as it came when its stream ends without one (`Client.chat`'s
`cut`): the read was cancelled, passed a deadline, or the stream broke or said an error."""
AnyRequest = ChatRequest | PromptRequest

# An error body is read for its message only; a misbehaving server cannot make us hold more.
ERROR_BODY_LIMIT = 64 * 1024
# Closing a stream is a socket close; if it takes longer, something is wrong and we move on.
CLOSE_GRACE = 2.0
# Events that mean output reached the caller: after one of them, a retry would repeat it.
_OUTPUT = (Reasoning, Content, ToolCallDelta)


def is_output(event: ChatEvent) -> bool:
    """The event passes on part of the answer: a request that sent one must not be retried."""
    return isinstance(event, _OUTPUT)


@dataclass(frozen=True)
class Timeouts:
    """Deadlines of one request, in seconds."""

    connect: float = 5.0
    queue: float = 600.0
    """Until llama-server starts on the request (it sends nothing while the slot is busy)."""
    read: float = 120.0
    """Longest silence once streaming began (the server pings every 30 s of silence)."""
    queued_after: float = 0.25
    """llama-server sends no bytes at all while a request waits for a busy slot: a request
    without headers after this long is reported as `Queued`."""


@dataclass(frozen=True)
class RetryPolicy(Backoff):
    """loopd's backoff for requests: connect failures and 503 only, `attempts` tries."""

    base: float = 0.5
    cap: float = 8.0
    attempts: int = 5


@dataclass(frozen=True)
class SlotFile:
    """What a slot save or restore moved (`POST /slots/{id}?action=save|restore`)."""

    tokens: int
    """Tokens the file holds: the slot's cache, as many as its prompt and answer filled."""
    bytes: int
    ms: float


@dataclass(frozen=True)
class Access:
    """How a server is reached besides its URL (`[server]`)."""

    engine: EngineName = "llama"
    """What it is, until `identify` finds otherwise."""
    model: str | None = None
    """The model to ask for; None: the server's first."""
    api_key: str | None = field(default=None, repr=False)
    """Sent as `Authorization: Bearer ...`; never in a log (not even in this object's repr)."""
    affinity_header: str | None = None
    """The header each streamed request names its session in."""
    block_size: int | None = None
    """vLLM's cache block where its `/metrics` cannot be read (a router in front of it)."""


class Client:
    """A client for one server: llama-server, vLLM, or any OpenAI-compatible one (its
    `engine`). Use as `async with Client(url) as client:`."""

    def __init__(
        self,
        base_url: str,
        *,
        timeouts: Timeouts | None = None,
        retry: RetryPolicy | None = None,
        access: Access | None = None,
        health: ServerHealth | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts or Timeouts()
        self.retry = retry or RetryPolicy()
        self.health = health or ServerHealth()
        """Why the server is known to be away, as whoever runs it says (it exited and is
        being started again): the reason named when no connection can be made."""
        # One TLS context (httpx's, with its certificates) for every request (`_stream`), which
        # goes through no proxy the environment names. Read deadlines are cancel scopes below.
        self._tls = httpx.create_ssl_context()
        # The key goes in a header of every request and nowhere else: never in a log line,
        # a record or an error's text.
        access = access or Access()
        key = access.api_key
        self._headers = [(b"Authorization", b"Bearer " + key.encode())] if key else []
        self._urls: dict[str, httpx.URL] = {}
        self._affinity = access.affinity_header.encode() if access.affinity_header else None
        self._model = access.model
        self._block = access.block_size
        self.engine: Engine = ENGINES[access.engine](self, access.model, access.block_size)
        """What the server is (`identify`): llama-server until found otherwise."""
        self.reached = False
        """Some answer has come from the server since this client was made (any status: one
        that still loads its model counts). A server never reached is more likely a wrong
        URL than one that is away for a while, and a turn does not wait long for it."""
        self.started_at: float | None = None
        """When the server last came up, as far as loopd saw (seconds since the epoch): a
        cache lost across that restart is recorded with it as the reason (`describe`)."""
        self._away = False
        """A `healthy` found no answer since the server was last described."""

    @contextmanager
    def _reaching(self) -> Iterator[None]:
        """A request's errors before its answer began, mapped (`_mapped`); once one passes
        without them, the server is `reached`."""
        with _mapped(self.base_url, self.health.down):
            yield
        self.reached = True

    def be(self, engine: EngineName) -> None:
        """The server is `engine` (found, or named by `[server] engine`)."""
        if engine != self.engine.name:
            self.engine = ENGINES[engine](self, self._model, self._block)

    async def identify(self) -> EngineName:
        """Which engine the server is, asked of the server itself; raises an `InferError`
        where it cannot be reached or answers none of what an engine would."""
        return await identify(self)

    async def describe(self) -> ServerFacts:
        """The engine, model and context window, as the server says them; when it started
        (`started_at`), where it says so, or now where it says not and was away since it was
        last described (a `healthy` that found no answer): its cache went with it."""
        facts = await self.engine.describe()
        if facts.started is not None:
            self.started_at = facts.started
        elif self._away:
            self.started_at = time.time()
        self._away = False
        return facts

    def _url(self, path: str) -> httpx.URL:
        """`path` on the server, parsed once: httpx parses a path anew for each request, a
        cost on the way to every first token. (The paths loopd asks are few.)"""
        if (url := self._urls.get(path)) is None:
            url = self._urls[path] = httpx.URL(self.base_url + path)
        return url

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Nothing is held between requests: each has a connection of its own."""

    async def apply_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        thinking: bool = True,
        date: str | None = None,
    ) -> str:
        """The prompt the server's chat template makes of these messages."""
        return await self.engine.render(
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            thinking=thinking,
            date=date,
        )

    async def detokenize(self, tokens: list[int]) -> str:
        return await self.engine.detokenize(tokens)

    async def chat_template(self) -> str:
        """The chat template the server uses, where it tells it."""
        return await self.engine.chat_template()

    async def healthy(self) -> bool:
        """The server answers `/health` with 200 (it has loaded its model) within the read
        deadline."""
        answers = False
        try:
            with trio.move_on_after(self.timeouts.read):
                status, _ = await self._request(b"GET", self.engine.health)
                answers = status == 200
        except InferError:
            pass
        finally:  # a caller's deadline too: away, as far as loopd saw
            self._away = self._away or not answers
        return answers

    async def slot_file(self, slot: int, action: str, filename: str) -> SlotFile:
        """Save the slot's KV cache to `filename`, or restore it from there (in the server's
        `--slot-save-path`). A failed restore leaves the slot empty; raises `HttpError`."""
        answer = await self.post_json(f"/slots/{slot}?action={action}", {"filename": filename})
        tokens = answer.get("n_saved", answer.get("n_restored"))
        size = answer.get("n_written", answer.get("n_read"))
        ms = (answer.get("timings") or {}).get("save_ms" if action == "save" else "restore_ms")
        if not isinstance(tokens, int) or not isinstance(size, int):
            raise BadAnswer(f"llama-server's slot {action} answered {answer!r:.200}")
        return SlotFile(tokens, size, float(ms or 0.0))

    async def slot_held(self, slot: int) -> int | None:
        """Tokens the slot's cache holds now (`GET /slots`); None when the server does not say."""
        for entry in await self._slots() or []:
            if isinstance(entry, dict) and entry.get("id") == slot:
                held = entry.get("n_prompt_tokens", 0)  # absent: no request ran on it yet
                return held if isinstance(held, int) else None
        return None

    async def slot_count(self) -> int | None:
        """How many slots the server has (`GET /slots`); None when it does not say. It matters:
        llama-server takes an `id_slot` past its last slot modulo their number, so a request
        meant for a second slot of a one-slot server would overwrite the first one's cache."""
        slots = await self._slots()
        return None if slots is None else len(slots)

    async def _slots(self) -> list[Any] | None:
        return await self.engine.slots()

    async def get_any(self, path: str) -> object:
        """Any JSON `path` answers, within the read deadline; None where it answers an error,
        no JSON, or nothing in time."""
        with trio.move_on_after(self.timeouts.read):
            try:
                status, body = await self._request(b"GET", path)
                return json.loads(body) if status == 200 else None
            except (InferError, ValueError):
                return None
        return None

    async def get_text(self, path: str) -> str:
        """The text `path` answers (`/metrics`), within the read deadline."""
        with trio.move_on_after(self.timeouts.read):
            status, body = await self._request(b"GET", path)
            if status != 200:
                raise HttpError(status, _text(body[:ERROR_BODY_LIMIT]))
            return _text(body)
        raise InferTimeout(f"{self.base_url} did not answer {path} within {self.timeouts.read:g} s")

    async def get_json(self, path: str) -> dict[str, Any]:
        return await self._json(b"GET", path, None)

    async def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._json(b"POST", path, canonical(body))

    async def _request(
        self, method: bytes, path: str, body: bytes | None = None
    ) -> tuple[int, bytes]:
        """A small request's status and body, its errors mapped (`_reaching`); no deadline
        but the connection's: the caller's scope bounds the rest."""
        with self._reaching():
            return await request(
                method,
                self._url(path),
                body,
                connect_timeout=self.timeouts.connect,
                tls=self._tls,
                headers=self._headers,
            )

    async def _json(self, method: bytes, path: str, body: bytes | None) -> dict[str, Any]:
        """A small JSON request and its JSON answer, not a stream, with the read deadline: the
        server's properties, a template's rendering, tokens' text, a slot's save or restore."""
        with trio.move_on_after(self.timeouts.read):
            status, text = await self._request(method, path, body)
            if status != 200:
                raise HttpError(status, _text(text[:ERROR_BODY_LIMIT]))
            try:
                answer = json.loads(text)
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                raise BadAnswer(f"{self.base_url}{path} answered {answer!r:.200}")
            return answer
        raise InferTimeout(
            f"{self.base_url} did not answer {path} within {self.timeouts.read:g} s "
            "([server] read_timeout)"
        )

    async def chat_with_retry(
        self, request: AnyRequest, on_event: EventSink, *, prompts: PromptJson | None = None
    ) -> Completion:
        """`chat`, retried on connect failures and 503 until output has been passed on."""
        passed_on = False

        def relay(event: ChatEvent) -> None:
            nonlocal passed_on
            passed_on = passed_on or is_output(event)
            on_event(event)

        attempt = 1
        while True:
            try:
                return await self.chat(request, relay, prompts=prompts)
            except InferError as e:
                if passed_on or not is_retryable(e) or attempt >= self.retry.attempts:
                    raise
                delay = self.retry.delay(attempt)
                on_event(Retrying(attempt=attempt, delay=delay, why=str(e)))
                await trio.sleep(delay)
                attempt += 1

    async def chat(
        self,
        request: AnyRequest,
        on_event: EventSink,
        *,
        sent: Sent | None = None,
        prompts: PromptJson | None = None,
        cut: Cut | None = None,
    ) -> Completion:
        """Stream one completion, passing each event on; raises an `InferError` on failure.
        `sent` is called once the request is written, and again once it could no longer be
        (the first call counts): work beside the request starts then, so that the server has
        the request first. `prompts`: the encoder of the slot's last token-exact prompt
        (`Slot.prompts`). `cut` is handed the answer as far as it came where its stream
        began and ended without one, cancelled too (`Cut`)."""
        with streaming():  # no full garbage collection of loopd's stalls it
            try:
                path, body = await self.engine.request(request, prompts)
                headers = self._headers
                if self._affinity and (session := request.generation.affinity):
                    headers = [*headers, (self._affinity, session.encode())]
                stream = await self._open(self._url(path), body, on_event, sent, headers)
            finally:
                if sent is not None:
                    sent()
            try:
                return await self._read(stream, request, on_event, cut)
            finally:
                await _close(stream)

    async def _open(
        self,
        url: httpx.URL,
        body: bytes,
        on_event: EventSink,
        sent: Sent | None,
        headers: list[tuple[bytes, bytes]],
    ) -> Stream:
        """The answer's stream, once its head came and said 200."""
        stream: Stream | None = None
        try:
            queue = trio.move_on_after(self.timeouts.queue)
            with queue as waited, self._reaching():
                stream = await post(
                    url, body, connect_timeout=self.timeouts.connect, tls=self._tls, headers=headers
                )
                if sent is not None:
                    sent()
                await self._head(stream, on_event)
        except BaseException:
            if stream is not None:
                await _close(stream)
            raise
        if waited.cancelled_caught or stream is None:
            if stream is not None:
                await _close(stream)
            raise InferTimeout(
                f"{self.engine.title} did not start on the request within "
                f"{self.timeouts.queue:g} s "
                "([server] queue_timeout)"
            )
        if stream.status != 200:
            try:
                answer = await _read_limited(stream, self.timeouts.read)
            finally:
                await _close(stream)
            raise HttpError(stream.status, answer)
        return stream

    async def _head(self, stream: Stream, on_event: EventSink) -> None:
        """Wait for the answer's head, saying `Queued` if it is long in coming: llama-server
        sends nothing while the slot is busy."""
        with trio.move_on_after(self.timeouts.queued_after) as early:
            await stream.read_head()
        if early.cancelled_caught:
            on_event(Queued())
            await stream.read_head()  # reading it goes on where it was cut off

    async def _read(
        self, stream: Stream, request: AnyRequest, on_event: EventSink, cut: Cut | None
    ) -> Completion:
        on_event(Waiting())
        assembler, primed = self.engine.reader(request)
        for event in primed:
            on_event(event)
        try:
            return await self._events(stream, request, on_event, assembler)
        except BaseException:
            if cut is not None:  # sans-IO: what the assembler holds is what came, whole
                cut(assembler.completion())
            raise

    async def _events(
        self, stream: Stream, request: AnyRequest, on_event: EventSink, assembler: Reader
    ) -> Completion:
        if "text/event-stream" not in stream.content_type:
            raise StreamBroken(
                f"{self.engine.title} did not answer with an event stream: its content type is "
                f"{stream.content_type or 'not given'}"
            )
        try:
            while True:
                with trio.move_on_after(self.timeouts.read) as silent:
                    data = await stream.event_data()
                if silent.cancelled_caught:
                    raise InferTimeout(
                        f"{self.engine.title} sent nothing for {self.timeouts.read:g} s "
                        "([server] read_timeout)"
                    )
                if data is None:
                    raise StreamBroken(f"the stream ended without {self.engine.end(request)}")
                if (done := _take(assembler, data, on_event)) is not None:
                    return done
                # Many events can sit in one read; let the tasks that relay them to
                # clients run between events, so a burst never overflows their buffers.
                await trio.lowlevel.checkpoint()
        except Broken as e:  # once the answer began: `_open` maps what comes before
            raise ConnectionLost(f"the stream broke: {e}") from e


def _take(assembler: Reader, data: str, on_event: EventSink) -> Completion | None:
    """Pass on what one `data:` line holds; the completion once the stream is done."""
    events, done = assembler.feed(data), None
    if assembler.done:
        done = assembler.completion()
    elif (last := assembler.past_limit()) is not None:
        events, done = [*events, *last], assembler.completion(cut_by_client=True)
    for event in events:
        on_event(event)
    return done


@contextmanager
def _mapped(base_url: str, down: str | None) -> Iterator[None]:
    """The errors before an answer began (`_stream`'s), as loopd's: the one place they are
    mapped. No connection is a `ConnectError` (retried), saying why the
    server is `down` when that is known; a connection that broke before the answer,
    `ConnectionLost`."""
    try:
        yield
    except Unreachable as e:
        why = f" ({down})" if down else ""
        raise ConnectError(f"cannot connect to the server at {base_url}{why}: {e}", down) from e
    except Broken as e:
        raise ConnectionLost(f"the server closed the connection before answering: {e!r}") from e


def _text(body: bytes) -> str:
    return body.decode("utf-8", errors="replace")


async def _close(stream: Stream) -> None:
    # Shielded, so a cancelled request still closes its connection (which makes llama-server
    # cancel the generation); bounded, because a close must never hang a cancelled turn.
    with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_GRACE):
        await stream.aclose()


async def _read_limited(stream: Stream, timeout: float) -> str:
    body = bytearray()
    with trio.move_on_after(timeout):
        try:
            while len(body) < ERROR_BODY_LIMIT and (line := await stream.line()) is not None:
                body += line + b"\n"
        except Broken:
            pass  # the status says what matters; a cut body is still worth showing
    return body[:ERROR_BODY_LIMIT].decode("utf-8", errors="replace").removesuffix("\n")
