"""The streamed request's own HTTP and SSE reading, over real sockets: a server here writes a
crafted answer in pieces cut anywhere (inside a line end, inside a UTF-8 character), and the
events read back are the ones written."""

from __future__ import annotations

import itertools
import socket
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress

import h11
import httpx
import outcome
import pytest
import trio
import trustme
from hypothesis import given, settings
from hypothesis import strategies as st

from loopd.infer import _stream
from loopd.infer._stream import Broken, Stream, Unreachable, _open_tcp, post
from loopd.server_proc import free_port
from support.steps import counted_steps

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"


NO_TLS = ssl.create_default_context()  # the URLs here are http


async def read_request(stream: trio.abc.Stream) -> None:
    received = b""
    while b"\r\n\r\n" not in received:
        received += await stream.receive_some()
    head, _, body = received.partition(b"\r\n\r\n")
    fields = [h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
    length = fields[0][15:] if fields else b"0"  # a GET has no body
    while len(body) < int(length):
        body += await stream.receive_some()


@asynccontextmanager
async def answering(
    pieces: Sequence[bytes | trio.Event],
    host: str = "127.0.0.1",
    tls: ssl.SSLContext | None = None,
) -> AsyncIterator[int]:
    """A server on `host` (over TLS with `tls`) that reads one request and writes `pieces`,
    each in a write of its own (waiting where a piece is an event, until it is set), then
    closes; its port."""

    async def answer(tcp: trio.SocketStream) -> None:
        stream: trio.abc.Stream = tcp if tls is None else trio.SSLStream(tcp, tls, server_side=True)
        with suppress(trio.BrokenResourceError):  # a client that gave up (a TLS it refused)
            await read_request(stream)
            for piece in pieces:
                if isinstance(piece, trio.Event):
                    await piece.wait()
                    continue
                await stream.send_all(piece)
                await trio.sleep(0.001)  # a read of its own
        await trio.aclose_forcefully(stream)

    listeners = await trio.open_tcp_listeners(0, host=host)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, answer, listeners)
        yield listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()


async def events_of(pieces: Sequence[bytes], url: str = "http://127.0.0.1:{port}/x") -> list[str]:
    async def read(port: int) -> list[str]:
        target = httpx.URL(url.format(port=port))
        stream = await post(target, b"{}", connect_timeout=5, tls=NO_TLS)
        seen = []
        try:
            await stream.read_head()
            while (data := await stream.event_data()) is not None:
                seen.append(data)
        finally:
            await stream.aclose()
        return seen

    async with answering(pieces) as port:
        read_back = await outcome.acapture(read, port)  # raised out here, not in a group
    return read_back.unwrap()


def cut(data: bytes, at: Sequence[int]) -> list[bytes]:
    points = sorted({0, *(a % (len(data) + 1) for a in at), len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


BODY = (
    'data: {"content":"é"}\n\n'  # a two-byte character
    ": a comment line\r\n"
    'data:{"no":"space"}\r\n\r\n'
    "event: ignored\n"
    "data: one line\ndata: and another\n\n"
    "\n\n"  # blank lines alone are no event
    'data: {"last":true}\n\n'
    "data: cut off by the end, never dispatched\n"
).encode()
EVENTS = ['{"content":"é"}', '{"no":"space"}', "one line\nand another", '{"last":true}']


async def test_events_are_read_as_the_standard_says() -> None:
    assert await events_of([HEAD, chunked(BODY)]) == EVENTS


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(min_value=0), max_size=12))
def test_events_are_the_same_wherever_the_bytes_are_cut(at: list[int]) -> None:
    pieces = cut(HEAD + chunked(BODY), at)
    assert trio.run(events_of, pieces) == EVENTS


async def test_a_server_named_by_host_name_is_reached() -> None:
    assert await events_of([HEAD, chunked(BODY)], "http://localhost:{port}/x") == EVENTS


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 on this machine")
async def test_an_ipv6_address_is_reached() -> None:
    try:
        async with answering([HEAD, chunked(BODY)], host="::1") as port:
            stream = await post(
                httpx.URL(f"http://[::1]:{port}/x"), b"{}", connect_timeout=5, tls=NO_TLS
            )
            await stream.read_head()
            assert await stream.event_data() == EVENTS[0]
            await stream.aclose()
    except OSError as e:  # the loopback has no IPv6 address here
        pytest.skip(f"no IPv6 loopback: {e}")


async def test_a_local_server_is_connected_to_without_a_pass_of_the_loop() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        with counted_steps() as steps:
            stream = await _open_tcp("127.0.0.1", listener.getsockname()[1])
    finally:
        listener.close()
    await stream.aclose()
    # The handshake is done when `connect` returns: waiting on trio's loop for the socket
    # to be writable would put a pass of the loop before every request.
    assert steps.count == 0


async def test_a_server_that_never_completes_the_handshake_is_unreachable_by_the_deadline() -> None:
    """A server whose queue of connections is full drops the handshake: the connection waits,
    and the connect deadline ends the wait."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    first = socket.create_connection(("127.0.0.1", port))  # fills the queue: never accepted
    try:
        with trio.fail_after(10):  # past the deadline: the wait was not bounded
            with pytest.raises(Unreachable, match=r"no connection within 0\.2 s"):
                await post(
                    httpx.URL(f"http://127.0.0.1:{port}/x"), b"{}", connect_timeout=0.2, tls=NO_TLS
                )
    finally:
        first.close()
        listener.close()


async def test_nothing_listening_is_unreachable() -> None:
    url = httpx.URL(f"http://127.0.0.1:{free_port()}/x")
    with pytest.raises(Unreachable):
        await post(url, b"{}", connect_timeout=5, tls=NO_TLS)


@pytest.mark.parametrize(
    "pieces",
    [
        [b""],  # closed before answering
        [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"],  # a head cut short
        [b"this is not HTTP\r\n\r\n"],
    ],
    ids=["nothing", "half a head", "not http"],
)
async def test_an_answer_that_is_not_http_is_broken(pieces: list[bytes]) -> None:
    with pytest.raises(Broken):
        await events_of(pieces)


async def test_a_line_that_never_ends_is_broken_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_stream, "MAX_LINE", 10_000)
    endless = b"data: " + b"x" * 4000
    with pytest.raises(Broken, match="a line of over 10000 bytes"):
        await events_of([HEAD, *(b"%x\r\n%s\r\n" % (len(endless), endless),) * 4])


async def test_an_event_that_never_ends_is_broken_at_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_stream, "MAX_LINE", 10_000)
    lines = b"data: " + b"x" * 1000 + b"\n"
    with pytest.raises(Broken, match="an event of over 10000 bytes"):
        await events_of([HEAD, *(b"%x\r\n%s\r\n" % (len(lines), lines),) * 12])


async def test_a_body_cut_before_its_end_is_broken() -> None:
    with pytest.raises(Broken):
        await events_of([HEAD, b"%x\r\ndata: {}\n\n" % 100])


async def test_a_head_long_in_coming_is_read_after_a_wait_was_cut_off() -> None:
    """As the client reads it when it says `Queued`: nothing read before the cut is lost."""
    go = trio.Event()
    late: list[bytes | trio.Event] = [
        b"HTTP/1.1 503 Service Unav",
        go,
        b"ailable\r\nContent-Length: 7\r\n\r\n",
        b"loading",
    ]
    async with answering(late) as port:
        stream = await post(
            httpx.URL(f"http://127.0.0.1:{port}/x"), b"{}", connect_timeout=5, tls=NO_TLS
        )
        assert isinstance(stream, Stream)
        with trio.move_on_after(0.05) as waited:  # the first piece read, not the rest
            await stream.read_head()
        assert waited.cancelled_caught
        go.set()
        await stream.read_head()
        assert (stream.status, stream.content_type) == (503, "")
        assert await stream.line() == b"loading"
        assert await stream.line() is None
        await stream.aclose()


async def test_an_https_server_is_reached_with_the_context_given() -> None:
    authority = trustme.CA()
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(served)
    trusting = ssl.create_default_context()
    authority.configure_trust(trusting)
    async with answering([HEAD, chunked(BODY)], tls=served) as port:
        url = httpx.URL(f"https://127.0.0.1:{port}/x")
        stream = await post(url, b"{}", connect_timeout=5, tls=trusting)
        await stream.read_head()
        assert await stream.event_data() == EVENTS[0]
        await stream.aclose()
    # A certificate the context does not trust: no connection.
    async with answering([HEAD, chunked(BODY)], tls=served) as port:
        url = httpx.URL(f"https://127.0.0.1:{port}/x")
        with pytest.raises(Unreachable, match="CERTIFICATE_VERIFY_FAILED"):
            await post(url, b"{}", connect_timeout=5, tls=NO_TLS)


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:8080/completion", "http://[::1]:9/completion?x=1", "https://gpu.lan/c"],
)
def test_the_request_head_is_the_one_h11_writes(url: str) -> None:
    """The head is written by hand, h11 told of it once it is on the socket: the bytes must be
    those h11 itself would have sent."""
    parsed = httpx.URL(url)
    headers = _stream.request_headers(parsed, 1234)
    h11_head = h11.Connection(h11.CLIENT).send(
        h11.Request(method="POST", target=parsed.raw_path, headers=headers)
    )
    assert _stream.request_head(parsed, headers) == h11_head


async def test_a_small_request_is_answered_with_its_whole_body() -> None:
    """A JSON request (`request`): the status and the body, whatever the pieces it came in."""
    answer = b'{"tokens": [1, 2, 3]}'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    async with answering([head % len(answer), answer[:5], answer[5:]]) as port:
        url = httpx.URL(f"http://127.0.0.1:{port}/tokenize")
        got = await _stream.request(b"POST", url, b"{}", connect_timeout=5, tls=NO_TLS)
    assert got == (200, answer)


async def test_a_small_answer_past_the_cap_is_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that never ends its answer must not fill loopd's memory."""
    monkeypatch.setattr(_stream, "MAX_BODY", 10_000)
    piece = b"x" * 4000
    pieces = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"]
    pieces += [b"%x\r\n%s\r\n" % (len(piece), piece)] * 4
    async with answering(pieces) as port:
        url = httpx.URL(f"http://127.0.0.1:{port}/props")
        with pytest.raises(Broken, match="an answer of over 10000 bytes"):
            await _stream.request(b"GET", url, None, connect_timeout=5, tls=NO_TLS)


def test_a_request_without_a_body_has_the_head_h11_writes() -> None:
    parsed = httpx.URL("http://127.0.0.1:8080/props")
    headers = _stream.request_headers(parsed, None, _stream.JSON)
    h11_head = h11.Connection(h11.CLIENT).send(
        h11.Request(method="GET", target=parsed.raw_path, headers=headers)
    )
    assert _stream.request_head(parsed, headers, b"GET") == h11_head
