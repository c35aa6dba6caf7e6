"""The ways to an MCP server, each an `mcp.Client` from the official SDK: a program loopd runs
over stdio, or a server at a URL over streamable HTTP, or over SSE (the older transport)
where the server refuses the new one, as the MCP specification's compatibility rule says.

A token for a server at a URL is read from the environment when loopd connects, and goes
only into the headers of the HTTP client that carries the requests: never into a
model's repr, a log line or an error's text. An HTTP status the server answers with is kept
aside for the error, which the SDK words only as 'Server returned an error response'.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loopd.config import McpServer, ToolsConfig

# The SDK is imported where a server is connected to: it takes a third of a second to import,
# which a loopd with no MCP server would pay at every start for nothing.
if TYPE_CHECKING:
    import httpx2
    from mcp import Client

__all__ = ["MissingToken", "Refused", "connect", "missing_tokens", "reached_at", "token_missing"]

FALLBACK_STATUSES = frozenset({400, 404, 405})
"""What a server of the older transport answers a POST of the new one with (the MCP
specification's rule for clients that reach both): then SSE is tried."""


class MissingToken(Exception):
    """The variable a server's `bearer_token_env` names is not set (or empty)."""


class Refused(Exception):
    """The server answered the connection with an HTTP error status."""


def token_missing(name: str, server: McpServer) -> str | None:
    """Why the server `name` cannot be reached where the variable its `bearer_token_env`
    names is not set (its name, never a value); None where it is, or none is named."""
    try:
        _headers(name, server)
    except MissingToken as e:
        return str(e)
    return None


def missing_tokens(tools: ToolsConfig) -> list[str]:
    """`token_missing` of each `[tools] mcp` server whose token is missing."""
    return [why for name, s in tools.mcp.items() if (why := token_missing(name, s)) is not None]


def reached_at(server: McpServer) -> str:
    """Where a server at a URL is and how it is reached: its URL and transport, never a
    header."""
    transports = {"auto": "streamable HTTP, else SSE", "http": "streamable HTTP", "sse": "SSE"}
    return f"{server.url} ({transports[server.transport]})"


@asynccontextmanager
async def connect(name: str, server: McpServer) -> AsyncIterator[Client]:
    """A client of the MCP server `name`, connected until the block ends. Raises
    `MissingToken`, `Refused`, or whatever the SDK or the connection raise."""
    from mcp import Client  # noqa: PLC0415 - the SDK when a server is connected to
    from mcp.client.stdio import StdioServerParameters  # noqa: PLC0415
    from mcp.client.streamable_http import streamable_http_client  # noqa: PLC0415

    if server.command is not None:
        params = StdioServerParameters(
            command=server.command[0],
            args=server.command[1:],
            env={**os.environ, **server.env},
        )
        async with Client(params) as client:
            yield client
        return
    assert server.url is not None  # noqa: S101 - the config has one or the other
    headers = _headers(name, server)
    if server.transport == "sse":
        async with _sse(server.url, headers) as client:
            yield client
        return
    statuses = _Statuses()
    try:
        opened = streamable_http_client(server.url, http_client=statuses.factory(headers))
        async with Client(opened) as client:
            statuses.connected = True
            yield client
    except Exception as e:
        refused = None if statuses.connected else statuses.refusal(server.url)
        if refused is None:
            raise
        if server.transport == "http" or statuses.status not in FALLBACK_STATUSES:
            raise refused from e
    else:
        return
    async with _sse(server.url, headers) as client:
        yield client


@asynccontextmanager
async def _sse(url: str, headers: dict[str, str]) -> AsyncIterator[Client]:
    from mcp import Client  # noqa: PLC0415 - as `connect`
    from mcp.client.sse import sse_client  # noqa: PLC0415

    statuses = _Statuses()
    try:
        opened = sse_client(url, headers=headers, httpx_client_factory=statuses.factory)
        async with Client(opened) as client:
            statuses.connected = True
            yield client
    except Exception as e:
        refused = None if statuses.connected else statuses.refusal(url)
        if refused is None:
            raise
        raise refused from e


def _headers(name: str, server: McpServer) -> dict[str, str]:
    headers = dict(server.headers)
    if server.bearer_token_env is not None:
        token = os.environ.get(server.bearer_token_env)
        if not token:
            raise MissingToken(
                f"[tools.mcp.{name}] bearer_token_env names ${server.bearer_token_env}, which "
                "is not set: export the server's token in it"
            )
        headers["Authorization"] = f"Bearer {token}"
    return headers


@dataclass
class _Statuses:
    """The first HTTP error status a connection's responses had, until it is connected."""

    status: int | None = None
    reason: str = ""
    connected: bool = False

    def factory(
        self,
        headers: dict[str, str] | None = None,
        timeout: httpx2.Timeout | None = None,
        auth: httpx2.Auth | None = None,
    ) -> httpx2.AsyncClient:
        from mcp.shared._httpx_utils import create_mcp_http_client  # noqa: PLC0415

        client = create_mcp_http_client(headers=headers, timeout=timeout, auth=auth)
        client.event_hooks["response"].append(self._seen)
        return client

    async def _seen(self, response: httpx2.Response) -> None:
        if not self.connected and self.status is None and response.status_code >= 400:
            self.status, self.reason = response.status_code, response.reason_phrase

    def refusal(self, url: str) -> Refused | None:
        if self.status is None:
            return None
        return Refused(f"{url} answered HTTP {self.status} {self.reason}".rstrip())
