"""Every request to the model's server, spoken with h11 on a connection of its own: a streamed
completion (`post`, then its events a line at a time) and a small JSON request (`request`).

llama-server closes the connection after every stream (it says `Keep-Alive`, then closes), so
a streamed request never has one to reuse, and httpx's layers around h11 (its pool, redirects,
cookies, response models, the SSE reader on top) cost more than a new connection: `just bench
http` measures both stacks on the same requests (docs/benchmarks.md, section 20).
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import math
import os
import select
import socket
import ssl
from collections import deque

import h11
import httpx
import trio

__all__ = ["Broken", "Stream", "Unreachable", "post", "request"]

READ_SIZE = 1 << 16
MAX_LINE = 16 << 20
"""The longest line of an answer read, and the most data one event may hold. llama-server's
lines are an event each, well under a megabyte; a server that never ends a line (or an event)
must not fill loopd's memory."""
MAX_BODY = 64 << 20
"""The most a JSON answer may hold: a long history's token ids or rendering are megabytes."""
EVENTS = b"text/event-stream"
JSON = b"application/json"


class Unreachable(Exception):
    """No connection could be made."""


class Broken(Exception):
    """The connection broke, or what came over it was not HTTP."""


async def post(
    url: httpx.URL,
    body: bytes,
    *,
    connect_timeout: float,
    tls: ssl.SSLContext,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> Stream:
    """POST `body` (JSON) to `url`: the answer's stream, once the request is on the socket
    (its head is read by `read_head`). `tls`: the context of an `https` URL. Raises
    `Unreachable` or `Broken`."""
    return await send(b"POST", url, body, connect_timeout=connect_timeout, tls=tls, headers=headers)


async def request(  # noqa: PLR0913 - a request's parts, each by name
    method: bytes,
    url: httpx.URL,
    body: bytes | None,
    *,
    connect_timeout: float,
    tls: ssl.SSLContext,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> tuple[int, bytes]:
    """A small request and its whole answer: its status and body (at most `MAX_BODY` bytes).
    `body`: JSON, or None for a GET. Raises `Unreachable` or `Broken`."""
    stream = await send(
        method, url, body, connect_timeout=connect_timeout, tls=tls, headers=headers, accept=JSON
    )
    try:
        await stream.read_head()
        return stream.status, await stream.body(MAX_BODY)
    finally:
        await trio.aclose_forcefully(stream)  # a whole answer read: nothing more to say


async def send(  # noqa: PLR0913 - as `request`, and what it accepts
    method: bytes,
    url: httpx.URL,
    body: bytes | None,
    *,
    connect_timeout: float,
    tls: ssl.SSLContext,
    headers: list[tuple[bytes, bytes]] | None = None,
    accept: bytes = EVENTS,
) -> Stream:
    """Send a request: the answer's stream, once the request is on the socket."""
    stream = await _connect(url, connect_timeout, tls)
    try:
        length = None if body is None else len(body)
        fields = request_headers(url, length, accept) + (headers or [])
        try:
            await stream.send_all(request_head(url, fields, method) + (body or b""))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise Broken(f"could not send the request: {e!r}") from e
        # h11 reads the answer once it has seen the request go; told only now, as the server
        # works, its checks of the head are not on the way to every first token.
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method=method, target=url.raw_path, headers=fields))
        if body:
            conn.send(h11.Data(data=body))
        conn.send(h11.EndOfMessage())
    except BaseException:
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(stream)
        raise
    return Stream(stream, conn)


def request_headers(
    url: httpx.URL, length: int | None, accept: bytes = EVENTS
) -> list[tuple[bytes, bytes]]:
    """The head's fields of a request to `url` with `length` bytes of JSON (None: no body)."""
    if length is None:
        return [(b"Host", url.netloc), (b"Accept", accept)]
    return [
        (b"Host", url.netloc),
        (b"Content-Type", JSON),
        (b"Accept", accept),
        (b"Content-Length", b"%d" % length),
    ]


def request_head(
    url: httpx.URL, headers: list[tuple[bytes, bytes]], method: bytes = b"POST"
) -> bytes:
    """The head of a request to `url`, as h11 writes it."""
    fields = b"".join(b"%s: %s\r\n" % field for field in headers)
    return b"%s %s HTTP/1.1\r\n%s\r\n" % (method, url.raw_path, fields)


async def _connect(url: httpx.URL, timeout: float, tls: ssl.SSLContext) -> trio.abc.Stream:
    host, port = url.host, url.port or (443 if url.scheme == "https" else 80)
    deadline = trio.current_time() + timeout  # a deadline's scope only where something waits
    try:
        tcp = await _open_tcp(host, port, deadline)
        return await _secure(tcp, tls, host, deadline) if url.scheme == "https" else tcp
    except trio.TooSlowError as e:
        raise Unreachable(f"no connection within {timeout:g} s") from e
    except (OSError, trio.BrokenResourceError) as e:
        raise Unreachable(_why(e)) from e


def _why(error: BaseException) -> str:
    """What a failed connection says: the system's words ("Connection refused"), without
    the errno before them; for trio's TLS stream, which says only that it broke, its cause's."""
    why = error.__cause__ or error
    if isinstance(why, OSError) and why.strerror:
        return why.strerror
    return str(why) or repr(why)


async def _secure(
    tcp: trio.SocketStream, tls: ssl.SSLContext, host: str, deadline: float
) -> trio.SSLStream[trio.SocketStream]:
    secure = trio.SSLStream(tcp, tls, server_hostname=host, https_compatible=True)
    try:
        with trio.fail_at(deadline):
            await secure.do_handshake()
    except BaseException:
        await trio.aclose_forcefully(tcp)
        raise
    return secure


async def _open_tcp(host: str, port: int, deadline: float = math.inf) -> trio.SocketStream:
    """A connection to `host` by `deadline` (else `TooSlowError`): an address literal is
    connected to at once, without the name lookup and the staggered attempts
    `open_tcp_stream` makes for a name."""
    family = _family(host)
    if family is None:
        with trio.fail_at(deadline):
            return await trio.open_tcp_stream(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        await _connect_socket(sock, (host, port), deadline)
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(trio.socket.from_stdlib_socket(sock))


@functools.cache
def _family(host: str) -> socket.AddressFamily | None:
    """The address family of an address literal; None for a name."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return socket.AF_INET6 if address.version == 6 else socket.AF_INET


async def _connect_socket(sock: socket.socket, address: tuple[str, int], deadline: float) -> None:
    """Connect `sock`. On a local server the handshake is done when `connect` returns:
    waiting for the socket to be writable through trio's loop would cost a pass of it."""
    sock.settimeout(0)  # non-blocking
    error = sock.connect_ex(address)
    if error in (errno.EINPROGRESS, errno.EINTR):  # EINTR: the connection goes on all the same
        if not _writable(sock):
            with trio.fail_at(deadline):
                await trio.lowlevel.wait_writable(sock)
        error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if error:
        raise OSError(error, os.strerror(error))


def _writable(sock: socket.socket) -> bool:
    poll = select.poll()
    poll.register(sock, select.POLLOUT)
    return bool(poll.poll(0))


class Stream(trio.abc.AsyncResource):
    """The answer to a request on the socket: its head (`read_head`), then its body a line
    or a server-sent event at a time."""

    def __init__(self, stream: trio.abc.Stream, conn: h11.Connection) -> None:
        self._stream, self._conn = stream, conn
        self.status = 0
        self.content_type = ""
        self._lines: deque[bytes] = deque()
        self._partial: list[bytes] = []
        """The pieces of a line not ended yet: joined once it ends, not on every read."""
        self._partial_size = 0
        self._ended = False

    async def read_head(self) -> None:
        """Read the answer's head (`status`, `content_type`) unless it was. Cancelled while it
        waits, it can be called again: nothing read is lost."""
        while not self.status:
            event = await self._next_event()
            if isinstance(event, h11.Response):
                self.status = event.status_code
                types = [v for k, v in event.headers if k == b"content-type"]
                self.content_type = types[0].decode("latin-1") if types else ""
                return
            if not isinstance(event, h11.InformationalResponse):  # a 1xx comes first
                raise Broken(f"no answer, but {event!r}")

    async def event_data(self) -> str | None:
        """The data of the next server-sent event; None once the body ended (an event cut off
        by the end is dropped, as the SSE standard says)."""
        data: list[str] = []
        size = 0
        while (line := await self.line()) is not None:
            if not line:
                if data:
                    return "\n".join(data)
                continue
            field, _, value = line.decode("utf-8", errors="replace").partition(":")
            if field == "data":
                data.append(value.removeprefix(" "))
                size += len(line)
                if size > MAX_LINE:
                    raise Broken(f"an event of over {MAX_LINE} bytes")
        return None

    async def line(self) -> bytes | None:
        """The body's next line, without its end; None once the body ended."""
        while not self._lines:
            if self._ended:
                rest, self._partial, self._partial_size = b"".join(self._partial), [], 0
                return rest or None
            piece = await self._body()
            if piece is None:
                self._ended = True
                continue
            first, *ended = piece.split(b"\n")
            self._partial.append(first)
            self._partial_size += len(first)
            if self._partial_size > MAX_LINE:
                raise Broken(f"a line of over {MAX_LINE} bytes")
            if ended:
                *whole, last = ended
                self._lines.extend([b"".join(self._partial), *whole])
                self._partial, self._partial_size = [last], len(last)
        return self._lines.popleft().removesuffix(b"\r")

    async def body(self, limit: int) -> bytes:
        """The whole body, after its head; `Broken` past `limit` bytes."""
        pieces, size = [], 0
        while (piece := await self._body()) is not None:
            pieces.append(piece)
            size += len(piece)
            if size > limit:
                raise Broken(f"an answer of over {limit} bytes")
        return b"".join(pieces)

    async def aclose(self) -> None:
        """Close the connection: llama-server stops generating for it."""
        await self._stream.aclose()

    async def _body(self) -> bytes | None:
        while True:
            event = await self._next_event()
            if isinstance(event, h11.Data):
                return bytes(event.data)
            if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return None

    async def _next_event(self) -> type[h11.PAUSED | h11.NEED_DATA] | h11.Event:
        try:
            while True:
                event = self._conn.next_event()
                if event is not h11.NEED_DATA:
                    return event
                self._conn.receive_data(bytes(await self._stream.receive_some(READ_SIZE)))
        except h11.RemoteProtocolError as e:
            raise Broken(str(e)) from e
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise Broken(repr(e)) from e
