"""The HTTP(S) proxy a sandboxed command reaches the network through, where `[tools.run]
network` is a list of domains.

The command has a network namespace of its own (`--unshare-net`: its loopback, nothing else),
so it has no way out but this proxy. The proxy's listening socket is made inside that
namespace and handed out to loopd before the command starts: `wrap` puts a small program
(`HELPER`, run by loopd's own Python) in front of the command, which binds 127.0.0.1:3128
there, sends that socket to loopd over a stream pair made for it, closes its end and becomes
the command. loopd accepts the command's connections on that socket, as a socket keeps the
namespace it was made in, and connects out from its own. Nothing of loopd's runs inside the
sandbox after that, and the helper has no power the command lacks: a command that replaced it
could only do what it can do itself.

Each connection carries one request: `CONNECT host:port` (https, a tunnel, as Claude Code's
sandbox and Codex's proxy serve it) or a plain request with an absolute URL (http), forwarded
with `Connection: close`. A host the list does not name is answered 403, with the reason in
the status line and the body ("example.com is not allowed by [tools.run] network"), so the
command and the model read why; so is an address that is not the internet's unless the list
names it (`_hosts`), checked on the address actually connected to.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

import trio

from ._hosts import HostRefused, HostRules, Resolver, connect, host_of, system_resolver

__all__ = ["PORT", "PROXY_ENV", "Gate", "network_rules", "proxy"]

PORT = 3128
"""Where the proxy listens inside the command's network namespace (the port Codex uses)."""
PROXY_URL = f"http://127.0.0.1:{PORT}"
PROXY_ENV = {
    "HTTP_PROXY": PROXY_URL,
    "HTTPS_PROXY": PROXY_URL,
    "http_proxy": PROXY_URL,
    "https_proxy": PROXY_URL,
}
"""What the command is told (curl, pip, npm, git and Python read these)."""
MAX_HEAD = 64 * 1024
"""Bytes of a request's head at most."""
CONNECT_TIMEOUT = 30.0
AT_ONCE = 128
"""Connections of one command served at once; more wait to be accepted."""

HELPER = f"""
import os, socket, sys
channel = socket.socket(fileno=int(sys.argv[1]))
listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listener.bind(("127.0.0.1", {PORT}))
listener.listen(128)
socket.send_fds(channel, [b"L"], [listener.fileno()])
listener.close()
channel.close()
os.execv(sys.argv[2], sys.argv[2:])
"""
"""Run inside the sandbox, before the command: see the module's docstring."""


def network_rules(domains: tuple[str, ...] | list[str]) -> HostRules:
    return HostRules(domains, (), allow_key="[tools.run] network", deny_key="")


@dataclass(frozen=True)
class Gate:
    """What the sandbox needs of a running proxy."""

    fd: int
    """The helper's end of the stream pair: passed to the sandbox."""
    python: str

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` with the helper in front (`-I -S`: nothing of the environment or of
        site-packages is read)."""
        return [self.python, "-I", "-S", "-c", HELPER, str(self.fd), *argv]


@asynccontextmanager
async def proxy(
    rules: HostRules, resolve: Resolver = system_resolver, python: str = sys.executable
) -> AsyncIterator[Gate]:
    """A proxy for one command, serving until the block ends."""
    ours, theirs = socket.socketpair()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve, ours, rules, resolve)
            yield Gate(theirs.fileno(), python)
            nursery.cancel_scope.cancel()
    finally:
        ours.close()
        theirs.close()


async def _serve(channel: socket.socket, rules: HostRules, resolve: Resolver) -> None:
    """Take the listener the helper sends, then serve what connects to it."""
    channel.setblocking(False)  # noqa: FBT003 - the socket module's own signature
    while True:
        await trio.lowlevel.wait_readable(channel)
        try:
            _, fds, _, _ = socket.recv_fds(channel, 1, 1)
        except BlockingIOError:
            continue
        break
    if not fds:
        return  # the helper never ran: the command fails, saying why
    for extra in fds[1:]:
        socket.close(extra)
    listener = socket.socket(fileno=fds[0])
    if listener.family != socket.AF_INET or not listener.getsockopt(
        socket.SOL_SOCKET, socket.SO_ACCEPTCONN
    ):
        listener.close()  # not what the helper makes: serve nothing
        return
    listening = trio.SocketListener(trio.socket.from_stdlib_socket(listener))
    limit = trio.Semaphore(AT_ONCE)
    async with listening, trio.open_nursery() as nursery:
        while True:
            await limit.acquire()  # released when the client's request is done
            client = await listening.accept()
            nursery.start_soon(_client, client, rules, resolve, limit)


async def _client(
    client: trio.SocketStream, rules: HostRules, resolve: Resolver, limit: trio.Semaphore
) -> None:
    try:
        async with client:
            await _one_request(client, rules, resolve)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # the command or the server went away
    finally:
        limit.release()


@dataclass(frozen=True)
class _Request:
    host: str
    port: int
    tunnel: bool
    """CONNECT: a tunnel; else a plain request, `forward` its bytes for the server."""
    forward: bytes


def _parsed(head: bytes, rest: bytes) -> _Request | str:
    """The request a command sent, or why it is not one the proxy serves."""
    lines = head.split(b"\r\n")
    try:
        method, url, version = lines[0].decode("latin-1").split(" ")
    except ValueError:
        return "not an HTTP request"
    if method == "CONNECT":
        host, _, port = url.rpartition(":")
        forward = rest
    elif url.lower().startswith("http://"):
        authority, slash, path = url[len("http://") :].partition("/")
        host, colon, port = authority.rpartition(":")
        if not colon or not port.isdigit():
            host, port = authority, "80"
        line = f"{method} {slash}{path} {version}".encode("latin-1")
        forward = _forwarded(line, lines[1:]) + rest
    else:
        return "a request to a proxy is a CONNECT or names an http:// URL"
    host = host_of(host)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"no host and port in {url!r}"
    return _Request(host, int(port), method == "CONNECT", forward)


async def _one_request(client: trio.SocketStream, rules: HostRules, resolve: Resolver) -> None:
    head, rest = await _read_head(client)
    request = _parsed(head, rest) if head is not None else "the request's head is cut short"
    if isinstance(request, str):
        await _answer(client, 400, request)
        return
    if not rules.allowed(request.host):
        await _answer(client, 403, f"{request.host} is not allowed by [tools.run] network")
        return
    try:
        with trio.fail_after(CONNECT_TIMEOUT):
            server = await connect(rules, request.host, request.port, resolve)
    except HostRefused as e:
        await _answer(client, 403, str(e))
        return
    except (OSError, trio.TooSlowError) as e:
        await _answer(client, 502, f"{request.host} could not be reached: {e or 'no answer'}")
        return
    async with server:
        if request.tunnel:
            await client.send_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if request.forward:
            await server.send_all(request.forward)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_copy, client, server)
            nursery.start_soon(_copy, server, client)


def _forwarded(line: bytes, headers: list[bytes]) -> bytes:
    """The request as the server gets it: its own target, no proxy headers, one request."""
    kept = [
        h
        for h in headers
        if h
        and h.split(b":", 1)[0].strip().lower() not in (b"connection", b"keep-alive")
        and not h.lower().startswith(b"proxy-")
    ]
    return b"\r\n".join([line, *kept, b"Connection: close", b"", b""])


async def _read_head(client: trio.SocketStream) -> tuple[bytes | None, bytes]:
    """The request's head (without its blank line) and what came after it."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD:
            return None, b""
        chunk = await client.receive_some(65536)
        if not chunk:
            return None, b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


async def _answer(client: trio.SocketStream, status: int, why: str) -> None:
    """A refusal the command (and the model reading its output) can read: in the status line
    and in the body."""
    body = f"{why}\n".encode()
    reason = why.encode("latin-1", errors="replace").replace(b"\r", b" ").replace(b"\n", b" ")
    head = b"HTTP/1.1 %d %s\r\n" % (status, reason)
    head += b"Content-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n" % len(body)
    head += b"Connection: close\r\n\r\n"
    await client.send_all(head + body)


async def _copy(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    """Bytes from `source` to `sink` until `source` ends; then `sink` hears the end."""
    with suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        while chunk := await source.receive_some(65536):
            await sink.send_all(chunk)
    with suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        await sink.send_eof()
